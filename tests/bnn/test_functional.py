"""bnn/functional.py: closed-form ELL / ELBO / predictive moments against Monte Carlo over the weights.

The reference samples whole weight matrices from q (weight space, an independent
code path from the moment formulas) with >= 1e5 samples; tolerances are 4 standard
errors of the Monte Carlo mean.
"""

import math

import pytest
import torch
from torch.distributions import Independent, LowRankMultivariateNormal, MultivariateNormal, Normal, kl_divergence

from cfbnn_cli.bnn import (
    ClosedFormBNN,
    LowRankScale,
    kl_normal_rows,
    predictive_moments,
    regression_expected_log_likelihood,
)
from cfbnn_cli.bnn.functional import regression_ell_given_hidden
from cfbnn_cli.bnn.monte_carlo import (
    regression_ell_local_reparameterization,
    regression_ell_sample_a,
    regression_ell_weight_space,
    sample_hidden_local,
    sample_outputs_weight_space,
)

DT = torch.float64
N, D, H = 6, 4, 5


def _problem(a_kind, b_kind, outputs=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(N, D - 1, generator=g, dtype=DT), torch.ones(N, 1, dtype=DT)], 1)
    a_loc = 0.7 * torch.randn(H, D, generator=g, dtype=DT)
    diag = 0.1 + 0.4 * torch.rand(H, D, generator=g, dtype=DT)
    if a_kind == "diagonal":
        a_scale = diag
    elif a_kind == "full":
        a_scale = torch.tril(0.3 * torch.randn(H, D, D, generator=g, dtype=DT), -1) + torch.diag_embed(diag)
    else:
        a_scale = LowRankScale(diag, 0.3 * torch.randn(H, D, 2, generator=g, dtype=DT))
    shape = (H,) if outputs == 1 else (outputs, H)
    b_loc = torch.randn(shape, generator=g, dtype=DT)
    b_diag = 0.1 + 0.3 * torch.rand(shape, generator=g, dtype=DT)
    if b_kind == "diagonal":
        b_scale = b_diag
    else:
        b_scale = torch.tril(0.2 * torch.randn(shape + (H,), generator=g, dtype=DT), -1) + torch.diag_embed(b_diag)
    y = torch.randn((N,) if outputs == 1 else (N, outputs), generator=g, dtype=DT)
    return x, y, a_loc, a_scale, b_loc, b_scale


def _within(value, samples, n_se=4.0):
    se = samples.std().item() / math.sqrt(samples.numel())
    assert abs(value - samples.mean().item()) <= n_se * se, (value, samples.mean().item(), se)


ACTIVATIONS = ["relu", "leaky_relu", "relu_squared", "hard_sigmoid", "identity"]


@pytest.mark.parametrize("a_kind", ["diagonal", "full", "lowrank"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_ell_matches_weight_space_monte_carlo(a_kind, activation):
    x, y, a_loc, a_scale, b_loc, b_scale = _problem(a_kind, "full")
    beta = torch.tensor(1.5, dtype=DT)
    exact = regression_expected_log_likelihood(x, y, a_loc, a_scale, b_loc, b_scale, beta, activation).item()
    samples = regression_ell_weight_space(
        x, y, a_loc, a_scale, b_loc, b_scale, beta, activation, 100_000, torch.Generator().manual_seed(1)
    )
    _within(exact, samples)


@pytest.mark.parametrize("b_kind", ["diagonal", "full"])
def test_multi_output_ell_and_other_estimators(b_kind):
    x, y, a_loc, a_scale, b_loc, b_scale = _problem("full", b_kind, outputs=3, seed=4)
    beta = torch.tensor(0.8, dtype=DT)
    exact = regression_expected_log_likelihood(x, y, a_loc, a_scale, b_loc, b_scale, beta, "relu").item()
    for estimator in (regression_ell_weight_space, regression_ell_local_reparameterization, regression_ell_sample_a):
        samples = estimator(
            x, y, a_loc, a_scale, b_loc, b_scale, beta, "relu", 100_000, torch.Generator().manual_seed(2)
        )
        _within(exact, samples)


def test_predictive_mean_and_variance_match_monte_carlo():
    x, _, a_loc, a_scale, b_loc, b_scale = _problem("full", "full", seed=7)
    mean, var_a, var_b = predictive_moments(x, a_loc, a_scale, b_loc, b_scale, "relu")
    outputs = sample_outputs_weight_space(
        x, a_loc, a_scale, b_loc, b_scale, "relu", 400_000, torch.Generator().manual_seed(3)
    )
    for n in range(N):
        f = outputs[:, n]
        _within(mean[n].item(), f)
        centred_sq = (f - mean[n]) ** 2  # E = total variance (mean is exact)
        _within((var_a[n] + var_b[n]).item(), centred_sq)


def test_variance_decomposition_parts():
    """The parts of the decomposition, through the law of total variance:
    Var[f] = Var_A[E_B f] + E_A[Var_B f] with Var_A[E_B f] = b0^T diag(Var_g) b0 and
    E_A[Var_B f] = var_B + tr(Sigma_B diag(Var_g)); so var_A - tr(Sigma_B diag(Var_g))
    must equal the Monte Carlo variance of E_B f = g^T b0 over samples of A.
    (The per-unit Var_g come from predictive_moments with B = I, Sigma_B = 0.)"""
    x, _, a_loc, a_scale, b_loc, b_scale = _problem("diagonal", "full", seed=8)
    mean, var_a, var_b = predictive_moments(x, a_loc, a_scale, b_loc, b_scale, "relu")
    hidden = sample_hidden_local(x, a_loc, a_scale, "relu", 400_000, torch.Generator().manual_seed(4))
    e_b_f = hidden @ b_loc  # (S, N)
    var_a_part = (e_b_f - mean) ** 2  # Var_A[E_B f] = b0^T diag(Var) b0
    sigma_b = b_scale @ b_scale.T
    hidden_var = predictive_moments(x, a_loc, a_scale, torch.eye(H, dtype=DT), torch.zeros(H, H, dtype=DT), "relu")[1]
    for n in range(N):
        _within((var_a[n] - (torch.diagonal(sigma_b) * hidden_var[n]).sum()).item(), var_a_part[:, n])
    assert (var_b > 0).all() and (var_a > 0).all()


@pytest.mark.parametrize("prior_scale", [1.0, 0.7])
def test_kl_matches_torch_distributions(prior_scale):
    g = torch.Generator().manual_seed(5)
    loc = torch.randn(3, 4, generator=g, dtype=DT)
    diag = 0.2 + torch.rand(3, 4, generator=g, dtype=DT)
    tril = torch.tril(0.3 * torch.randn(3, 4, 4, generator=g, dtype=DT), -1) + torch.diag_embed(diag)
    factor = 0.3 * torch.randn(3, 4, 2, generator=g, dtype=DT)
    prior = Independent(Normal(torch.zeros(4, dtype=DT), prior_scale * torch.ones(4, dtype=DT)), 1)
    prior_mvn = MultivariateNormal(torch.zeros(4, dtype=DT), scale_tril=prior_scale * torch.eye(4, dtype=DT))
    expected_diag = kl_divergence(Independent(Normal(loc, diag), 1), prior).sum()
    expected_full = kl_divergence(MultivariateNormal(loc, scale_tril=tril), prior_mvn).sum()
    expected_low = kl_divergence(LowRankMultivariateNormal(loc, factor, diag**2), prior_mvn).sum()
    torch.testing.assert_close(kl_normal_rows(loc, diag, prior_scale), expected_diag)
    torch.testing.assert_close(kl_normal_rows(loc, tril, prior_scale), expected_full)
    torch.testing.assert_close(kl_normal_rows(loc, LowRankScale(diag, factor), prior_scale), expected_low)


def test_elbo_gradient_matches_mean_of_monte_carlo_gradients():
    """The closed-form ELBO gradient equals the expectation of reparameterized MC gradients."""
    torch.manual_seed(0)
    # the functional reference has no output bias: compare the paper network without it
    model = ClosedFormBNN(
        3, 4, a_covariance="full", b_covariance="full", init_scale=0.3, precision=2.0, output_bias=False
    ).double()
    with torch.no_grad():
        model.a.off_diagonal.normal_(0, 0.2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 3, generator=g, dtype=DT)
    y = torch.randn(8, generator=g, dtype=DT)
    params = [model.a.loc, model.a.log_scale, model.a.off_diagonal, model.b.loc, model.b.log_scale]
    exact = torch.autograd.grad(model.expected_log_likelihood(x, y), params)
    xa = torch.cat([x, torch.ones(8, 1, dtype=DT)], 1)
    batches = []
    for batch in range(40):
        estimate = regression_ell_weight_space(
            xa,
            y,
            model.a.loc,
            model.a.scale(),
            model.b.loc[0],
            model.b.scale()[0],
            model.precision,
            model.activation,
            5000,
            torch.Generator().manual_seed(100 + batch),
        ).mean()
        batches.append(torch.cat([t.flatten() for t in torch.autograd.grad(estimate, params)]))
    batches = torch.stack(batches)
    mc_mean = batches.mean(0)
    mc_se = batches.std(0) / math.sqrt(batches.shape[0])
    exact_flat = torch.cat([t.flatten() for t in exact])
    z = (exact_flat - mc_mean).abs() / mc_se.clamp(min=1e-12)
    assert z.max() < 4.5, z.max()
    assert (z > 3).float().mean() < 0.02


def test_partially_analytic_estimators_are_unbiased_given_sampled_inputs():
    """Closed form applied to *sampled* inputs of the layer (a sampled earlier layer)."""
    x, y, a_loc, a_scale, b_loc, b_scale = _problem("diagonal", "diagonal", seed=9)
    beta = torch.tensor(1.0, dtype=DT)
    g = torch.Generator().manual_seed(7)
    inputs = torch.relu(
        x + 0.5 * torch.randn((4,) + x.shape, generator=g, dtype=DT)
    )  # (S=4, N, D): sampled activations
    inputs[..., -1] = 1.0
    batched = regression_expected_log_likelihood(inputs, y, a_loc, a_scale, b_loc, b_scale, beta, "relu")
    one_by_one = torch.stack(
        [
            regression_expected_log_likelihood(inputs[s], y, a_loc, a_scale, b_loc, b_scale, beta, "relu")
            for s in range(4)
        ]
    )
    assert batched.shape == (4,)
    torch.testing.assert_close(batched, one_by_one)
    hidden = torch.relu(torch.randn(3, N, H, generator=g, dtype=DT))
    exact_b = regression_ell_given_hidden(hidden, y, b_loc, b_scale, beta).sum()
    weights_b = b_loc + b_scale * torch.randn(200_000, H, generator=g, dtype=DT)
    samples = torch.stack(
        [
            (-0.5 * (y[:, None] - hidden[s] @ weights_b.T).square() + 0.5 * math.log(1.0 / (2 * math.pi))).sum(0)
            for s in range(3)
        ]
    ).sum(0)
    _within(exact_b.item(), samples)


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda p: regression_expected_log_likelihood(p[0][:, :3], p[1], *p[2:6], 1.0, "relu"), "x"),
        (
            lambda p: regression_expected_log_likelihood(p[0], p[1], p[2], p[3][:, :2], p[4], p[5], 1.0, "relu"),
            "a_scale",
        ),
        (lambda p: regression_expected_log_likelihood(p[0], p[1], *p[2:4], p[4][:3], p[5], 1.0, "relu"), "b_loc"),
        (lambda p: regression_expected_log_likelihood(p[0], p[1], *p[2:6], 0.0, "relu"), "precision"),
        (lambda p: regression_expected_log_likelihood(p[0], p[1][:2], *p[2:6], 1.0, "relu"), "y"),
        (lambda p: kl_normal_rows(p[2], p[3], prior_scale=-1.0), "prior_scale"),
        (lambda p: ClosedFormBNN(3, 4, a_covariance="banded"), "covariance"),
    ],
)
def test_bad_input_names_argument(call, argument):
    problem = _problem("diagonal", "diagonal")
    with pytest.raises(ValueError, match=argument):
        call(problem)
