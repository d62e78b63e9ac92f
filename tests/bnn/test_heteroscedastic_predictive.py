"""The predictive of a heteroscedastic network (bnn/predictive.py): its moments against Monte Carlo
over the weights and the noise, and its intervals (the mixture's quantiles) against samples of it."""

import math

import torch

from cfbnn_cli.bnn.likelihoods import HeteroscedasticNormalLikelihood
from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.bnn.predictive import mixture_quantile


def test_the_mixtures_quantiles_are_where_its_samples_put_them():
    generator = torch.Generator().manual_seed(0)
    means = torch.tensor([[-2.0, 0.0, 5.0], [1.0, 0.0, 5.5]], dtype=torch.float64)  # (K=2, N=3)
    variances = torch.tensor([[0.25, 1.0, 4.0], [4.0, 1.0, 0.01]], dtype=torch.float64)
    weights = torch.tensor([[0.3, 0.5, 0.9], [0.7, 0.5, 0.1]], dtype=torch.float64)
    draws = 400_000
    component = (torch.rand(draws, 3, generator=generator, dtype=torch.float64) > weights[0]).long()
    picked_mean = means.gather(0, component)
    picked_sd = variances.gather(0, component).sqrt()
    samples = picked_mean + picked_sd * torch.randn(draws, 3, generator=generator, dtype=torch.float64)
    for probability in (0.05, 0.5, 0.95):
        quantile = mixture_quantile(means, variances, weights.log(), probability)
        share = (samples <= quantile).double().mean(0)  # the share of samples below it
        assert torch.all((share - probability).abs() < 4 * math.sqrt(probability * (1 - probability) / draws))


def test_its_mean_and_variance_are_those_of_y_over_the_weights_and_the_noise():
    """y = m + exp(l / 2) e with (m, l) the outputs of sampled weights: E[y] = E[m] and Var[y] = Var[m]
    + E[exp(l)]. The propagated moments treat l as Normal (exp(mu + var / 2)); with small posterior
    variances that holds closely, so Monte Carlo agrees within its standard error."""
    torch.manual_seed(3)
    network = BayesianNetwork(3, [20], 2, init_scale=0.05, likelihood=HeteroscedasticNormalLikelihood()).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    prediction = network.predict(x)
    draws = 200_000
    outputs = network.sample_outputs(x, draws, generator=torch.Generator().manual_seed(4))  # (S, N, 2)
    y = outputs[..., 0] + (0.5 * outputs[..., 1]).exp() * torch.randn(draws, 5, dtype=torch.float64)
    mean_se = (y.var(0) / draws).sqrt()
    assert torch.all((prediction.mean - y.mean(0)).abs() < 5 * mean_se)
    variance_se = y.var(0) * math.sqrt(2.0 / draws) * 3  # generous: y's tails are heavier than a Normal's
    assert torch.all((prediction.variance - y.var(0)).abs() < 5 * variance_se + 1e-3 * y.var(0))
    lower, upper = prediction.interval(0.9)
    inside = ((y >= lower) & (y <= upper)).double().mean(0)
    assert torch.all((inside - 0.9).abs() < 0.01)
