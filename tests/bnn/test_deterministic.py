"""The ``deterministic`` estimator (moments propagated through every hidden layer) and the
heteroscedastic likelihood, against independent references: Monte Carlo of the exact
model (every layer sampled, tolerances from the Monte Carlo standard error plus the
approximation's stated bias bound), numerical integration (scipy), and the exact one-
hidden-layer closed form."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from cfbnn_cli.bnn.estimators import DeterministicPropagation
from cfbnn_cli.bnn.gradient_variance import gradient_variance
from cfbnn_cli.bnn.likelihoods import HeteroscedasticNormalLikelihood
from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.bnn.predictive import mixture_log_likelihood

# bias bounds of the diagonal propagation, stated in the README's table (benchmarks/deterministic_bias.py):
# on random ReLU networks with posterior s.d. <= 0.1 the propagated output variance is within 5 % of the
# exact one with 2 hidden layers and 15 % with 3 (measured: 1-2 % and 5-12 %: the correlations the
# diagonal propagation drops grow with depth), the heteroscedastic expected log-likelihood within
# 0.02 nats per point
VARIANCE_BIAS_BOUND = {2: 0.05, 3: 0.15}
ELL_BIAS_BOUND = 0.02


def _network(hidden, outputs=1, init_scale=0.1, seed=0, dtype=torch.float64, heteroscedastic=False):
    generator = torch.Generator().manual_seed(seed)
    likelihood = HeteroscedasticNormalLikelihood() if heteroscedastic else None
    return BayesianNetwork(6, hidden, outputs, init_scale=init_scale, generator=generator, likelihood=likelihood).to(
        dtype
    )


def _monte_carlo(net, x, samples=100_000, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return torch.cat([net.sample_outputs(x, 20_000, generator=generator) for _ in range(samples // 20_000)])


def test_one_hidden_layer_is_the_exact_closed_form():
    net = _network([20])
    x = torch.randn(9, 6, dtype=torch.float64)
    deterministic = net.output_moments(x, estimator="deterministic", noise=())
    analytic = net.output_moments(x, estimator="analytic", noise=())
    for a, b in zip(deterministic, analytic):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert net.noise_shapes(9, estimator="deterministic") == ()


@pytest.mark.parametrize("hidden", [[30, 30], pytest.param([30, 30, 30], marks=pytest.mark.slow)])
def test_propagated_moments_agree_with_monte_carlo(hidden):
    net = _network(hidden, init_scale=0.1)
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mean, variance = net.output_moments(x, estimator="deterministic", noise=())
    draws = _monte_carlo(net, x)
    mc_mean, mc_variance = draws.mean(0), draws.var(0)
    n = draws.shape[0]
    mean_se = (mc_variance / n).sqrt()
    # the mean: within 5 s.e. plus 5 % of an output s.d. (no bias was measured beyond the s.e.)
    assert ((mean - mc_mean).abs() <= 5 * mean_se + 0.05 * mc_variance.sqrt()).all(), (mean, mc_mean)
    # the variance: s.e. of a sample variance ~ var * sqrt(2 / n) (near-Normal outputs; kurtosis margin 2x)
    variance_se = mc_variance * math.sqrt(2.0 / n) * 2
    bound = VARIANCE_BIAS_BOUND[len(hidden)]
    assert ((variance - mc_variance).abs() <= 5 * variance_se + bound * mc_variance).all()


def _mc_moments(net, x, samples=200_000):
    draws = _monte_carlo(net, x, samples)
    return draws.mean(0), draws.var(0), draws.shape[0]


def test_full_covariance_propagation_is_exact_for_a_linear_network_where_the_diagonal_is_not():
    """Identity activations: means and covariances of products of independent variables
    propagate exactly, so ``deterministic_full`` must match Monte Carlo of the exact model
    within its standard error at every depth; the diagonal propagation, which drops the
    covariance between units, is visibly off on the same network (so the test can fail)."""
    generator = torch.Generator().manual_seed(5)
    net = BayesianNetwork(6, [12, 12, 12], 1, activation="identity", init_scale=0.3, generator=generator).double()
    x = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full_mean, full_variance = net.output_moments(x, estimator="deterministic_full", noise=())
        _, diagonal_variance = net.output_moments(x, estimator="deterministic", noise=())
    mc_mean, mc_variance, n = _mc_moments(net, x)
    variance_se = mc_variance * math.sqrt(2.0 / n) * 2  # kurtosis margin 2x
    assert ((full_mean - mc_mean).abs() <= 5 * (mc_variance / n).sqrt()).all()
    assert ((full_variance - mc_variance).abs() <= 5 * variance_se).all(), (full_variance - mc_variance) / variance_se
    assert ((diagonal_variance - mc_variance).abs() > 5 * variance_se).any()


# leaky_relu runs with the slow tests (the default suite keeps relu: the same code path)
@pytest.mark.parametrize("activation", ["relu", pytest.param("leaky_relu", marks=pytest.mark.slow)])
def test_full_covariance_propagation_agrees_with_monte_carlo_within_the_bias_bound(activation):
    """ReLU-type networks, 2 hidden layers: the only approximation left is that the second
    layer's pre-activations are taken as jointly Normal (their covariance is exact); the
    output variance is within the diagonal propagation's bound and at least as close."""
    generator = torch.Generator().manual_seed(0)
    net = BayesianNetwork(6, [30, 30], 1, activation=activation, init_scale=0.1, generator=generator).double()
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mean, variance = net.output_moments(x, estimator="deterministic_full", noise=())
        diagonal_mean, diagonal_variance = net.output_moments(x, estimator="deterministic", noise=())
    torch.testing.assert_close(mean, diagonal_mean)  # the means never depend on the covariances
    mc_mean, mc_variance, n = _mc_moments(net, x)
    variance_se = mc_variance * math.sqrt(2.0 / n) * 2
    assert ((variance - mc_variance).abs() <= 5 * variance_se + VARIANCE_BIAS_BOUND[2] * mc_variance).all()
    full_error = ((variance - mc_variance) / mc_variance).abs().mean()
    diagonal_error = ((diagonal_variance - mc_variance) / mc_variance).abs().mean()
    assert full_error <= diagonal_error + 2 * (variance_se / mc_variance).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_covariance_elbo_is_finite_with_finite_gradients_at_the_extremes(dtype):
    """Posterior s.d. down to ~0 (correlations at +-1 between units fed by the same inputs)
    and very wide posteriors, large inputs; the heteroscedastic likelihood on the same path."""
    x = torch.randn(8, 6, dtype=dtype, generator=torch.Generator().manual_seed(1)) * 20
    y = torch.randn(8, dtype=dtype)
    for init_scale, activation in (
        (1e-12, "relu"),
        (1e-3, "relu"),
        (1.0, "relu"),
        (1e-12, "leaky_relu"),
        (1.0, "leaky_relu"),
    ):
        for outputs, likelihood in ((1, None), (2, HeteroscedasticNormalLikelihood())):
            # as for the diagonal path: exp(Var[l] / 2) has no finite value past ~700 nats of variance
            scale = init_scale if outputs == 1 else min(init_scale, 0.3)
            net = BayesianNetwork(
                6,
                [10, 10],
                outputs,
                activation,
                init_scale=scale,
                likelihood=likelihood,
                generator=torch.Generator().manual_seed(2),
            ).to(dtype)
            loss = -net.elbo(x / (10 if outputs == 2 else 1), y, num_data=80, estimator="deterministic_full")
            loss.backward()
            assert torch.isfinite(loss), (init_scale, outputs)
            assert all(torch.isfinite(p.grad).all() for p in net.parameters()), (init_scale, outputs)


def test_full_covariance_needs_mean_field_layers_and_a_supported_activation():
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="mean-field"):
        BayesianNetwork(6, [5, 5], 1, covariance="full").double().output_moments(
            x, estimator="deterministic_full", noise=()
        )
    with pytest.raises(ValueError, match="relu_squared"):
        BayesianNetwork(6, [5, 5], 1, activation="relu_squared").double().output_moments(
            x, estimator="deterministic_full", noise=()
        )


def test_every_covariance_propagates_and_full_equals_diagonal_when_off_diagonal_is_zero():
    x = torch.randn(5, 6, dtype=torch.float64)
    diagonal = _network([8, 8])
    full = BayesianNetwork(6, [8, 8], 1, covariance="full", init_scale=0.1).double()
    with torch.no_grad():
        for d, f in zip(diagonal.layers, full.layers):
            f.loc.copy_(d.loc)
            f.log_scale.copy_(d.log_scale)
            f.off_diagonal.zero_()
    for a, b in zip(
        diagonal.output_moments(x, estimator="deterministic", noise=()),
        full.output_moments(x, estimator="deterministic", noise=()),
    ):
        torch.testing.assert_close(a, b)
    lowrank = BayesianNetwork(6, [8, 8], 1, covariance=["lowrank", "lowrank", "diagonal"], init_scale=0.1).double()
    mean, variance = lowrank.output_moments(x, estimator="deterministic", noise=())
    assert torch.isfinite(mean).all() and (variance > 0).all()


def test_deterministic_gradient_variance_is_zero_for_every_layer():
    net = _network([16, 16], init_scale=0.1)
    x = torch.randn(32, 6, dtype=torch.float64)
    y = torch.randn(32, dtype=torch.float64)
    # why zero is exact and not an estimate: the objective consumes no noise, and two gradients
    # taken under different random states are identical to the bit
    assert net.noise_shapes(32, estimator="deterministic") == ()
    gradients = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        net.zero_grad()
        (-net.elbo(x, y, num_data=320, estimator="deterministic")).backward()
        gradients.append([p.grad.clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*gradients))
    variances = gradient_variance(net, x, y, 320, "deterministic", num_samples=20, chunk_size=10)
    assert set(variances) == {name for name, _ in net.named_parameters()}
    assert all(v == 0.0 for v in variances.values()), variances
    sampled = gradient_variance(net, x, y, 320, "analytic", num_samples=20, chunk_size=10)
    assert sampled["layers.0.loc"] > 0  # the first layer is sampled under "analytic": it does vary


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_extremes_stay_finite_with_finite_gradients(dtype):
    x = torch.randn(8, 6, dtype=dtype) * 50  # large pre-activations: far into the tails
    y = torch.randn(8, dtype=dtype)
    for init_scale in (1e-12, 1e-3, 3.0):  # variances down to ~0 and very wide posteriors
        net = _network([10, 10, 10], init_scale=init_scale, dtype=dtype)
        loss = -net.elbo(x, y, num_data=80, estimator="deterministic")
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in net.parameters())
        # the log-variance output's spread enters as exp(Var[l] / 2): beyond ~700 nats of variance
        # (float64's exp range) no finite value exists, so the heteroscedastic net is checked up to 0.3
        het = _network([10, 10], outputs=2, init_scale=min(init_scale, 0.3), dtype=dtype, heteroscedastic=True)
        loss = -het.elbo(x / 10, y, num_data=80, estimator="deterministic")
        loss.backward()
        assert torch.isfinite(loss), init_scale
        assert all(torch.isfinite(p.grad).all() for p in het.parameters())


# ----------------------------------------------------------------------------- heteroscedastic


def test_heteroscedastic_ell_of_a_point_is_the_normal_log_density():
    """Zero covariance: E[log N(y | m, e^l)] is log N(y | m, e^l) itself (torch's Normal as reference)."""
    mean = torch.tensor([[0.3, -1.2], [2.0, 0.5]], dtype=torch.float64)
    y = torch.tensor([1.0, -0.5], dtype=torch.float64)
    ell = HeteroscedasticNormalLikelihood().expected_log_likelihood(y, mean, torch.zeros(2, 2, 2, dtype=torch.float64))
    reference = torch.distributions.Normal(mean[:, 0], (0.5 * mean[:, 1]).exp()).log_prob(y)
    torch.testing.assert_close(ell, reference)


@pytest.mark.parametrize("rho", [-1.0, -0.6, 0.0, 0.8, 1.0])
def test_heteroscedastic_ell_matches_numerical_integration_under_the_gaussian(rho):
    mu, sd = np.array([0.4, -0.3]), np.array([0.7, 0.5])
    y = 1.1
    covariance = np.array([[sd[0] ** 2, rho * sd[0] * sd[1]], [rho * sd[0] * sd[1], sd[1] ** 2]])

    def integrand(t):  # over l only: m | l is Normal, E[(y - m)^2 | l] in closed form
        l = mu[1] + sd[1] * t
        m_mean = mu[0] + rho * sd[0] * t
        m_var = sd[0] ** 2 * (1 - rho**2)
        return stats.norm.pdf(t) * -0.5 * (math.log(2 * math.pi) + l + math.exp(-l) * ((y - m_mean) ** 2 + m_var))

    reference, _ = integrate.quad(integrand, -12, 12, epsabs=1e-12)
    ell = HeteroscedasticNormalLikelihood().expected_log_likelihood(
        torch.tensor(y, dtype=torch.float64), torch.tensor(mu), torch.tensor(covariance)
    )
    assert float(ell) == pytest.approx(reference, abs=1e-9)


@pytest.mark.parametrize("rho,var_l", [(0.0, 0.25), (0.9, 0.25), (-1.0, 0.25), (0.5, 0.0)])
def test_predictive_mixture_matches_numerical_integration(rho, var_l):
    mu = np.array([0.2, -0.4])
    sd = np.array([0.6, math.sqrt(var_l)])
    covariance = torch.tensor([[sd[0] ** 2, rho * sd[0] * sd[1]], [rho * sd[0] * sd[1], sd[1] ** 2]])
    ys = np.array([-2.0, 0.1, 1.5, 4.0, 8.0])  # 8: an outlier whose density comes from l's far tail
    ours = mixture_log_likelihood(
        torch.tensor(ys),
        *HeteroscedasticNormalLikelihood.predictive_mixture(
            torch.tensor(mu).expand(len(ys), 2), covariance.expand(len(ys), 2, 2)
        ),
    ).numpy()
    for y, value in zip(ys, ours):
        if var_l == 0:
            reference = stats.norm.logpdf(y, mu[0], math.sqrt(sd[0] ** 2 + math.exp(mu[1])))
        else:

            def density(t):
                l = mu[1] + sd[1] * t
                return stats.norm.pdf(t) * stats.norm.pdf(
                    y, mu[0] + rho * sd[0] * t, math.sqrt(sd[0] ** 2 * (1 - rho**2) + math.exp(l))
                )

            reference = math.log(integrate.quad(density, -12, 12, epsabs=1e-13)[0])
        assert value == pytest.approx(reference, abs=1e-4), (y, value, reference)


@pytest.mark.parametrize("hidden", [[30], [30, 30]])
def test_heteroscedastic_network_ell_and_predictive_agree_with_monte_carlo(hidden):
    net = _network(hidden, outputs=2, init_scale=0.1, heteroscedastic=True, seed=4)
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ell = net.expected_log_likelihood_per_point(x, y, estimator="deterministic")
        predictive = mixture_log_likelihood(y, *net.predictive_components(x, estimator="deterministic"))
    draws = _monte_carlo(net, x)
    log_density = -0.5 * (
        math.log(2 * math.pi) + draws[..., 1] + (y - draws[..., 0]).square() * torch.exp(-draws[..., 1])
    )
    se = log_density.std(0) / math.sqrt(draws.shape[0])
    assert ((ell - log_density.mean(0)).abs() <= 5 * se + ELL_BIAS_BOUND).all()
    monte_carlo = torch.logsumexp(log_density, 0) - math.log(draws.shape[0])
    assert ((predictive - monte_carlo).abs() <= ELL_BIAS_BOUND).all(), (predictive, monte_carlo)


def test_heteroscedastic_covariance_of_the_outputs_matches_monte_carlo():
    """The (mean, log-variance) covariance the ELL uses, one hidden layer (exact in the model)."""
    net = _network([30], outputs=2, init_scale=0.2, heteroscedastic=True, seed=7)
    x = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad():
        mean, covariance = DeterministicPropagation().mean_and_covariance(net, net.point_features(x), ())
    draws = _monte_carlo(net, x)
    centred = draws - draws.mean(0)
    mc_covariance = torch.einsum("sni,snj->nij", centred, centred) / (draws.shape[0] - 1)
    scale = torch.diagonal(mc_covariance, dim1=-2, dim2=-1).sqrt()
    bound = 6 * (scale.unsqueeze(-1) * scale.unsqueeze(-2)) * math.sqrt(2.0 / draws.shape[0])
    assert ((covariance - mc_covariance).abs() <= bound).all()
    assert (covariance[:, 0, 1].abs() > 1e-6).all()  # the off-diagonal is really there


@pytest.mark.parametrize("heteroscedastic", [False, True])
def test_predictive_components_weights_sum_to_one_with_sampled_layers(heteroscedastic):
    """Under "analytic" a 2-hidden-layer net samples its first layer: the mixture is then
    num_samples draws x (1 or 64 nodes), and its weights still sum to one per point."""
    net = _network([8, 8], outputs=2 if heteroscedastic else 1, heteroscedastic=heteroscedastic)
    x = torch.randn(5, 6, dtype=torch.float64)
    means, variances, log_weights = net.predictive_components(
        x, estimator="analytic", num_samples=12, chunk=5, generator=torch.Generator().manual_seed(0)
    )
    assert means.shape[0] == 12 * (64 if heteroscedastic else 1) and means.shape == variances.shape == log_weights.shape
    torch.testing.assert_close(log_weights.exp().sum(0), torch.ones(5, dtype=torch.float64))
    assert (variances > 0).all()
