"""A categorical network's model(x) / predict(x): a Categorical of class probabilities,
checked against an independent computation (the logits of a network with the weights at
their means, and Monte Carlo over weight draws)."""

from __future__ import annotations

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork, CategoricalLikelihood


def _network(outputs, logistic=False, init_scale=1e-4, hidden=(12,), seed=0):
    torch.manual_seed(seed)
    model = BayesianNetwork(
        5,
        list(hidden),
        outputs,
        likelihood=CategoricalLikelihood(logistic=logistic),
        init_scale=init_scale,
        generator=torch.Generator().manual_seed(seed),
    )
    return model.double()


def _mean_logits(model, x):
    """The logits of the network whose weights are their means (augmented input: a bias column)."""
    h = x
    for index, layer in enumerate(model.layers):
        h = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1) @ layer.loc.T
        if index < len(model.layers) - 1:
            h = torch.relu(h)
    return h


@pytest.mark.parametrize("logistic", [False, True])
def test_with_tiny_variance_the_probabilities_are_the_mean_networks_softmax(logistic):
    model = _network(1 if logistic else 4, logistic)
    x = torch.randn(30, 5, dtype=torch.float64)
    distribution = model(x)
    assert isinstance(distribution, torch.distributions.Categorical)
    logits = _mean_logits(model, x)
    if logistic:
        logits = torch.cat([torch.zeros_like(logits), logits], 1)
    torch.testing.assert_close(distribution.probs, torch.softmax(logits, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.predict(x).probs, distribution.probs)


@pytest.mark.parametrize("classes", [3, 10])
def test_with_weight_uncertainty_the_probabilities_track_monte_carlo(classes):
    """The predictive E_q[softmax(y)] by Monte Carlo over the weights (4,000 draws: its own error
    ~0.005) is the reference. With the logits' variance a few tenths, eq. (38)'s corrected
    softmax is within a few hundredths of it (an approximation: not closer than that)."""
    model = _network(classes, init_scale=0.1, seed=1)
    with torch.no_grad():
        for layer in model.layers:
            layer.loc.mul_(2.0)  # confident logits, as after training
    x = torch.randn(300, 5, dtype=torch.float64)
    _, variance = model.output_moments(x)
    assert 0.1 < variance.median() < 0.5
    probabilities = model.predict(x).probs
    draws = model.sample_outputs(x, 4000, generator=torch.Generator().manual_seed(2))
    monte_carlo = torch.softmax(draws, -1).mean(0).detach()
    error = (probabilities - monte_carlo).abs()
    assert error.mean() < 0.02 and error.max() < 0.15


def test_a_deeper_network_with_sampled_layers_averages_over_draws():
    model = _network(3, init_scale=0.2, hidden=(8, 8), seed=3)
    x = torch.randn(40, 5, dtype=torch.float64)
    one = model.predict(x, num_samples=300, generator=torch.Generator().manual_seed(0)).probs
    two = model.predict(x, num_samples=300, generator=torch.Generator().manual_seed(1)).probs
    torch.testing.assert_close(one.sum(-1), torch.ones(40, dtype=torch.float64))
    assert (one - two).abs().max() < 0.05  # Monte Carlo over the sampled first layer: close, not equal
    assert (one - two).abs().max() > 0
    exact = model.predict(x, estimator="deterministic").probs  # nothing sampled: no generator needed
    assert (exact - one).abs().mean() < 0.05
