"""bnn/vae.py: the Bayesian-decoder VAE's estimators against independent references."""

import math

import pytest
import torch

from cfbnn_cli.bnn.vae import BayesianDecoderVAE

DT = torch.float64


def _model(variant, seed=0, **kwargs):
    torch.manual_seed(seed)
    sizes = dict(data_dim=4, latent_dim=3, encoder_hidden=[8], decoder_hidden=6, init_scale=0.3)
    sizes.update(kwargs)
    model = BayesianDecoderVAE(variant=variant, generator=torch.Generator().manual_seed(seed), **sizes).double()
    with torch.no_grad():
        model.decoder.likelihood.log_precision.fill_(math.log(3.0))
    return model


def test_v3_decoder_ell_matches_monte_carlo_over_decoder_weights():
    """E_q(W)[log N(x | W2 relu(W1 [z,1]) + ..., 1/beta)] in closed form vs 2x10^5 weight draws."""
    model = _model("v3")
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 3, generator=g, dtype=DT)
    x = torch.randn(5, 4, generator=g, dtype=DT)
    with torch.no_grad():
        exact = model.decoder_expected_log_likelihood(z, x)
        first, second = model.decoder.layers
        estimates = []
        for _ in range(20):
            S = 10_000
            W1 = first.loc + first.scale() * torch.randn((S,) + first.loc.shape, generator=g, dtype=DT)
            W2 = second.loc + second.scale() * torch.randn((S,) + second.loc.shape, generator=g, dtype=DT)
            ones = torch.ones(5, 1, dtype=DT)
            hidden = torch.relu(torch.cat([z, ones], 1) @ W1.transpose(-1, -2))
            out = torch.cat([hidden, ones.expand(S, 5, 1)], -1) @ W2.transpose(-1, -2)
            estimates.append(torch.distributions.Normal(out, model.precision**-0.5).log_prob(x).sum(-1))
        samples = torch.cat(estimates)
    mean = samples.mean(0)
    standard_error = samples.std(0) / math.sqrt(samples.shape[0])
    assert samples.shape[0] >= 100_000
    assert ((exact - mean).abs() / standard_error).max() < 4, (exact, mean, standard_error)


def test_v2_estimator_is_unbiased_for_the_v3_value():
    model3 = _model("v3")
    model2 = _model("v2")
    model2.load_state_dict(model3.state_dict())
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 3, generator=g, dtype=DT)
    x = torch.randn(5, 4, generator=g, dtype=DT)
    with torch.no_grad():
        exact = model3.decoder_expected_log_likelihood(z, x)
        draws = model2.decoder_expected_log_likelihood(z.expand(100_000, 5, 3), x, g)
    z_score = (exact - draws.mean(0)).abs() / (draws.std(0) / math.sqrt(draws.shape[0]))
    assert z_score.max() < 4


def test_v1_importance_weighted_estimate_matches_brute_force_integration():
    """latent_dim = 1: log p(x) = log int N(x | f(z), 1/beta) N(z | 0, 1) dz by a dense grid."""
    model = _model("v1", latent_dim=1, seed=3)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4), dtype=DT)
    with torch.no_grad():
        grid = torch.linspace(-12, 12, 40_001, dtype=DT).unsqueeze(-1)
        mean = model.decoder.output_mean(grid)  # (G, 4)
        log_joint = torch.distributions.Normal(mean.unsqueeze(1), model.precision**-0.5).log_prob(x).sum(-1) + (
            torch.distributions.Normal(0.0, 1.0).log_prob(grid)
        )  # (G, 3)
        brute_force = torch.logsumexp(log_joint, 0) + math.log(grid[1, 0] - grid[0, 0])
        g = torch.Generator().manual_seed(5)
        trials = torch.stack([model.importance_weighted_log_likelihood(x, 20_000, g) for _ in range(10)])
    estimate = trials.mean(0)
    standard_error = trials.std(0) / math.sqrt(trials.shape[0])
    assert ((estimate - brute_force).abs() <= 4 * standard_error + 2e-3).all(), (estimate, brute_force)


@pytest.mark.parametrize("variant", ["v1", "v2", "v3"])
def test_importance_weighted_bound_exceeds_elbo_and_increases_with_k(variant):
    model = _model(variant, seed=6)
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(7), dtype=DT)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        elbo = torch.stack([model.elbo_per_point(x, g) for _ in range(400)]).mean(0)  # E[ELBO_n], no weight KL
        by_k = {}
        for k in (1, 10, 100):
            trials = torch.stack([model.importance_weighted_log_likelihood(x, k, g) for _ in range(400)])
            by_k[k] = (trials.mean(), trials.mean(1).std() / math.sqrt(trials.shape[0]))
    assert by_k[1][0] >= elbo.mean() - 4 * by_k[1][1]
    assert by_k[10][0] > elbo.mean() + 4 * by_k[10][1]
    assert by_k[10][0] > by_k[1][0] and by_k[100][0] > by_k[10][0]


def test_posterior_mean_reading_is_the_point_decoder_at_the_posterior_means():
    """``decoder_weights="posterior_mean"`` of a Bayesian decoder equals the IWAE estimate of a
    point-estimate (V1) decoder whose weights are set to the posterior means: the same z draws
    (one generator seed), the same numbers. For V1 the reading is the default one."""
    torch.manual_seed(0)
    x = torch.randn(7, 12, dtype=torch.float64)
    bayesian = BayesianDecoderVAE(12, 3, [10], 8, "v3", init_scale=0.3).double()
    point = BayesianDecoderVAE(12, 3, [10], 8, "v1").double()
    point.encoder.load_state_dict(bayesian.encoder.state_dict())
    with torch.no_grad():
        for gaussian, linear in zip(bayesian.decoder.layers, point.decoder.layers):
            linear.weight.copy_(gaussian.loc[:, :-1])
            linear.bias.copy_(gaussian.loc[:, -1])
        point.decoder.likelihood.log_precision.copy_(bayesian.decoder.likelihood.log_precision)
    plug_in = bayesian.importance_weighted_log_likelihood(
        x, 50, torch.Generator().manual_seed(5), decoder_weights="posterior_mean"
    )
    reference = point.importance_weighted_log_likelihood(x, 50, torch.Generator().manual_seed(5))
    torch.testing.assert_close(plug_in, reference)
    # with weight uncertainty the default reading differs (it integrates the weights out)
    sampled = bayesian.importance_weighted_log_likelihood(x, 50, torch.Generator().manual_seed(5))
    assert not torch.allclose(sampled, plug_in)
    same = point.importance_weighted_log_likelihood(
        x, 50, torch.Generator().manual_seed(5), decoder_weights="posterior_mean"
    )
    torch.testing.assert_close(same, reference)
    with pytest.raises(ValueError, match="decoder_weights"):
        bayesian.importance_weighted_log_likelihood(x, 5, decoder_weights="mean")
