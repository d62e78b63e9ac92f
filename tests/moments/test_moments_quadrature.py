"""Activation moments against scipy quadrature (tests/moments/reference.py), float64 and float32.

Inputs are chosen exactly representable in float32 (powers of two for std and
alpha, multiples of 1/4 for mean/std) so that both dtypes see the same numbers and
the reference integrates at exactly the point the code evaluates.

Error measures: Phi against E[|g|] (Phi crosses zero for odd activations, where
any method can only be accurate relative to the size of its terms); Upsilon and
Var relative to themselves (both are non-negative, and Var is the hard case).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from reference import activation_reference

from cfbnn_cli.moments import get_activation

F64_TOL = 1e-10
F32_TOL = 1e-5
F32_TINY = float(torch.finfo(torch.float32).tiny)

T_GRID = [-40.0, -20.0, -8.0, -3.0, -1.0, -0.25, 0.0, 0.25, 1.0, 3.0, 8.0, 20.0, 40.0]
STD_GRID = [2.0**-13, 1.0, 2.0**10]  # ~1.2e-4 ... ~1e3, the range
ALPHA_GRID = [2.0**-10, 1.0, 2.0**10]  # ~1e-3 ... ~1e3

CASES = [
    ("relu", {}),
    ("leaky_relu", {"negative_slope": 0.125}),
    ("leaky_relu", {"negative_slope": -0.5}),
    ("relu_squared", {}),
    ("identity", {}),
] + [("hard_sigmoid", {"alpha": a}) for a in ALPHA_GRID + [-1.0]]


def _points(name, params):
    offsets = [0.0]
    if name == "hard_sigmoid":
        a = abs(params["alpha"])
        offsets = [0.0, a, -a]  # around the centre and both kinks
    for std in STD_GRID:
        for offset in offsets:
            for t in T_GRID:
                mean = float(np.float32(offset + t * std))
                yield mean, std


def _check(value, reference, scale, tol, underflow, what):
    if scale < underflow:  # true value underflows: only require a tiny absolute answer
        assert abs(value) <= 1e3 * underflow, (what, value, reference)
        return
    assert abs(value - reference) <= tol * scale, (what, value, reference, abs(value - reference) / scale)


@pytest.mark.parametrize("name,params", CASES, ids=lambda v: str(v))
def test_moments_match_quadrature(name, params):
    activation = get_activation(name, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mean, std in _points(name, params):
            phi_ref, var_ref, ups_ref, abs_ref = activation_reference(name, mean, std, **params)
            for dtype, tol, underflow in ((torch.float64, F64_TOL, 1e-300), (torch.float32, F32_TOL, F32_TINY)):
                m = torch.tensor(mean, dtype=dtype)
                s = torch.tensor(std, dtype=dtype)
                phi, ups, var = (v.item() for v in activation.moments(m, s, return_variance=True))
                where = f"{name}{params} mean={mean} std={std} {dtype}"
                # a float32 result must be a normal float32 to be held to 1e-5
                scale_floor = underflow * max(1.0, std * std)
                _check(phi, phi_ref, abs_ref, tol, scale_floor, "Phi " + where)
                _check(ups, ups_ref, ups_ref, tol, scale_floor, "Upsilon " + where)
                _check(var, var_ref, var_ref, tol, scale_floor, "Var " + where)
                assert var >= 0.0


@pytest.mark.parametrize("name,params", CASES, ids=lambda v: str(v))
def test_mean_without_autograd_matches_quadrature(name, params):
    """``g.mean`` under ``torch.no_grad()`` (ReLU's prediction-only kernel) against the same
    reference, on the grid and as one batch larger than a CPU block (the blocked path)."""
    activation = get_activation(name, **params)
    points = list(_points(name, params))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quad's roundoff notes at the extreme points, as above
        references = [activation_reference(name, mean, std, **params) for mean, std in points]
    repeats = 65536 // len(points) + 2
    for dtype, tol, underflow in ((torch.float64, F64_TOL, 1e-300), (torch.float32, F32_TOL, F32_TINY)):
        means = torch.tensor([m for m, _ in points], dtype=dtype).repeat(repeats)
        stds = torch.tensor([s for _, s in points], dtype=dtype).repeat(repeats)
        with torch.no_grad():
            phis = activation.mean(means, stds)
        assert phis.dtype == dtype and phis.shape == means.shape
        last = phis[-len(points) :]  # from the last block
        for (mean, std), (phi_ref, _, _, abs_ref), phi, phi_first in zip(
            points, references, last.tolist(), phis.tolist()
        ):
            where = f"{name}{params} mean={mean} std={std} {dtype}"
            _check(phi, phi_ref, abs_ref, tol, underflow * max(1.0, std * std), "Phi " + where)
            assert phi == phi_first, where  # every block computes the same numbers


def test_reference_is_not_the_printed_formula():
    """Sanity check of the reference itself: ReLU^2 Upsilon at t = -1 is 0.135 xi^4
    (errata 2), where the printed formula gives -0.349 xi^4."""
    _, _, upsilon, _ = activation_reference("relu_squared", -1.0, 1.0)
    assert upsilon == pytest.approx(0.1350, abs=5e-4)
    printed_rho = math.sqrt(2 / math.pi) * (-1 - 7) * math.exp(-0.5) + 10 * math.erf(-1 / math.sqrt(2))
    printed = 0.5 * (1 + 6 + 3 + printed_rho)
    assert printed == pytest.approx(-0.349, abs=1e-3)
