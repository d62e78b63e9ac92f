"""Pyro: the Monte Carlo Trace_ELBO of the model/guide averages to ClosedFormELBO."""

import math

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import Adam

from cfbnn_cli.bnn.pyro_glue import BNNRegressionGuide, BNNRegressionModel, ClosedFormELBO


def _setup():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g)
    y = torch.randn(20, generator=g)
    model = BNNRegressionModel(3, 4, activation="relu", prior_scale=1.0, precision=2.0)
    guide = BNNRegressionGuide(3, 4, init_scale=0.3, generator=g)
    return x, y, model, guide


def test_trace_elbo_averages_to_closed_form():
    x, y, model, guide = _setup()
    exact = ClosedFormELBO().loss(model, guide, x, y)
    particles = 20_000
    estimator = Trace_ELBO(num_particles=1, vectorize_particles=True, max_plate_nesting=1)
    # per-particle losses: split into 40 independent vectorized batches
    batch_losses = torch.tensor(
        [Trace_ELBO(num_particles=particles // 40, vectorize_particles=True, max_plate_nesting=1).loss(model, guide, x, y) for _ in range(40)]
    )
    se = batch_losses.std().item() / math.sqrt(len(batch_losses))
    assert abs(batch_losses.mean().item() - exact) < 4 * se, (batch_losses.mean().item(), exact, se)
    del estimator


def test_svi_runs_with_both_losses_and_closed_form_has_no_noise():
    x, y, model, guide = _setup()
    svi_mc = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    svi_mc.step(x, y)
    svi_cf = SVI(model, guide, Adam({"lr": 0.01}), ClosedFormELBO())
    losses = [svi_cf.step(x, y) for _ in range(50)]
    assert losses[-1] < losses[0]
    loss_a = ClosedFormELBO().loss(model, guide, x, y)
    loss_b = ClosedFormELBO().loss(model, guide, x, y)
    assert loss_a == loss_b  # deterministic
    # differentiable_loss reaches the guide's parameters
    loss = ClosedFormELBO().differentiable_loss(model, guide, x, y)
    grads = torch.autograd.grad(loss, [guide.a_loc, guide.b_loc])
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
