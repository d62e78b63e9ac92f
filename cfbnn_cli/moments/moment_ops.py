"""The activations' moments as ``cfbnn::`` operators, each declared once here (:mod:`.operators`):
schema, reference kernel, fake, Triton launch (CUDA), autograd and vmap rule. Their C++ CPU kernels
are ``csrc/moment_ops.cpp``; their reference formulas :mod:`.relu_family`, :mod:`.piecewise_polynomial`,
:mod:`.gaussian` and :mod:`.bivariate`.

``cfbnn::relu_family_moments(Tensor mean, Tensor spread, int activation, float negative_slope, bool from_variance) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    ``(E[g(z)], E[g(z)^2], Var[g(z)])`` for ``z ~ N(mean, std^2)`` elementwise, ``g`` the ReLU
    family's member ``activation`` (:data:`.relu_family.ACTIVATION_KINDS`: 0 ReLU, paper eq. (20); 1
    leaky ReLU of slope ``negative_slope``, eqs. (21), (22); 2 ReLU^2, eqs. (28), (29)); ``spread``
    the standard deviation, or with ``from_variance`` the variance (its square root taken inside,
    the variance floored at the dtype's smallest normal number). ``mean`` and ``spread`` of one
    shape, float32 or float64; for float32 the slope is the float32 number torch's float32
    arithmetic multiplies by. Backward: ``cfbnn::relu_family_moments_backward(mean, spread, phi,
    grad_phi, grad_upsilon, grad_variance, activation, negative_slope, from_variance) -> (grad_mean,
    grad_spread)`` (the Gaussian factors recomputed; no gradient through Var where its clamp at 0
    bites), differentiable again through its formula (:func:`.relu_family.family_moments_vjp`).
``cfbnn::relu_mean(Tensor mean, Tensor std) -> Tensor``
    ReLU's ``E[max(z, 0)]`` alone (what a prediction needs: one output written); its gradient is
    Phi's, through the backward above.
``cfbnn::piecewise_moments(Tensor mean, Tensor std, Tensor table, int breakpoints, int degree, float alpha, bool partials=False) -> (Tensor phi, Tensor upsilon, Tensor variance, Tensor partials)``
    the moments of a piecewise polynomial (paper eq. (35); the hard sigmoid of eq. (27), errata 3),
    the polynomial packed in ``table`` (:func:`piecewise_table`); ``alpha`` finite and non-zero
    selects the hard sigmoid's unrolled float32 kernels, ``nan`` the general engine. With
    ``partials`` (set by its autograd where a gradient will be taken) also the four partial
    derivatives ``d(Phi, Var)/d(mean, std)`` as one ``(4, *mean.shape)`` tensor (``(0,)`` where the
    kernel recomputes them instead: the float32 hard sigmoid), which the backward reads: it halves
    the engine's forward + backward. Backward: ``cfbnn::piecewise_moments_backward(...,
    Tensor? partials) -> (grad_mean, grad_std)``. No Triton kernel: on CUDA the reference.
``cfbnn::positive_part_moments(Tensor mean, Tensor std, int order) -> Tensor``
    ``E[z^k 1{z > 0}]``, ``k = 0..order``, along a new last dimension (the errata's truncated
    moments, the piecewise polynomials' building block); its gradient by the heat equation. The
    reference kernel only.
``cfbnn::relu_cross_moment(Tensor mean_i, Tensor mean_j, Tensor sd_i, Tensor sd_j, Tensor cov_ij) -> (Tensor, Tensor)``
    ``E[relu(u_i) relu(u_j)]`` of a correlated Normal pair and ``Phi_2`` (``deterministic_full``);
    its gradient by Price's theorem. The reference kernel only.
``cfbnn::count_negative(Tensor x) -> int``
    the entries ``< 0`` of a float tensor, one pass: the argument checks' sign test.
"""

from __future__ import annotations

import functools
import math
from typing import Tuple

import numpy as np
import torch
from torch import Tensor

from . import bivariate, gaussian, relu_family
from .operators import (
    FLOATS,
    LazyModule,
    Operator,
    absent_gradient,
    batch_first,
    check_operands,
    define,
    differentiable_by_formula,
    elementwise_vmap,
)
from .piecewise_tables import piecewise_table, table_sizes
from .relu_family import RELU, check_activation, family_moments_vjp, reference_family_moments, slope_for, variance_floor

triton_kernels = LazyModule(f"{__package__}.triton_kernels")

# ----------------------------------------------------------------------------- the ReLU family


def slope_tensor(mean: Tensor, negative_slope: float) -> Tensor:
    """Leaky ReLU's slope for the Triton kernels, as its kernels take it for ``mean``'s dtype
    (:func:`.relu_family.slope_for`): read by them as float64; filled on the device, so a launch
    inside a CUDA graph capture needs no copy from the host."""
    return torch.full((1,), slope_for(negative_slope, mean.dtype), dtype=torch.float64, device=mean.device)


def slope_operand(mean: Tensor, activation: int, negative_slope: float) -> Tensor:
    """The Triton kernels' slope operand: leaky ReLU's :func:`slope_tensor`; the others read none and
    get ``mean`` (unread), not one more fill kernel."""
    return slope_tensor(mean, negative_slope) if activation == relu_family.LEAKY_RELU else mean


def _constants(mean: Tensor, activation: int, from_variance: bool) -> tuple:
    # the moments kernels' compile-time arguments, after their operands
    floor, depth = variance_floor(mean.dtype), triton_kernels.cf_depth(mean.dtype)
    return activation, from_variance, floor, triton_kernels.BLOCK, depth


def triton_family_moments(mean, spread, activation, negative_slope, from_variance):
    """The Triton forward (:func:`~.triton_kernels.moments_kernel`, one launch) on ``mean``'s device."""
    check_activation("relu_family_moments", activation)  # (a kernel would read any other number as ReLU^2)
    check_operands("relu_family_moments", mean, spread)
    mean, spread = mean.contiguous(), spread.contiguous()
    phi, ups, var = (torch.empty_like(mean) for _ in range(3))
    n = mean.numel()
    operands = (mean, spread, slope_operand(mean, activation, negative_slope), phi, ups, var, n)
    triton_kernels.moments_kernel[triton_kernels.grid(n)](*operands, *_constants(mean, activation, from_variance))
    return phi, ups, var


def triton_family_moments_backward(
    mean, spread, phi, grad_phi, grad_ups, grad_var, activation, negative_slope, from_variance
):
    """Its Triton vector-Jacobian product (``phi`` unread from the variances: recomputed)."""
    check_activation("relu_family_moments_backward", activation)
    check_operands("relu_family_moments_backward", mean, spread, phi, grad_phi, grad_ups, grad_var)
    tensors = [t.contiguous() for t in (mean, spread, phi, grad_phi, grad_ups, grad_var)]
    grad_mean, grad_spread = torch.empty_like(tensors[0]), torch.empty_like(tensors[0])
    n = mean.numel()
    slope = slope_operand(tensors[0], activation, negative_slope)
    operands = (*tensors[:2], slope, *tensors[2:], grad_mean, grad_spread, n)
    triton_kernels.moments_backward_kernel[triton_kernels.grid(n)](
        *operands, *_constants(mean, activation, from_variance)
    )
    return grad_mean, grad_spread


def _family_reference(mean, spread, activation, negative_slope, from_variance):
    check_operands("relu_family_moments", mean, spread)
    moments = reference_family_moments(mean, spread, activation, negative_slope, from_variance)
    return tuple(value.clone() for value in moments)


def _family_backward_reference(mean, spread, phi, grad_phi, grad_ups, grad_var, *parameters):
    check_operands("relu_family_moments_backward", mean, spread, phi, grad_phi, grad_ups, grad_var)
    with torch.no_grad():
        return tuple(family_moments_vjp(mean, spread, phi, grad_phi, grad_ups, grad_var, *parameters))


def _moments_fake(mean, *_):
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)


def _pair_fake(mean, *_):
    return torch.empty_like(mean), torch.empty_like(mean)


def _save_moments(ctx, inputs, output):
    """What a moments operator's backward reads: ``mean``, ``spread``, ``Phi`` and the parameters; an
    unused output's gradient arrives as ``None`` (not a block of zeros)."""
    mean, spread, *parameters = inputs
    ctx.parameters = tuple(parameters)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(mean, spread, output[0])


def _moments_grads(mean, grads):
    return [g if g is not None else absent_gradient(mean) for g in grads]


def _family_backward(ctx, grad_phi, grad_ups, grad_var):
    mean, spread, phi = ctx.saved_tensors
    grads = _moments_grads(mean, (grad_phi, grad_ups, grad_var))
    return (*relu_family_moments_backward(mean, spread, phi, *grads, *ctx.parameters), None, None, None)


_FAMILY = "int activation, float negative_slope, bool from_variance"
_GRADIENTS = "Tensor phi, Tensor grad_phi, Tensor grad_upsilon, Tensor grad_variance"

relu_family_moments_backward = define(
    Operator(
        f"relu_family_moments_backward(Tensor mean, Tensor spread, {_GRADIENTS}, {_FAMILY}) -> (Tensor, Tensor)",
        _family_backward_reference,
        _pair_fake,
        cuda=triton_family_moments_backward,
        **differentiable_by_formula(family_moments_vjp, 6),
        vmap=elementwise_vmap("relu_family_moments_backward", 2, 6),
    )
)
relu_family_moments = define(
    Operator(
        f"relu_family_moments(Tensor mean, Tensor spread, {_FAMILY}) -> (Tensor, Tensor, Tensor)",
        _family_reference,
        _moments_fake,
        cuda=triton_family_moments,
        setup_context=_save_moments,
        backward=_family_backward,
        vmap=elementwise_vmap("relu_family_moments", 3, 2),
    )
)


def _relu_mean_reference(mean: Tensor, std: Tensor) -> Tensor:
    check_operands("relu_mean", mean, std)
    return relu_family.reference_moments(mean, std, RELU)[0].clone()


def triton_relu_mean(mean: Tensor, std: Tensor) -> Tensor:
    """ReLU's mean by the Triton :func:`~.triton_kernels.relu_mean_kernel` (one launch)."""
    check_operands("relu_mean", mean, std)
    mean, std = mean.contiguous(), std.contiguous()
    phi = torch.empty_like(mean)
    n = mean.numel()
    triton_kernels.relu_mean_kernel[triton_kernels.grid(n)](
        mean, std, phi, n, triton_kernels.BLOCK, triton_kernels.cf_depth(mean.dtype)
    )
    return phi


def _relu_mean_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output)


def _relu_mean_backward(ctx, grad_phi):
    mean, std, phi = ctx.saved_tensors
    unused = absent_gradient(mean)
    return relu_family_moments_backward(mean, std, phi, grad_phi, unused, unused, RELU, 0.0, False)


relu_mean = define(
    Operator(
        "relu_mean(Tensor mean, Tensor std) -> Tensor",
        _relu_mean_reference,
        lambda mean, std: torch.empty_like(mean),
        cuda=triton_relu_mean,
        setup_context=_relu_mean_setup,
        backward=_relu_mean_backward,
        vmap=elementwise_vmap("relu_mean", 1, 2),
    )
)

# ----------------------------------------------------------------------------- piecewise polynomials

GENERAL_ENGINE = math.nan  # the `alpha` that selects the general engine


def polynomial_from_table(table: Tensor, breakpoints: int, degree: int):
    """The :class:`.PiecewisePolynomial` a table holds (its ``bp`` and ``coef`` fields)."""
    head = sum(table_sizes(breakpoints, degree)[:2])
    return _polynomial(tuple(table.detach()[:head].cpu().double().tolist()), breakpoints, degree)


@functools.lru_cache(maxsize=64)
def _polynomial(values: Tuple[float, ...], breakpoints: int, degree: int):
    from .piecewise_polynomial import PiecewisePolynomial  # (that module calls this one's operators)

    bp = list(values[:breakpoints])
    coef = np.asarray(values[max(breakpoints, 1) :]).reshape(breakpoints + 1, degree + 1)
    return PiecewisePolynomial(bp, [row.tolist() for row in coef])


def saves_partials(dtype: torch.dtype, alpha: float) -> bool:
    """Whether ``partials=True`` returns the partial derivatives for this dtype and ``alpha`` (the
    engine does; the float32 hard sigmoid's kernels recompute them instead)."""
    return not (dtype == torch.float32 and math.isfinite(alpha) and alpha != 0.0)


def _piecewise_reference(mean, std, table, breakpoints, degree, alpha, partials=False):
    check_operands("piecewise_moments", mean, std)
    reference = polynomial_from_table(table, breakpoints, degree).reference_moments
    phi, ups, var = reference(mean, std)
    saved = mean.new_empty((0,))
    if partials and saves_partials(mean.dtype, alpha):
        # each partial derivative by one vector-Jacobian product of the reference (elementwise)
        _, vjp = torch.func.vjp(lambda m, s: reference(m, s)[::2], mean, std)
        ones, zeros = torch.ones_like(mean), torch.zeros_like(mean)
        saved = torch.stack([*vjp((ones, zeros)), *vjp((zeros, ones))])
    return phi.clone(), ups.clone(), var.clone(), saved


def _piecewise_fake(mean, std, table, breakpoints, degree, alpha, partials=False):
    saved = mean.new_empty((4, *mean.shape) if partials and saves_partials(mean.dtype, alpha) else (0,))
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean), saved


def piecewise_vjp(mean, std, phi, grad_phi, grad_ups, grad_var, table, breakpoints, degree, alpha, partials=None):
    """The vector-Jacobian product through the reference formula (``phi`` and ``partials`` unread:
    recomputed), differentiable to any order."""
    _, vjp = torch.func.vjp(polynomial_from_table(table, breakpoints, degree).reference_moments, mean, std)
    return vjp((grad_phi, grad_ups, grad_var))


def _piecewise_backward_reference(
    mean, std, phi, grad_phi, grad_ups, grad_var, table, breakpoints, degree, alpha, partials=None
):
    check_operands("piecewise_moments_backward", mean, std, phi, grad_phi, grad_ups, grad_var)
    with torch.no_grad():
        return tuple(piecewise_vjp(mean, std, phi, grad_phi, grad_ups, grad_var, table, breakpoints, degree, alpha))


def _piecewise_setup(ctx, inputs, output):
    mean, std, table, breakpoints, degree, alpha, _ = inputs
    ctx.parameters = (table, breakpoints, degree, alpha)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[3])
    ctx.save_for_backward(mean, std, output[0], output[3] if output[3].numel() else None)


def _piecewise_backward(ctx, grad_phi, grad_ups, grad_var, _grad_partials):
    mean, std, phi, partials = ctx.saved_tensors
    grads = _moments_grads(mean, (grad_phi, grad_ups, grad_var))
    result = piecewise_moments_backward(mean, std, phi, *grads, *ctx.parameters, partials)
    return (*result, None, None, None, None, None)


def _piecewise_vmap(info, in_dims, mean, std, table, breakpoints, degree, alpha, partials=False):
    if in_dims[2] is not None:
        raise NotImplementedError("cfbnn::piecewise_moments: vmap over the table is not supported")
    mean, std = (t.contiguous() for t in batch_first(info, in_dims[:2], mean, std))
    phi, ups, var, saved = piecewise_moments(mean, std, table, breakpoints, degree, alpha, partials)
    return (phi, ups, var, saved), (0, 0, 0, 1 if saved.numel() else None)


def _piecewise_backward_vmap(info, in_dims, *arguments):
    """Elementwise on the six tensors; batched saved partials are dropped (recomputed)."""
    if in_dims[6] is not None:
        raise NotImplementedError("cfbnn::piecewise_moments_backward: vmap over the table is not supported")
    tensors = [t.contiguous() for t in batch_first(info, in_dims[:6], *arguments[:6])]
    table, breakpoints, degree, alpha, partials = (*arguments[6:], None)[:5]  # (partials: given or not)
    partials = None if len(in_dims) > 10 and in_dims[10] is not None else partials
    return piecewise_moments_backward(*tensors, table, breakpoints, degree, alpha, partials), (0, 0)


_PIECEWISE = "Tensor table, int breakpoints, int degree, float alpha"
piecewise_moments_backward = define(
    Operator(
        f"piecewise_moments_backward(Tensor mean, Tensor std, {_GRADIENTS}, {_PIECEWISE}, Tensor? partials=None)"
        " -> (Tensor, Tensor)",
        _piecewise_backward_reference,
        _pair_fake,
        **differentiable_by_formula(piecewise_vjp, 6),
        vmap=_piecewise_backward_vmap,
    )
)
piecewise_moments = define(
    Operator(
        f"piecewise_moments(Tensor mean, Tensor std, {_PIECEWISE}, bool partials=False)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
        _piecewise_reference,
        _piecewise_fake,
        setup_context=_piecewise_setup,
        backward=_piecewise_backward,
        for_gradient=lambda inputs: (*inputs[:6], True),
        vmap=_piecewise_vmap,
    )
)

# ----------------------------------------------------------------------------- Gaussian building blocks


def _positive_part_reference(mean: Tensor, std: Tensor, order: int) -> Tensor:
    return gaussian.positive_part_moments_forward(mean, std, order)


def _positive_part_setup(ctx, inputs, output):
    mean, std, order = inputs
    ctx.order = order
    ctx.save_for_backward(mean, std, output)


def _positive_part_backward(ctx, grad_output):
    mean, std, moments = ctx.saved_tensors
    return (*gaussian.positive_part_moments_vjp(mean, std, moments, grad_output, ctx.order), None)


def _positive_part_vmap(info, in_dims, mean, std, order):
    mean, std = batch_first(info, in_dims[:2], mean, std)
    return positive_part_moments(mean, std, order), 0


positive_part_moments = define(
    Operator(
        "positive_part_moments(Tensor mean, Tensor std, int order) -> Tensor",
        _positive_part_reference,
        lambda mean, std, order: mean.new_empty((*mean.shape, order + 1)),
        setup_context=_positive_part_setup,
        backward=_positive_part_backward,
        vmap=_positive_part_vmap,
    )
)


def _cross_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(*inputs, output[1])


def _cross_backward(ctx, grad, _grad_probability):
    return bivariate.relu_cross_moment_vjp(*ctx.saved_tensors, grad)


relu_cross_moment = define(
    Operator(
        "relu_cross_moment(Tensor mean_i, Tensor mean_j, Tensor sd_i, Tensor sd_j, Tensor cov_ij) -> (Tensor, Tensor)",
        lambda *pair: tuple(value.clone() for value in bivariate.relu_cross_moment_forward(*pair)),
        lambda mean_i, *_: (torch.empty_like(mean_i), torch.empty_like(mean_i)),
        setup_context=_cross_setup,
        backward=_cross_backward,
        vmap=elementwise_vmap("relu_cross_moment", 2, 5),
    )
)


def _count_negative_reference(x: Tensor) -> int:
    if x.dtype not in FLOATS:
        raise ValueError(f"cfbnn::count_negative: `x` must be float32 or float64; got {x.dtype}")
    return int((x < 0).sum())


count_negative = define(
    Operator(
        "count_negative(Tensor x) -> int",
        _count_negative_reference,
        lambda x: torch.library.get_ctx().new_dynamic_size(),
    )
)

__all__ = [
    "GENERAL_ENGINE",
    "count_negative",
    "piecewise_moments",
    "piecewise_moments_backward",
    "piecewise_table",
    "polynomial_from_table",
    "positive_part_moments",
    "relu_cross_moment",
    "relu_family_moments",
    "relu_family_moments_backward",
    "relu_mean",
    "saves_partials",
    "slope_operand",
    "table_sizes",
    "triton_family_moments",
    "triton_family_moments_backward",
    "triton_relu_mean",
]
