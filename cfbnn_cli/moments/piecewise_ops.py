"""The piecewise polynomials' moments (the hard sigmoid included) as torch operators:
``torch.ops.cfbnn.piecewise_moments*``.

``cfbnn::piecewise_moments(Tensor mean, Tensor std, Tensor table, int breakpoints, int degree, float alpha) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    ``(E[g(z)], E[g(z)^2], Var[g(z)])`` of a piecewise polynomial ``g`` (paper eq. (35); the hard
    sigmoid of eq. (27) with errata 3), ``z ~ N(mean, std^2)``, elementwise; ``mean`` and ``std``
    of one shape, dtype float32 or float64.
``cfbnn::piecewise_moments_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance, table, breakpoints, degree, alpha, Tensor? partials=None) -> (grad_mean, grad_std)``
    its vector-Jacobian product (``partials``: the saved partial derivatives, see below).

The polynomial rides in ``table``: one contiguous float64 CPU tensor, the arrays of
:func:`.piecewise_tables.coefficient_tables` for the tensors' dtype (float32 tensors: the
polynomial rounded to float32 first) flattened and concatenated in the order ``bp`` (``max(B,
1)``), ``coef`` (``P (D+1)``), ``deriv`` (``P (D+1)^2``), ``side`` (``2 P``), ``tails`` (``12 P
(2D+1)``), ``jumps`` (``4 max(B, 1)``), ``gl`` (32), with ``B = breakpoints``, ``D = degree``,
``P = B + 1`` (:func:`table_sizes`; :func:`piecewise_table` packs it). The kernels' float32
copies ``coef32`` and ``bp32`` are ``coef`` and ``bp`` rounded to float32, made in the C++
kernel. ``alpha`` selects the kernel: finite and non-zero, the hard sigmoid ``clamp(x, -alpha,
alpha)`` (negative: its negation) whose float32 tensors take the unrolled float32 kernels
(``hs_forward_f32``, ``hs_backward_f32``: ``a = |alpha|``, ``sign``; the table must be the hard
sigmoid's); ``nan``, the general engine (``pw_forward``), as float64 tensors always do.

Kernels: on the CPU the C++ kernels of ``csrc/cfbnn_ops.cpp``, registered with the C++ autograd
(``MomentsAutograd``) when the package is imported; without a compiler, the reference torch ops of :meth:`.PiecewisePolynomial._reference_moments` on the polynomial read back from the
table (:func:`polynomial_from_table`). Every other device (CUDA) has the reference ops too: there
is no Triton kernel for this family, and :func:`piecewise_operator_route` keeps the activations on
their reference route there (and inside ``torch.compile``, as before).

What the backward reads. Where a gradient will be taken, the C++ autograd calls a third operator,

``cfbnn::piecewise_moments_partials(mean, std, table, breakpoints, degree, alpha) -> (phi, upsilon, variance, partials)``
    the forward that also returns the four partial derivatives ``d(Phi, Var)/d(mean, std)`` as
    one ``(4, *mean.shape)`` tensor (an empty ``(0,)`` one for the float32 hard sigmoid, whose
    backward kernel recomputes them block by block: cheaper than writing them;
    :func:`saves_partials`),

and hands them to the backward's optional last argument ``partials``; without them (the Python
autograd, ``torch.func``, a direct call) the backward recomputes them, the engine in one more
forward pass. Measured on this project's 2-core machine (500 x 200, forward + backward, median of
7), saving them halves the engine's time (float64 hard sigmoid 3.5 ms against 6.6 ms, a cubic
piecewise polynomial 7.0 against 12.0 ms in float32, 13.3 against 24.6 ms in float64), and the
operator route is as fast as the ctypes route it replaces (``fast.moments``: within +-3 %, the
float32 hard sigmoid 1.05 against 1.20 ms).

Autograd, fake and vmap (elementwise; the table is not batched) registrations; ``opcheck`` and the
quadrature references in ``tests/moments/test_piecewise_ops.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .operator_registration import (
    check_operands,
    differentiable_by_formula,
    moments_function,
    register_moments_autograd,
)
from .ops import operator_route, triton_device
from .piecewise_tables import coefficient_tables

__all__ = [
    "GENERAL_ENGINE",
    "piecewise_moments",
    "piecewise_moments_backward",
    "piecewise_moments_partials",
    "piecewise_moments_function",
    "piecewise_operator_route",
    "piecewise_table",
    "polynomial_from_table",
    "saves_partials",
    "table_sizes",
]

GENERAL_ENGINE = math.nan  # the `alpha` that selects the general engine
_FIELDS = ("bp", "coef", "deriv", "side", "tails", "jumps", "gl")


def table_sizes(breakpoints: int, degree: int) -> Tuple[int, ...]:
    """The lengths of the table's fields (``bp, coef, deriv, side, tails, jumps, gl``)."""
    pieces, rows = breakpoints + 1, max(breakpoints, 1)
    return (
        rows,
        pieces * (degree + 1),
        pieces * (degree + 1) ** 2,
        pieces * 2,
        pieces * 2 * 6 * (2 * degree + 1),
        rows * 4,
        32,
    )


def piecewise_table(breakpoints, polynomials, dtype: torch.dtype) -> Tuple[Tensor, int, int]:
    """``(table, B, D)`` of a piecewise polynomial for tensors of ``dtype`` (layout: the module
    docstring)."""
    tables = coefficient_tables(breakpoints, polynomials, dtype)
    flat = np.concatenate([np.ravel(tables[key]) for key in _FIELDS])
    assert flat.size == sum(table_sizes(tables["B"], tables["D"]))
    return torch.from_numpy(flat.astype(np.float64)), int(tables["B"]), int(tables["D"])


def polynomial_from_table(table: Tensor, breakpoints: int, degree: int):
    """The :class:`.PiecewisePolynomial` a table holds (its ``bp`` and ``coef`` fields)."""
    head = sum(table_sizes(breakpoints, degree)[:2])
    return _polynomial(tuple(table.detach()[:head].cpu().double().tolist()), breakpoints, degree)


# the class whose reference formula the reference kernels run: :class:`.PiecewisePolynomial`, which
# imports this module and hands itself over (:func:`use_polynomial_class`)
_POLYNOMIAL_CLASS = []


def use_polynomial_class(polynomial_class) -> None:
    """Called once by :mod:`.piecewise_polynomial`: the class the reference kernels build from a table."""
    _POLYNOMIAL_CLASS[:] = [polynomial_class]


@functools.lru_cache(maxsize=64)
def _polynomial(values: Tuple[float, ...], breakpoints: int, degree: int):
    bp = list(values[:breakpoints])
    coef = np.asarray(values[max(breakpoints, 1) :]).reshape(breakpoints + 1, degree + 1)
    return _POLYNOMIAL_CLASS[0](bp, [row.tolist() for row in coef])


def _reference_forward(mean, std, table, breakpoints, degree, alpha):
    return polynomial_from_table(table, breakpoints, degree)._reference_moments(mean, std)


def _differentiable_backward(
    mean, std, phi, grad_phi, grad_ups, grad_var, table, breakpoints, degree, alpha, partials=None
):
    """The vector-Jacobian product through the reference ops (``phi`` unused: recomputed), to any
    order."""
    polynomial = polynomial_from_table(table, breakpoints, degree)
    _, vjp = torch.func.vjp(polynomial._reference_moments, mean, std)
    return vjp((grad_phi, grad_ups, grad_var))


# ----------------------------------------------------------------------------- the operators


@torch.library.custom_op("cfbnn::piecewise_moments", mutates_args=())
def piecewise_moments(
    mean: Tensor, std: Tensor, table: Tensor, breakpoints: int, degree: int, alpha: float
) -> Tuple[Tensor, Tensor, Tensor]:
    # the default kernel (every device but the CPU, whose C++ kernel the library registers): the
    # reference ops
    check_operands("piecewise_moments", mean, std)
    with torch.no_grad():
        return tuple(value.clone() for value in _reference_forward(mean, std, table, breakpoints, degree, alpha))


@torch.library.custom_op("cfbnn::piecewise_moments_backward", mutates_args=())
def piecewise_moments_backward(
    mean: Tensor,
    std: Tensor,
    phi: Tensor,
    grad_phi: Tensor,
    grad_upsilon: Tensor,
    grad_variance: Tensor,
    table: Tensor,
    breakpoints: int,
    degree: int,
    alpha: float,
    partials: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    check_operands("piecewise_moments_backward", mean, std, phi, grad_phi, grad_upsilon, grad_variance)
    grads = (grad_phi, grad_upsilon, grad_variance)
    with torch.no_grad():
        return tuple(_differentiable_backward(mean, std, phi, *grads, table, breakpoints, degree, alpha))


@piecewise_moments.register_fake
def _(mean, std, table, breakpoints, degree, alpha):
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)


@piecewise_moments_backward.register_fake
def _(mean, std, phi, grad_phi, grad_upsilon, grad_variance, table, breakpoints, degree, alpha, partials=None):
    return torch.empty_like(mean), torch.empty_like(mean)


def saves_partials(dtype: torch.dtype, alpha: float) -> bool:
    """Whether ``cfbnn::piecewise_moments_partials`` returns the partials for this dtype and
    ``alpha`` (the engine; the float32 hard sigmoid's kernels recompute them instead)."""
    return not (dtype == torch.float32 and math.isfinite(alpha) and alpha != 0.0)


@torch.library.custom_op("cfbnn::piecewise_moments_partials", mutates_args=())
def piecewise_moments_partials(
    mean: Tensor, std: Tensor, table: Tensor, breakpoints: int, degree: int, alpha: float
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # the C++ autograd's forward where a gradient is wanted (CPU only: its C++ kernel); here (no C++
    # library) the partials by differentiating the reference ops (elementwise: one vector-Jacobian
    # product each; torch.func, as autograd does not record inside an operator's kernel)
    check_operands("piecewise_moments_partials", mean, std)

    def phi_var(m, s):
        phi, _, var = _reference_forward(m, s, table, breakpoints, degree, alpha)
        return phi, var

    phi, ups, var = _reference_forward(mean, std, table, breakpoints, degree, alpha)
    partials = mean.new_empty((0,))
    if saves_partials(mean.dtype, alpha):
        _, vjp = torch.func.vjp(phi_var, mean, std)
        ones, zeros = torch.ones_like(mean), torch.zeros_like(mean)
        partials = torch.stack([*vjp((ones, zeros)), *vjp((zeros, ones))])
    return phi.clone(), ups.clone(), var.clone(), partials


@piecewise_moments_partials.register_fake
def _(mean, std, table, breakpoints, degree, alpha):
    partials = mean.new_empty((4, *mean.shape) if saves_partials(mean.dtype, alpha) else (0,))
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean), partials


register_moments_autograd(piecewise_moments, piecewise_moments_backward, _differentiable_backward)
differentiable_by_formula(piecewise_moments_backward, _differentiable_backward, 6)


def _vmap_rule(op, count: int, elementwise: int):
    """The vmap rule of an elementwise piecewise operator: its first ``elementwise`` tensors with
    the vmap dimension first (an unbatched one expanded), one call on the batch; the table, one for
    the batch (a batched table is refused), and the numbers as they are. Batched saved partials
    (the backward's last argument) are dropped: the kernel then recomputes them."""

    def rule(info, in_dims, *arguments):
        if in_dims[elementwise] is not None:
            raise NotImplementedError(f"{op._name}: vmap over the table is not supported")
        moved = []
        for argument, dim in zip(arguments[:elementwise], in_dims[:elementwise]):
            if dim is None:
                argument = argument.unsqueeze(0).expand(info.batch_size, *argument.shape)
            else:
                argument = argument.movedim(dim, 0)
            moved.append(argument.contiguous())
        rest = list(arguments[elementwise:])
        if len(rest) > 4 and in_dims[-1] is not None:
            rest[4] = None
        return op(*moved, *rest), (0,) * count

    return rule


piecewise_moments.register_vmap(_vmap_rule(piecewise_moments, 3, 2))
piecewise_moments_backward.register_vmap(_vmap_rule(piecewise_moments_backward, 2, 6))


def piecewise_moments_function(
    mean: Tensor, std: Tensor, table: Tensor, breakpoints: int, degree: int, alpha: float = GENERAL_ENGINE
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through the operators (autograd
    and ``torch.func`` included); ``table, breakpoints, degree`` from :func:`piecewise_table` for
    ``mean``'s dtype."""
    arguments = (piecewise_moments, piecewise_moments_backward, _differentiable_backward, mean, std)
    return moments_function(*arguments, table, int(breakpoints), int(degree), float(alpha))


def piecewise_operator_route(mean: Tensor) -> bool:
    """Whether a piecewise polynomial's ``moments`` take ``cfbnn::piecewise_moments`` for ``mean``:
    on the CPU where :func:`.ops.operator_route` (the C++ library's operators registered); never
    on CUDA (no Triton kernel: the reference route, as before), nor inside ``torch.compile`` (the
    tables are made by numpy on first use, which dynamo cannot trace: the reference ops, which
    inductor fuses, as before)."""
    return not triton_device(mean.device) and not torch.compiler.is_compiling() and operator_route(mean)
