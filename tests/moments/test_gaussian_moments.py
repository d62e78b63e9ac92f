"""Half-line and absolute moments of a Normal against quadrature, all orders."""

import math
import warnings

import mpmath
import pytest
import torch
from reference import gaussian_expectation

from cfbnn_cli.moments import abs_moment, normal_raw_moment, positive_part_moment, positive_part_moments

T_GRID = [-40.0, -30.0, -13.0, -8.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 2.0, 5.0, 40.0]
STD_GRID = [1e-4, 1.0, 1e3]
ORDERS = range(0, 9)


def _rel(value, reference):
    return abs(value - reference) / abs(reference)


@pytest.mark.parametrize("dtype,tol,underflow", [(torch.float64, 1e-10, 1e-300), (torch.float32, 1e-5, 1.2e-38)])
def test_positive_part_moments_match_quadrature(dtype, tol, underflow):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for std in STD_GRID:
            for t in T_GRID:
                mean = float(torch.tensor(t * std, dtype=dtype))
                out = positive_part_moments(8, torch.tensor(mean, dtype=dtype), torch.tensor(std, dtype=dtype))
                assert out.dtype == dtype and out.shape == (9,)
                for k in ORDERS:
                    ref = gaussian_expectation(lambda z: z**k if z > 0 else 0.0, mean, std, [0.0])
                    value = out[k].item()
                    if abs(ref) < underflow * max(1.0, std**k):
                        assert abs(value) <= 1e3 * underflow * max(1.0, std**k)
                    else:
                        assert _rel(value, ref) <= tol, (k, mean, std, value, ref)


@pytest.mark.parametrize("dtype,tol,underflow", [(torch.float64, 1e-10, 1e-300), (torch.float32, 1e-5, 1.2e-38)])
def test_abs_moment_matches_quadrature(dtype, tol, underflow):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for std in STD_GRID:
            for t in T_GRID:
                if 0 < abs(t) < 1e-3:
                    continue
                mean = float(torch.tensor(t * std, dtype=dtype))
                for n in range(0, 8):
                    ref = gaussian_expectation(lambda z: z**n * abs(z), mean, std, [0.0])
                    value = abs_moment(n, torch.tensor(mean, dtype=dtype), torch.tensor(std, dtype=dtype)).item()
                    if ref == 0.0 or abs(ref) < underflow:
                        continue
                    assert _rel(value, ref) <= tol, (n, mean, std, value, ref)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_odd_abs_moment_near_zero_mean_high_precision(n):
    """Odd orders are odd in the mean; near mean = 0 quadrature in float64 cancels,
    so the reference is 40-digit mpmath quadrature."""
    mpmath.mp.dps = 40
    for mean, std in [(1e-5, 1e3), (-3e-9, 1.0), (2e-12, 1e-4)]:
        g, s = mpmath.mpf(mean), mpmath.mpf(std)
        ref = mpmath.quad(lambda z: z**n * abs(z) * mpmath.npdf(z, g, s), [-mpmath.inf, 0, mpmath.inf])
        value = abs_moment(n, torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)).item()
        assert abs(value - float(ref)) <= 1e-12 * abs(float(ref))


def test_paper_named_integrals():
    """n = 0..3 are the paper's Omega, Psi, zeta and rho (rho with the errata's 5)."""
    g, x = 0.7, 1.3
    e = math.exp(-0.5 * g * g / (x * x))
    erf = math.erf(g / (math.sqrt(2) * x))
    c = math.sqrt(2 / math.pi)
    omega = c * x * e + g * erf
    psi = c * g * x * e + (x * x + g * g) * erf
    zeta = c * (2 * x**3 + g * g * x) * e + (3 * g * x * x + g**3) * erf
    rho = c * (g**3 * x + 5 * g * x**3) * e + (g**4 + 6 * g * g * x * x + 3 * x**4) * erf
    values = [
        abs_moment(n, torch.tensor(g, dtype=torch.float64), torch.tensor(x, dtype=torch.float64)).item()
        for n in range(4)
    ]
    assert values == pytest.approx([omega, psi, zeta, rho], rel=1e-14)


def test_raw_and_positive_part_relation():
    """E[z^n] = M_n(mean) + (-1)^n M_n(-mean), for several n."""
    mean = torch.linspace(-3, 3, 13, dtype=torch.float64)
    std = torch.full_like(mean, 0.7)
    for n in range(7):
        total = positive_part_moment(n, mean, std) + (-1) ** n * positive_part_moment(n, -mean, std)
        torch.testing.assert_close(total, normal_raw_moment(n, mean, std), rtol=1e-12, atol=1e-12)


def test_monte_carlo_agreement():
    """Monte Carlo with 2e6 samples, tolerance 5 standard errors."""
    generator = torch.Generator().manual_seed(0)
    z = 0.4 + 1.7 * torch.randn(2_000_000, generator=generator, dtype=torch.float64)
    for n in range(4):
        samples = z**n * z.abs()
        se = samples.std().item() / math.sqrt(samples.numel())
        value = abs_moment(n, torch.tensor(0.4, dtype=torch.float64), torch.tensor(1.7, dtype=torch.float64)).item()
        assert abs(value - samples.mean().item()) <= 5 * se
