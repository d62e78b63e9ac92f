"""Pyro: the Monte Carlo Trace_ELBO of the model/guide averages to ClosedFormELBO, for the
defaults (learned precision, diagonal guide) and the options; the learned precision finds
the data's noise; the guide's covariance is the one asked for."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam

from cfbnn_cli.bnn.pyro_glue import BNNRegressionGuide, BNNRegressionModel, ClosedFormELBO


def _setup(a_covariance="diagonal", b_covariance="diagonal", learn_precision=True, seed=0):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 3, generator=g)
    y = torch.randn(20, generator=g)
    model = BNNRegressionModel(3, 4, activation="relu", prior_scale=0.8, precision=2.0, learn_precision=learn_precision)
    guide = BNNRegressionGuide(3, 4, a_covariance, b_covariance, init_scale=0.3, generator=g)
    with torch.no_grad():  # distinct scales per entry (and correlations for full rows), so every term counts
        for name in ("a_scale", "b_scale"):
            scale = getattr(guide, name)
            if scale.dim() == guide.a_loc.dim() + 1 or (name == "b_scale" and scale.dim() == 2):
                noise = 0.2 * torch.randn(scale.shape, generator=g)
                scale = torch.tril(noise, -1) + torch.diag_embed(torch.rand(scale.shape[:-1], generator=g) * 0.4 + 0.1)
            else:
                scale = torch.rand(scale.shape, generator=g) * 0.4 + 0.1
            setattr(guide, name, scale)
    return x, y, model, guide


def _monte_carlo_loss(model, guide, *args, batches=40, particles=500):
    """Mean and standard error of Trace_ELBO's loss from ``batches`` independent vectorized batches."""
    losses = torch.tensor(
        [
            Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1).loss(model, guide, *args)
            for _ in range(batches)
        ]
    )
    return losses.mean().item(), losses.std().item() / math.sqrt(batches)


@pytest.mark.parametrize(
    "a_covariance, b_covariance, learn_precision, num_data",
    [
        ("diagonal", "diagonal", True, None),  # the defaults
        ("diagonal", "diagonal", False, None),  # a fixed precision
        pytest.param("full", "full", True, None, marks=pytest.mark.slow),
        ("full", "diagonal", True, None),
        ("diagonal", "diagonal", True, 200),  # a minibatch of a larger data set
    ],
)
def test_trace_elbo_averages_to_closed_form(a_covariance, b_covariance, learn_precision, num_data):
    x, y, model, guide = _setup(a_covariance, b_covariance, learn_precision)
    args = (x, y) if num_data is None else (x, y, num_data)
    exact = ClosedFormELBO().loss(model, guide, *args)
    mean, se = _monte_carlo_loss(model, guide, *args)
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    assert se < 0.01 * abs(exact)  # the check has power: the spread is small against the value


def test_closed_form_of_another_guide_is_traced_and_agrees():
    """A guide that is not BNNRegressionGuide (here a plain function with its own
    ``pyro.param``s: a Normal q(A), a MultivariateNormal q(B)) goes through the traced route:
    the same expectation of Trace_ELBO's loss."""
    x, y, model, _ = _setup()
    g = torch.Generator().manual_seed(3)
    a_loc0, a_scale0 = torch.randn(4, 4, generator=g), torch.rand(4, 4, generator=g) * 0.4 + 0.1
    b_loc0, b_tril0 = (
        torch.randn(4, generator=g),
        torch.tril(0.2 * torch.randn(4, 4, generator=g), -1) + 0.3 * torch.eye(4),
    )

    def guide(x, y=None, num_data=None):
        a_loc, a_scale = pyro.param("q_a_loc", a_loc0), pyro.param("q_a_scale", a_scale0, dist.constraints.positive)
        b_loc, b_tril = pyro.param("q_b_loc", b_loc0), pyro.param("q_b_tril", b_tril0, dist.constraints.lower_cholesky)
        pyro.sample("A", dist.Normal(a_loc, a_scale).to_event(2))
        pyro.sample("B", dist.MultivariateNormal(b_loc, scale_tril=b_tril))

    exact = ClosedFormELBO().loss(model, guide, x, y)
    mean, se = _monte_carlo_loss(model, guide, x, y)
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    with pytest.raises(ValueError, match="Normal or MultivariateNormal"):  # AutoNormal's sites are Deltas
        auto = AutoNormal(model)
        ClosedFormELBO().loss(model, auto, x, y)


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
    # differentiable_loss reaches the guide's parameters and the learned precision
    loss = ClosedFormELBO().differentiable_loss(model, guide, x, y)
    store = pyro.get_param_store()
    params = [store.get_param(name).unconstrained() for name in ("a_loc", "a_scale", "b_loc", "b_scale", "precision")]
    grads = torch.autograd.grad(loss, params)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("start", [pytest.param(1.0, marks=pytest.mark.slow), 100.0])
def test_the_learned_precision_moves_to_the_data_noise(start):
    """y = sin(x) + noise of s.d. 0.5 (precision 4): from 1 or from 100 (far too sure), SVI with
    the closed form brings the precision near 4."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 1, generator=g)
    y = torch.sin(x[:, 0]) + 0.5 * torch.randn(400, generator=g)
    model, guide = BNNRegressionModel(1, 20, precision=start), BNNRegressionGuide(1, 20, generator=g)
    svi = SVI(model, guide, Adam({"lr": 0.03}), ClosedFormELBO())
    for _ in range(600):
        svi.step(x, y)
    learned = float(model.noise_precision().detach())
    assert 3.0 < learned < 5.0, learned


def test_a_fixed_precision_stays_and_is_no_parameter():
    x, y, model, guide = _setup(learn_precision=False)
    svi = SVI(model, guide, Adam({"lr": 0.05}), ClosedFormELBO())
    for _ in range(5):
        svi.step(x, y)
    assert "precision" not in pyro.get_param_store().keys()
    assert float(model.noise_precision()) == 2.0


@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_the_guide_has_the_covariance_asked_for(covariance):
    pyro.clear_param_store()
    x = torch.randn(5, 3)
    guide = BNNRegressionGuide(3, 4, a_covariance=covariance, b_covariance=covariance)
    trace = poutine.trace(guide).get_trace(x)
    a_fn, b_fn = trace.nodes["A"]["fn"], trace.nodes["B"]["fn"]
    while isinstance(a_fn, dist.Independent):
        a_fn = a_fn.base_dist
    while isinstance(b_fn, dist.Independent):
        b_fn = b_fn.base_dist
    if covariance == "diagonal":
        assert isinstance(a_fn, dist.Normal) and isinstance(b_fn, dist.Normal)
        assert guide.a_scale.shape == (4, 4) and guide.b_scale.shape == (4,)
    else:
        assert isinstance(a_fn, dist.MultivariateNormal) and isinstance(b_fn, dist.MultivariateNormal)
        assert guide.a_scale.shape == (4, 4, 4) and guide.b_scale.shape == (4, 4)
    assert BNNRegressionGuide(3, 4).a_covariance == "diagonal"  # the default, as ClosedFormBNN's
    with pytest.raises(ValueError, match="a_covariance"):
        BNNRegressionGuide(3, 4, a_covariance="lowrank")


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
