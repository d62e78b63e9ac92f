"""``cfbnn::piecewise_moments`` and its backward (the piecewise polynomials, the hard sigmoid
included): the CPU kernels' values against scipy quadrature (the independent reference), their
gradients against finite differences of it, opcheck, gradcheck to the second order, torch.func,
NaN propagation and the route the activations' ``moments`` take."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest
import torch
from reference import activation_reference
from reference_kernels import reference_kernels
from relu_grid import POINTS, worst_error

from cfbnn_cli.moments import extension, get_activation, moment_ops, piecewise_polynomial

BREAKPOINTS = [-1.0, 0.5, 2.0]
COEFFICIENTS = [[1.0], [0.0, -1.0, 0.5], [2.0, 0.0, 0.0, 1.0], [-3.0]]  # discontinuous, up to a cubic
SPLINE = [[0.0], [0.25, 0.75, 0.75, 0.25], [1.0, 0.0, 0.0, -1.5, 1.0], [-0.5]]  # a quartic piece too


@pytest.fixture(scope="module", autouse=True)
def _library():
    if not extension.status()["loaded"]:
        pytest.skip("the C++ CPU kernels were not built here")


def _polynomial_function(breakpoints, coefficients):
    def f(z):
        for b, c in zip(breakpoints, coefficients):
            if z < b:
                return float(np.polyval(c[::-1], z))
        return float(np.polyval(coefficients[-1][::-1], z))

    return f


# name -> (activation, quadrature reference(mean, std) -> (Phi, Var, Upsilon, E|g|))
CASES = {
    "hard_sigmoid_1": (lambda: get_activation("hard_sigmoid", alpha=1.0), ("hard_sigmoid", {"alpha": 1.0})),
    "hard_sigmoid_2.5": (lambda: get_activation("hard_sigmoid", alpha=2.5), ("hard_sigmoid", {"alpha": 2.5})),
    "hard_sigmoid_-0.7": (lambda: get_activation("hard_sigmoid", alpha=-0.7), ("hard_sigmoid", {"alpha": -0.7})),
    "cubic": (
        lambda: piecewise_polynomial(BREAKPOINTS, COEFFICIENTS),
        ("piecewise", {"function": _polynomial_function(BREAKPOINTS, COEFFICIENTS), "kinks": BREAKPOINTS}),
    ),
    "spline": (
        lambda: piecewise_polynomial(BREAKPOINTS, SPLINE),
        ("piecewise", {"function": _polynomial_function(BREAKPOINTS, SPLINE), "kinks": BREAKPOINTS}),
    ),
    "relu_squared": (lambda: get_activation("relu_squared").as_piecewise_polynomial(), ("relu_squared", {})),
}


def _quadrature(case, points):
    name, params = CASES[case][1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quad's roundoff notes at the extreme points
        return [activation_reference(name, m, s, **params) for m, s in points]


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def _grid_references(case):  # (the same for both dtypes: computed once)
    return _quadrature(case, POINTS)


def _operator_arguments(activation, dtype):
    table, breakpoints, degree = activation._operator_arguments(dtype)
    return table, breakpoints, degree, activation._operator_alpha


# the two general polynomials' quadrature over the whole grid takes ~10 s each: slow (the hard
# sigmoid's three and ReLU^2 hold the same kernels to the same grid in the default suite)
GRID_CASES = [pytest.param(case, marks=pytest.mark.slow) if case in ("cubic", "spline") else case for case in CASES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", GRID_CASES)
def test_cpu_operator_matches_quadrature(case, dtype):
    """The grid of test_moments_quadrature.py (|mean/std| up to 40, std from 2^-13 to 2^10, std 0)."""
    activation = CASES[case][0]()
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    values = torch.ops.cfbnn.piecewise_moments(mean, std, *_operator_arguments(activation, dtype))[:3]
    assert all(v.dtype == dtype for v in values)
    assert worst_error(values, _grid_references(case), POINTS, dtype) <= 1.0
    # and through the activation (its route: the operator)
    through = activation.moments(mean, std, return_variance=True)
    for a, b in zip(values, through):
        assert torch.equal(a, b)


GRADIENT_POINTS = [(-2.3, 0.4), (-0.9, 0.05), (0.1, 1.3), (0.6, 0.2), (1.7, 2.5), (2.2, 0.01), (4.0, 1.1)]


@pytest.mark.parametrize("case", ["hard_sigmoid_2.5", "hard_sigmoid_-0.7", "cubic", "relu_squared"])
def test_gradients_match_finite_differences_of_quadrature(case):
    """d(Phi, Var)/d(mean, std) of the operator (float64, and float32 to its precision) against
    central differences of the quadrature reference."""
    activation = CASES[case][0]()
    points = GRADIENT_POINTS
    step = 1e-5
    shifted = []
    for m, s in points:
        h = step * max(1.0, abs(m))
        k = step * s
        shifted += [(m + h, s), (m - h, s), (m, s + k), (m, s - k)]
    refs = _quadrature(case, shifted)
    for dtype, rtol in ((torch.float64, 1e-6), (torch.float32, 2e-3)):
        mean = torch.tensor([p[0] for p in points], dtype=dtype, requires_grad=True)
        std = torch.tensor([p[1] for p in points], dtype=dtype, requires_grad=True)
        phi, _, var = activation.moments(mean, std, return_variance=True)
        for output, slot in ((phi, 0), (var, 1)):
            grad_mean, grad_std = torch.autograd.grad(output.sum(), (mean, std), retain_graph=True)
            for i, (m, s) in enumerate(points):
                h = step * max(1.0, abs(m))
                k = step * s
                fd_mean = (refs[4 * i][slot] - refs[4 * i + 1][slot]) / (2 * h)
                fd_std = (refs[4 * i + 2][slot] - refs[4 * i + 3][slot]) / (2 * k)
                scale = max(abs(fd_mean), abs(fd_std), 1e-3 if dtype == torch.float32 else 1e-8)
                assert abs(float(grad_mean[i]) - fd_mean) <= rtol * scale, (case, dtype, slot, m, s)
                assert abs(float(grad_std[i]) - fd_std) <= rtol * scale, (case, dtype, slot, m, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["hard_sigmoid_1", "cubic"])
def test_opcheck_cpu(case, dtype):
    activation = CASES[case][0]()
    arguments = _operator_arguments(activation, dtype)
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 3).requires_grad_()
    std = (torch.rand(40, 7, generator=g, dtype=dtype) * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.piecewise_moments.default, (mean, std, *arguments))
    plain = (mean.detach(), std.detach())
    torch.library.opcheck(torch.ops.cfbnn.piecewise_moments.default, (*plain, *arguments, True))
    phi, _, _, partials = torch.ops.cfbnn.piecewise_moments(*plain, *arguments, True)
    grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
    backward = torch.ops.cfbnn.piecewise_moments_backward.default
    torch.library.opcheck(backward, (*plain, phi, *grads, *arguments))
    if partials.numel():
        torch.library.opcheck(backward, (*plain, phi, *grads, *arguments, partials))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["hard_sigmoid_1", "hard_sigmoid_-0.7", "spline"])
def test_saved_partials_and_recomputed_ones_give_one_gradient(case, dtype):
    """The backward from the partials the operator's autograd saves (``partials=True``) equals the
    one that recomputes them (and the general engine's partials are what the float32 hard sigmoid's
    kernel recomputes)."""
    activation = CASES[case][0]()
    arguments = _operator_arguments(activation, dtype)
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(37, 29, generator=g, dtype=dtype) * 3
    std = torch.rand(37, 29, generator=g, dtype=dtype) + 0.05
    phi, ups, var, partials = torch.ops.cfbnn.piecewise_moments(mean, std, *arguments, True)
    alone = torch.ops.cfbnn.piecewise_moments(mean, std, *arguments)[:3]
    assert all(torch.equal(a, b) for a, b in zip((phi, ups, var), alone))
    assert partials.numel() == (4 * mean.numel() if moment_ops.saves_partials(dtype, arguments[3]) else 0)
    grads = [torch.randn(37, 29, generator=g, dtype=dtype) for _ in range(3)]
    recomputed = torch.ops.cfbnn.piecewise_moments_backward(mean, std, phi, *grads, *arguments)
    saved = torch.ops.cfbnn.piecewise_moments_backward(mean, std, phi, *grads, *arguments, partials)
    for a, b in zip(recomputed, saved):
        assert torch.equal(a, b)
    engine = (*arguments[:3], moment_ops.GENERAL_ENGINE)
    by_engine = torch.ops.cfbnn.piecewise_moments_backward(mean, std, phi, *grads, *engine)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.0, "atol": 0.0}
    for a, b in zip(recomputed, by_engine):
        torch.testing.assert_close(a, b, **tolerance)


@pytest.mark.parametrize("case", ["hard_sigmoid_1", pytest.param("cubic", marks=pytest.mark.slow)])
def test_gradients_match_finite_differences_to_the_second_order(case):
    activation = CASES[case][0]()
    arguments = _operator_arguments(activation, torch.float64)
    g = torch.Generator().manual_seed(1)
    mean = (torch.randn(3, 3, generator=g, dtype=torch.float64) * 2).requires_grad_()
    std = (torch.rand(3, 3, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    function = lambda m, s: torch.ops.cfbnn.piecewise_moments(m, s, *arguments)[:3]  # noqa: E731
    assert torch.autograd.gradcheck(function, (mean, std))
    assert torch.autograd.gradgradcheck(function, (mean, std))


@pytest.mark.parametrize("case", ["hard_sigmoid_2.5", "spline"])
def test_per_draw_gradients_under_vmap_match_the_loop(case):
    """vmap(grad) through the activation's moments (the operators' vmap rules, the backward under
    torch.func.grad) equals grad draw by draw, and the reference path's autograd."""
    activation = CASES[case][0]()
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(4, 10, generator=g, dtype=torch.float64) * 2
    std = torch.rand(4, 10, generator=g, dtype=torch.float64) + 0.1

    def total(m, s):
        phi, ups, var = activation.moments(m, s, return_variance=True)
        return (phi + 0.5 * ups - var).sum()

    batched = torch.func.vmap(torch.func.grad(total, argnums=(0, 1)))(mean, std)
    for i in range(mean.shape[0]):
        one = torch.func.grad(total, argnums=(0, 1))(mean[i], std[i])
        torch.testing.assert_close(batched[0][i], one[0], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(batched[1][i], one[1], rtol=1e-13, atol=1e-15)
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    phi, ups, var = activation.reference_moments(m, s)
    (phi + 0.5 * ups - var).sum().backward()
    torch.testing.assert_close(batched[0], m.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(batched[1], s.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["hard_sigmoid_1", "cubic"])
def test_a_nan_mean_or_std_gives_nan_moments_and_gradients(case, dtype):
    activation = CASES[case][0]()
    arguments = _operator_arguments(activation, dtype)
    mean = torch.tensor([0.3, math.nan, -1.2, 0.5], dtype=dtype)
    std = torch.tensor([0.7, 1.0, math.nan, 0.2], dtype=dtype)
    outputs = torch.ops.cfbnn.piecewise_moments(mean, std, *arguments)[:3]
    for value in outputs:
        assert value[1:3].isnan().all() and value[[0, 3]].isfinite().all()
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    phi, ups, var = activation.moments(m, s, return_variance=True)
    (phi + ups + var).sum().backward()
    for grad in (m.grad, s.grad):
        assert grad[1:3].isnan().all() and grad[[0, 3]].isfinite().all()


def test_the_activations_take_the_operator():
    """The hard sigmoid and a piecewise polynomial run cfbnn::piecewise_moments (one autograd node),
    with the reference formula's values; a polynomial the engine does not take (degree 17) its
    reference formula, decided when it is made."""
    for activation in (get_activation("hard_sigmoid", alpha=1.5), piecewise_polynomial(BREAKPOINTS, COEFFICIENTS)):
        for dtype in (torch.float32, torch.float64):
            mean = torch.randn(10, dtype=dtype, requires_grad=True)
            std = torch.rand(10, dtype=dtype) + 0.1
            phi, _ = activation.moments(mean, std)
            assert type(phi.grad_fn).__name__ == "OperatorAutogradBackward"
            reference = activation.reference_moments(mean, std)
            torch.testing.assert_close(phi, reference[0])
    large = piecewise_polynomial([0.0], [[0.0], [0.0] * 17 + [1e-3]])
    assert not large._on_operator
    phi, _ = large.moments(torch.randn(3, requires_grad=True), torch.rand(3) + 0.1)
    assert type(phi.grad_fn).__name__ != "OperatorAutogradBackward"


def test_the_table_holds_the_polynomial():
    """:func:`moment_ops.polynomial_from_table` (the reference kernels' polynomial) reads back
    the breakpoints and coefficients."""
    activation = piecewise_polynomial(BREAKPOINTS, SPLINE)
    table, breakpoints, degree = moment_ops.piecewise_table(BREAKPOINTS, activation.polynomials, torch.float64)
    assert table.numel() == sum(moment_ops.table_sizes(breakpoints, degree))
    back = moment_ops.polynomial_from_table(table, breakpoints, degree)
    assert back.breakpoints == BREAKPOINTS
    for a, b in zip(back.polynomials, activation.polynomials):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="table"):
        torch.ops.cfbnn.piecewise_moments(torch.zeros(3), torch.ones(3), table[:-1], breakpoints, degree, math.nan)


def test_the_reference_kernels_run_the_reference_formula():
    """Where the C++ library is not there, the operators' reference kernels serve (here: registered
    for the CPU by the tests' reference mode): opcheck passes, the values are the reference formula's,
    and the saved partial derivatives give the recomputing backward's gradients."""
    hard = get_activation("hard_sigmoid", alpha=1.5)
    with reference_kernels():
        for dtype in (torch.float32, torch.float64):
            table, b, d = hard._operator_arguments(dtype)
            mean = torch.linspace(-3, 3, 13, dtype=dtype)
            std = torch.linspace(0.1, 2, 13, dtype=dtype)
            arguments = (table, b, d, hard._operator_alpha)
            # (opcheck without a gradient: its schema check's dispatch mode cannot run the reference
            # kernel's torch.func.vjp, which the saved partials take; gradcheck covers that path below)
            torch.library.opcheck(torch.ops.cfbnn.piecewise_moments.default, (mean, std, *arguments))
            values = torch.ops.cfbnn.piecewise_moments(mean.detach(), std, *arguments)[:3]
            reference = hard.reference_moments(mean.detach(), std)
            assert all(torch.equal(a, b) for a, b in zip(values, reference))
            grads = [torch.ones_like(std)] * 3
            found = torch.ops.cfbnn.piecewise_moments_backward(mean.detach(), std, values[0], *grads, *arguments)
            assert all(torch.isfinite(g).all() for g in found)
            phi, ups, var, partials = torch.ops.cfbnn.piecewise_moments(mean.detach(), std, *arguments, True)
            assert partials.numel() == (4 * 13 if moment_ops.saves_partials(dtype, arguments[3]) else 0)
            if partials.numel():
                saved = torch.ops.cfbnn.piecewise_moments_backward(
                    mean.detach(), std, phi, *grads, *arguments, partials
                )
                for a, b in zip(saved, found):
                    torch.testing.assert_close(a, b)
        m, s = (t.double()[:5].clone().requires_grad_() for t in (mean, std))
        arguments = (*hard._operator_arguments(torch.float64), hard._operator_alpha)
        assert torch.autograd.gradcheck(lambda m, s: torch.ops.cfbnn.piecewise_moments(m, s, *arguments)[:3], (m, s))
