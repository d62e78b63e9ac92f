"""Predictions in the target's units (bnn/target_units.py) against torch.distributions written
independently: the log-normal a log-scale Normal implies, and a heteroscedastic model's mixture."""

import math

import torch

from cfbnn_cli.bnn.predictive import Predictive
from cfbnn_cli.bnn.target_units import in_target_units


def _normal(mean, variance):
    mean = torch.as_tensor(mean, dtype=torch.float32)
    variance = torch.as_tensor(variance, dtype=torch.float32)
    return Predictive(mean, 0.25 * variance, 0.25 * variance, 0.5 * variance, True)


def test_a_log_target_reads_back_as_the_log_normal_in_float64():
    prediction = in_target_units(_normal([0.1, -0.4], [0.3, 1.7]), target_mean=2.0, target_std=0.5, transform="log")
    reference = torch.distributions.LogNormal(
        torch.tensor([2.05, 1.8], dtype=torch.float64), 0.5 * torch.tensor([0.3, 1.7], dtype=torch.float64).sqrt()
    )
    y = torch.tensor([7.0, 3.0], dtype=torch.float64)
    assert prediction.mean.dtype == torch.float64
    torch.testing.assert_close(prediction.mean, reference.mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(prediction.variance, reference.variance, rtol=1e-6, atol=0)
    torch.testing.assert_close(prediction.log_prob(y), reference.log_prob(y), rtol=1e-6, atol=0)
    lower, upper = prediction.interval(0.9)
    torch.testing.assert_close(reference.cdf(upper) - reference.cdf(lower), torch.full_like(y, 0.9), rtol=1e-5, atol=0)
    assert prediction.log_prob(torch.tensor([-1.0, 0.0], dtype=torch.float64)).eq(-math.inf).all()


def test_a_heteroscedastic_log_target_scores_with_its_own_mixture():
    """The log scale's predictive is a mixture (a heteroscedastic model); its density on the target's
    scale is the mixture of log-normals, not the moment-matched one's."""
    means = torch.tensor([[0.0, 1.0], [0.5, -1.0]])
    variances = torch.tensor([[0.2, 0.05], [1.5, 0.6]])
    log_weights = torch.tensor([[0.3, 0.9], [0.7, 0.1]]).log()
    weights = log_weights.exp()
    mean = (weights * means).sum(0)
    spread = (weights * (variances + means.square())).sum(0) - mean.square()
    prediction = Predictive(mean, spread * 0, spread * 0, spread, True, (means, variances, log_weights))
    lognormal = in_target_units(prediction, target_mean=1.0, target_std=2.0, transform="log")
    reference = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(probs=weights.T.double()),
        torch.distributions.LogNormal(1.0 + 2.0 * means.T.double(), 2.0 * variances.T.double().sqrt()),
    )
    y = torch.tensor([4.0, 0.3], dtype=torch.float64)
    torch.testing.assert_close(lognormal.log_prob(y), reference.log_prob(y), rtol=1e-6, atol=0)
    lower, upper = lognormal.interval(0.9)
    torch.testing.assert_close(reference.cdf(upper) - reference.cdf(lower), torch.full_like(y, 0.9), rtol=0, atol=1e-6)
