"""The general piecewise-polynomial engine: against the named closed forms and quadrature."""

import warnings

import numpy as np
import pytest
import torch
from reference import activation_reference

from cfbnn_cli.moments import get_activation, piecewise_polynomial

GRID_T = [-30.0, -8.0, -2.0, -0.5, 0.0, 0.5, 2.0, 8.0, 30.0]
GRID_STD = [1e-3, 0.3, 1.0, 50.0]


@pytest.mark.parametrize(
    "name,params", [("relu", {}), ("leaky_relu", {"negative_slope": 0.05}), ("relu_squared", {}), ("identity", {})]
)
def test_named_closed_forms_agree_with_piecewise_engine(name, params):
    """Two independent implementations (dedicated closed form vs the general engine) to 1e-12."""
    named = get_activation(name, **params)
    general = named.as_piecewise_polynomial()
    mean = torch.tensor([t * s for t in GRID_T for s in GRID_STD], dtype=torch.float64)
    std = torch.tensor([s for _ in GRID_T for s in GRID_STD], dtype=torch.float64)
    for a, b in zip(named.moments(mean, std, return_variance=True), general.moments(mean, std, return_variance=True)):
        scale = torch.maximum(a.abs(), b.abs()).clamp(min=1e-300)
        assert ((a - b).abs() / scale).max() <= 1e-12


def test_user_defined_discontinuous_piecewise_matches_quadrature():
    breakpoints = [-1.0, 0.5, 2.0]
    coefficients = [[1.0], [0.0, -1.0, 0.5], [2.0, 0.0, 0.0, 1.0], [-3.0]]
    g = piecewise_polynomial(breakpoints, coefficients)

    def f(z):
        for b, c in zip(breakpoints, coefficients):
            if z < b:
                return float(np.polyval(c[::-1], z))
        return float(np.polyval(coefficients[-1][::-1], z))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mean in [-5.0, -1.0, -0.2, 0.5, 1.1, 2.0, 6.0]:
            for std in [1e-3, 0.05, 0.7, 3.0]:
                phi_ref, var_ref, ups_ref, abs_ref = activation_reference(
                    "piecewise", mean, std, function=f, kinks=breakpoints
                )
                phi, ups, var = (
                    v.item()
                    for v in g.moments(
                        torch.tensor(mean, dtype=torch.float64),
                        torch.tensor(std, dtype=torch.float64),
                        return_variance=True,
                    )
                )
                assert abs(phi - phi_ref) <= 1e-10 * abs_ref, (mean, std)
                assert abs(ups - ups_ref) <= 1e-10 * ups_ref, (mean, std)
                assert abs(var - var_ref) <= 1e-9 * max(var_ref, 1e-300), (mean, std, var, var_ref)


def test_narrow_piece_uses_no_cancellation():
    """A piece of width 1e-6 std next to the mean (hard sigmoid with tiny alpha, ReLU-like
    indicator): Upsilon ~ alpha^2 must keep its digits although E[z^2] ~ std^2."""
    g = get_activation("hard_sigmoid", alpha=1e-6)
    phi, ups, var = g.moments(
        torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64), return_variance=True
    )
    # E[min(z^2, a^2)] = a^2 - E[(a^2 - z^2) 1{|z|<a}] = a^2 (1 - 4 a phi(0)/3 + O(a^3))
    a = 1e-6
    expected = a * a * (1 - 4 * a * 0.3989422804014327 / 3)
    assert ups.item() == pytest.approx(expected, rel=1e-9)
    assert phi.item() == 0.0


def test_call_is_pointwise():
    g = piecewise_polynomial([0.0], [[1.0, 2.0], [0.0, 0.0, 3.0]])
    x = torch.tensor([-1.0, -0.0, 0.0, 2.0])
    torch.testing.assert_close(g(x), torch.tensor([-1.0, 0.0, 0.0, 12.0]))
