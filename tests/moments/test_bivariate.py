"""moments/bivariate.py: the correlated pair's CDF and cross-moments against independent
references -- scipy's bivariate Normal CDF, scipy's 2-D quadrature, Monte Carlo with
tolerances from its standard error -- plus the limits rho = +-1 and sd -> 0 in float32 and
float64, and the analytic backward pass (gradcheck)."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate
from scipy.stats import multivariate_normal, norm

from cfbnn_cli.moments import get_activation
from cfbnn_cli.moments.bivariate import activation_covariance, bivariate_normal_cdf, relu_cross_moment

F64 = torch.float64


def _t(*values, dtype=F64):
    return [torch.tensor(v, dtype=dtype) for v in values]


@pytest.mark.parametrize(
    "h,k,rho",
    [
        (0.3, -0.5, 0.2),
        (1.0, 2.0, 0.95),
        (-1.0, 0.5, -0.99),
        (2.0, 2.0, 0.9999),
        (0.0, 0.0, 0.5),
        (-3.0, -3.0, 0.93),
        (1.0, -1.0, -0.93),
        (-6.0, 4.0, 0.6),
        (5.0, -7.0, -0.3),
        (0.4, 0.41, 0.99999),
        (0.7, -0.4, 0.85),
        (-0.2, 1.1, -0.8),
    ],
)
def test_bivariate_cdf_matches_scipy(h, k, rho):
    ours = bivariate_normal_cdf(*_t(h, k, rho)).item()
    reference = multivariate_normal(mean=[0, 0], cov=[[1, rho], [rho, 1]]).cdf([h, k])
    assert ours == pytest.approx(reference, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("h,k", [(0.5, 0.5), (0.5, -0.2), (-1.0, 2.0), (3.0, -3.0)])
def test_bivariate_cdf_at_correlation_one_and_minus_one(h, k):
    """rho = 1: Z1 = Z2, Phi(min); rho = -1: Z1 = -Z2, max(0, Phi(h) + Phi(k) - 1)."""
    assert bivariate_normal_cdf(*_t(h, k, 1.0)).item() == pytest.approx(norm.cdf(min(h, k)), abs=1e-15)
    assert bivariate_normal_cdf(*_t(h, k, -1.0)).item() == pytest.approx(
        max(0.0, norm.cdf(h) + norm.cdf(k) - 1), abs=1e-15
    )


def _cross_moment_by_quadrature(mean_i, mean_j, sd_i, sd_j, rho):
    """E[relu(u) relu(v)] by scipy's dblquad over the positive quadrant (to 12 sd)."""
    cov = np.array([[sd_i**2, rho * sd_i * sd_j], [rho * sd_i * sd_j, sd_j**2]])
    density = multivariate_normal(mean=[mean_i, mean_j], cov=cov)
    value, _ = integrate.dblquad(
        lambda v, u: u * v * density.pdf([u, v]),
        0,
        max(mean_i, 0) + 12 * sd_i,
        0,
        max(mean_j, 0) + 12 * sd_j,
        epsabs=1e-13,
        epsrel=1e-10,
    )
    return value


@pytest.mark.parametrize(
    "mean_i,mean_j,sd_i,sd_j,rho",
    [
        (0.3, -0.2, 1.0, 0.5, 0.4),
        (1.0, 2.0, 0.3, 0.7, -0.8),
        (-0.5, 0.1, 0.2, 0.3, 0.96),
        (0.1, 0.1, 1.0, 1.0, -0.97),
        (-1.5, -0.5, 0.5, 0.4, 0.7),
        (0.0, 0.0, 1.0, 2.0, 0.0),
    ],
)
def test_relu_cross_moment_matches_quadrature(mean_i, mean_j, sd_i, sd_j, rho):
    ours = relu_cross_moment(*_t(mean_i, mean_j, sd_i, sd_j, rho * sd_i * sd_j)).item()
    assert ours == pytest.approx(_cross_moment_by_quadrature(mean_i, mean_j, sd_i, sd_j, rho), rel=1e-7, abs=1e-12)


def test_relu_cross_moment_at_correlation_one_is_the_second_moment():
    """u = v: E[relu(u)^2] = sd^2 ((h^2 + 1) Phi(h) + h phi(h)); u = -v: relu(u) relu(-u) = 0."""
    for mean, sd in ((0.4, 1.3), (-0.7, 0.5), (2.0, 0.1)):
        h = mean / sd
        expected = sd**2 * ((h * h + 1) * norm.cdf(h) + h * norm.pdf(h))
        assert relu_cross_moment(*_t(mean, mean, sd, sd, sd * sd)).item() == pytest.approx(expected, rel=1e-12)
        assert relu_cross_moment(*_t(mean, -mean, sd, sd, -sd * sd)).item() == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(
    "point", [(0.3, -0.2, 1.0, 0.5, 0.2), (0.3, -0.2, 0.3, 0.5, 0.147), (-1.2, 0.8, 0.6, 0.9, -0.5)]
)
def test_relu_cross_moment_backward_gradchecks(point):
    args = [torch.tensor(v, dtype=F64, requires_grad=True) for v in point]
    assert torch.autograd.gradcheck(relu_cross_moment, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_cross_moment_is_finite_with_finite_gradients_at_the_limits(dtype):
    """rho = +-1 exactly, standard deviations down to 0 (a unit with no spread), means far out."""
    tiny = torch.finfo(dtype).tiny
    cases = [  # mean_i, mean_j, sd_i, sd_j, cov
        (0.5, 0.5, 1.0, 1.0, 1.0),
        (0.5, -0.5, 1.0, 1.0, -1.0),
        (0.2, 0.7, 1.0, 2.0, 2.0),
        (0.5, -0.3, 1e-30, 1.0, 0.0),
        (1.0, 1.0, math.sqrt(tiny), math.sqrt(tiny), tiny),
        (-50.0, 30.0, 0.1, 0.1, 0.0),
        (0.0, 0.3, 1e-20, 1.0, 1e-20),
        (1e3, -1e3, 1.0, 1.0, 0.5),
    ]
    for case in cases:
        args = [torch.tensor(v, dtype=dtype, requires_grad=True) for v in case]
        value = relu_cross_moment(*args)
        value.backward()
        assert torch.isfinite(value), case
        assert all(torch.isfinite(a.grad) for a in args), case
    # the exact values at two of them: no spread in u_i -> relu(mean_i) E[relu(v)]; far out -> 0
    point = relu_cross_moment(*_t(0.5, -0.3, 1e-30, 1.0, 0.0, dtype=dtype)).item()
    assert point == pytest.approx(0.5 * (-0.3 * norm.cdf(-0.3) + norm.pdf(-0.3)), rel=1e-5)
    assert relu_cross_moment(*_t(-50.0, 30.0, 0.1, 0.1, 0.0, dtype=dtype)).item() == 0.0


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "identity"])
def test_activation_covariance_matches_monte_carlo(name):
    """Mean and covariance of g(u) for u ~ N(m, S) with strong correlations, against 1e6
    draws (5 standard errors of each entry)."""
    generator = torch.Generator().manual_seed(0)
    width = 4
    factor = torch.randn(width, width, generator=generator, dtype=F64)
    covariance = factor @ factor.T / width + 0.05 * torch.eye(width, dtype=F64)
    mean = torch.tensor([0.3, -0.4, 1.0, -1.2], dtype=F64)
    activation = get_activation(name)
    phi, cov = activation_covariance(activation, mean, covariance)
    draws = 1_000_000
    u = mean + torch.randn(draws, width, generator=generator, dtype=F64) @ torch.linalg.cholesky(covariance).T
    g = activation(u)
    centred = g - g.mean(0)
    mc_cov = centred.T @ centred / (draws - 1)
    products = centred.unsqueeze(-1) * centred.unsqueeze(-2)
    standard_error = products.std(0) / math.sqrt(draws)
    assert torch.all((phi - g.mean(0)).abs() <= 5 * g.std(0) / math.sqrt(draws))
    assert torch.all((cov - mc_cov).abs() <= 5 * standard_error + 1e-12), (cov - mc_cov) / standard_error
    assert torch.allclose(cov, cov.transpose(-1, -2))


def test_activation_covariance_names_what_it_supports():
    with pytest.raises(ValueError, match=r"relu_squared.*diagonal `deterministic` estimator"):
        activation_covariance(get_activation("relu_squared"), torch.zeros(3), torch.eye(3))
