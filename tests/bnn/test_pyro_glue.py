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
        [
            Trace_ELBO(num_particles=particles // 40, vectorize_particles=True, max_plate_nesting=1).loss(
                model, guide, x, y
            )
            for _ in range(40)
        ]
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


def test_pyro_local_reparameterization_loss_averages_to_the_exact_elbo():
    """The Pyro local-reparameterization peer is an unbiased estimator of the same ELBO
    cfbnn computes exactly (diagonal q, output bias, Normal noise): checked by Monte Carlo
    within 4 standard errors."""
    from pyro.infer import TraceMeanField_ELBO

    from cfbnn_cli.bnn import BayesianNetwork, NormalLikelihood
    from cfbnn_cli.bnn.pyro_glue import PyroLocalReparameterizationRegression

    pyro.set_rng_seed(1)
    g = torch.Generator().manual_seed(1)
    D, H, N = 3, 5, 30
    x, y = torch.randn(N, D, generator=g), torch.randn(N, generator=g)
    network = BayesianNetwork(
        D, [H], 1, init_scale=0.3, prior_scale=0.7, generator=g, likelihood=NormalLikelihood(precision=2.0)
    )
    hidden, output = network.layers
    start = {
        "fc1.weight": hidden.loc[:, :-1],
        "fc1.bias": hidden.loc[:, -1],
        "fc2.weight": output.loc[:, :-1],
        "fc2.bias": output.loc[:, -1],
    }
    peer = PyroLocalReparameterizationRegression(D, H, "relu", prior_scale=0.7, init_scale=0.3, start=start)
    with torch.no_grad():  # distinct scales per entry, and the same noise as the network's
        hidden.log_scale.uniform_(-2.0, -0.5, generator=g)
        output.log_scale.uniform_(-2.0, -0.5, generator=g)
        for layer, name in ((hidden, "fc1"), (output, "fc2")):
            peer.__setattr__(f"{name}_weight_scale", layer.log_scale[:, :-1].exp().clone())
            peer.__setattr__(f"{name}_bias_scale", layer.log_scale[:, -1].exp().clone())
        peer.noise_scale = torch.tensor(2.0**-0.5)
        exact = -float(network.elbo(x, y, num_data=N))
    losses = torch.tensor(
        [
            TraceMeanField_ELBO(num_particles=200, vectorize_particles=False).loss(peer.model, peer.guide, x, y, N)
            for _ in range(8)
        ]
    )
    # single-particle spread from the batches of 200, for a standard error of the mean
    se = losses.std().item() / math.sqrt(len(losses))
    assert abs(losses.mean().item() - exact) < 4 * se + 1e-6, (losses.mean().item(), exact, se)
    assert se < 0.01 * abs(exact)  # the check has power: the spread is small against the value
