"""Leaky ReLU's moments as torch operators: ``torch.ops.cfbnn.leaky_relu_moments*``.

``cfbnn::leaky_relu_moments(Tensor mean, Tensor std, float negative_slope) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    ``(E[g(z)], E[g(z)^2], Var[g(z)])`` of ``g(z) = z`` for ``z >= 0`` and ``negative_slope z``
    otherwise, ``z ~ N(mean, std^2)``, elementwise (paper eqs. (21), (22), errata 4 and 6; any
    real slope); ``mean`` and ``std`` of one shape, dtype float32 or float64. For float32 tensors
    the slope is the float32 number torch's float32 arithmetic multiplies by.
``cfbnn::leaky_relu_moments_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance, negative_slope) -> (grad_mean, grad_std)``
    its vector-Jacobian product (the Gaussian factors recomputed; no gradient through Var where
    its clamp at 0 bites, as the reference's ``clamp_min``).

Kernels, as for ``cfbnn::relu_moments`` (:mod:`.ops`): on the CPU the C++ ``leaky`` kernels
(``csrc/cfbnn_ops.cpp``, registered when the library loads; before that, and without a
compiler, :func:`reference_leaky_moments`); on CUDA the Triton kernels of
:mod:`.triton_kernels`, one launch each way. Autograd (the backward kernel; under
``create_graph`` inside :class:`.ops.KernelVJP`, whose own derivative is that of the
reference ops), fake and vmap registrations; ``opcheck`` in ``tests/moments/test_leaky_ops.py``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from . import fast
from .gaussian import align_batched, is_transformed
from .kernel_handles import slope_for
from .ops import (
    HAVE_TRITON,
    KernelVJP,
    absent_gradient,
    check_operands,
    differentiable_by_formula,
    elementwise_vmap,
    first_use_check,
    operator_route,
)
from .relu_reference import small_tail

if HAVE_TRITON:
    from . import triton_kernels

__all__ = [
    "leaky_relu_moments",
    "leaky_relu_moments_backward",
    "leaky_relu_moments_function",
    "leaky_operator_route",
    "reference_leaky_moments",
    "triton_leaky_relu_moments",
    "triton_leaky_relu_moments_backward",
]


def reference_leaky_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor]:
    """``(Phi, Var before its clamp)`` in torch ops through the small tail on the far side of 0
    (the printed ``((1+eps) x + (1-eps)|x|)/2`` form cancels there); differentiable to any order."""
    eps = negative_slope
    tail = small_tail(mean, std, 2)
    s1, s2 = tail[..., 1], tail[..., 2]
    upper = mean >= 0
    var = std * std
    # mean >= 0: g - mean = (z - mean) + (eps - 1) z 1{z<0}
    phi_upper = mean + (1.0 - eps) * s1
    second_upper = var + 2.0 * (eps - 1.0) * (s2 + mean * s1) + (eps - 1.0) ** 2 * s2
    # mean < 0: g - eps*mean = eps (z - mean) + (1 - eps) z 1{z>0}
    phi_lower = eps * mean + (1.0 - eps) * s1
    second_lower = eps * eps * var + 2.0 * eps * (1.0 - eps) * (s2 - mean * s1) + (1.0 - eps) ** 2 * s2
    shift_sq = (1.0 - eps) ** 2 * s1 * s1
    phi = torch.where(upper, phi_upper, phi_lower)
    return phi, torch.where(upper, second_upper, second_lower) - shift_sq


def _reference_forward(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    phi, variance = reference_leaky_moments(mean, std, slope_for(negative_slope, mean.dtype))
    variance = variance.clamp_min(0.0)  # rounding can leave -1 ulp; a variance is never negative
    return phi, variance + phi * phi, variance


def _differentiable_backward(mean, std, phi, grad_phi, grad_ups, grad_var, negative_slope: float):
    """The vector-Jacobian product through the reference ops (``phi`` unused: recomputed), to any
    order."""
    _, vjp = torch.func.vjp(lambda m, s: _reference_forward(m, s, negative_slope), mean, std)
    return vjp((grad_phi, grad_ups, grad_var))


# ----------------------------------------------------------------------------- Triton launches


def _slope_tensor(mean: Tensor, negative_slope: float) -> Tensor:
    # read by the kernels as float64 (a Triton float argument would be float32); filled on the
    # device, so a launch inside a CUDA graph capture needs no copy from the host
    return torch.full((1,), slope_for(negative_slope, mean.dtype), dtype=torch.float64, device=mean.device)


def triton_leaky_relu_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    mean, std = mean.contiguous(), std.contiguous()
    phi, ups, var = (torch.empty_like(mean) for _ in range(3))
    n = mean.numel()
    triton_kernels.leaky_relu_moments_kernel[triton_kernels.grid(n)](
        mean,
        std,
        _slope_tensor(mean, negative_slope),
        phi,
        ups,
        var,
        n,
        triton_kernels.BLOCK,
        triton_kernels.cf_depth(mean.dtype),
    )
    return phi, ups, var


def triton_leaky_relu_moments_backward(
    mean: Tensor, std: Tensor, phi: Tensor, grad_phi: Tensor, grad_ups: Tensor, grad_var: Tensor, negative_slope: float
) -> Tuple[Tensor, Tensor]:
    """The Triton vector-Jacobian product of :func:`triton_leaky_relu_moments`."""
    tensors = [t.contiguous() for t in (mean, std)]
    rest = [t.contiguous() for t in (phi, grad_phi, grad_ups, grad_var)]
    grad_mean, grad_std = torch.empty_like(tensors[0]), torch.empty_like(tensors[0])
    n = mean.numel()
    triton_kernels.leaky_relu_moments_backward_kernel[triton_kernels.grid(n)](
        *tensors,
        _slope_tensor(tensors[0], negative_slope),
        *rest,
        grad_mean,
        grad_std,
        n,
        triton_kernels.BLOCK,
        triton_kernels.cf_depth(mean.dtype),
    )
    return grad_mean, grad_std


# ----------------------------------------------------------------------------- the operators


@torch.library.custom_op("cfbnn::leaky_relu_moments", mutates_args=())
def leaky_relu_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    # the default kernel (every device but the CPU, which has its own below): Triton
    check_operands("leaky_relu_moments", mean, std)
    if not HAVE_TRITON:  # pragma: no cover - depends on the install
        return tuple(value.clone() for value in _reference_forward(mean, std, negative_slope))
    return triton_leaky_relu_moments(mean, std, negative_slope)


@torch.library.custom_op("cfbnn::leaky_relu_moments_backward", mutates_args=())
def leaky_relu_moments_backward(
    mean: Tensor,
    std: Tensor,
    phi: Tensor,
    grad_phi: Tensor,
    grad_upsilon: Tensor,
    grad_variance: Tensor,
    negative_slope: float,
) -> Tuple[Tensor, Tensor]:
    check_operands("leaky_relu_moments_backward", mean, std, phi, grad_phi, grad_upsilon, grad_variance)
    if not HAVE_TRITON:  # pragma: no cover - depends on the install
        return _differentiable_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance, negative_slope)
    return triton_leaky_relu_moments_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance, negative_slope)


@leaky_relu_moments.register_kernel("cpu")
def _leaky_relu_moments_cpu(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    # before the library has loaded: load it (its C++ kernel then takes over) or, without a
    # compiler, the reference ops (fresh tensors, as an operator must return)
    check_operands("leaky_relu_moments", mean, std)
    if fast.load_kernels() is not None and fast.cpu_operators_registered():
        return torch.ops.cfbnn.leaky_relu_moments(mean, std, negative_slope)
    return tuple(value.clone() for value in _reference_forward(mean, std, negative_slope))


@leaky_relu_moments_backward.register_kernel("cpu")
def _leaky_relu_moments_backward_cpu(mean, std, phi, grad_phi, grad_upsilon, grad_variance, negative_slope):
    check_operands("leaky_relu_moments_backward", mean, std, phi, grad_phi, grad_upsilon, grad_variance)
    grads = (grad_phi, grad_upsilon, grad_variance)
    if fast.load_kernels() is not None and fast.cpu_operators_registered():
        return torch.ops.cfbnn.leaky_relu_moments_backward(mean, std, phi, *grads, negative_slope)
    with torch.no_grad():
        return tuple(_differentiable_backward(mean, std, phi, *grads, negative_slope))


@leaky_relu_moments.register_fake
def _(mean, std, negative_slope):
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)


@leaky_relu_moments_backward.register_fake
def _(mean, std, phi, grad_phi, grad_upsilon, grad_variance, negative_slope):
    return torch.empty_like(mean), torch.empty_like(mean)


def _setup_context(ctx, inputs, output):
    mean, std, negative_slope = inputs
    ctx.negative_slope = negative_slope
    ctx.set_materialize_grads(False)  # an unused output's gradient: absent_gradient, not a block of zeros
    ctx.save_for_backward(mean, std, output[0])


def _backward(ctx, grad_phi, grad_upsilon, grad_variance):
    mean, std, phi = ctx.saved_tensors
    grads = [g if g is not None else absent_gradient(mean) for g in (grad_phi, grad_upsilon, grad_variance)]
    if torch.is_grad_enabled():  # a graph of the backward is wanted: the kernel, differentiable again
        return (*_kernel_vjp(mean, std, phi, grads, ctx.negative_slope), None)
    return (*leaky_relu_moments_backward(mean, std, phi, *grads, ctx.negative_slope), None)


def _kernel_vjp(mean, std, phi, grads, negative_slope):
    """The backward kernel with a derivative of its own (:class:`.ops.KernelVJP`)."""
    kernel = torch.ops.cfbnn.leaky_relu_moments_backward
    return KernelVJP.apply(kernel, _differentiable_backward, mean, std, phi, *grads, negative_slope)


leaky_relu_moments.register_autograd(_backward, setup_context=_setup_context)
differentiable_by_formula(leaky_relu_moments_backward, _differentiable_backward, 6)


leaky_relu_moments.register_vmap(elementwise_vmap(leaky_relu_moments, 3))
leaky_relu_moments_backward.register_vmap(elementwise_vmap(leaky_relu_moments_backward, 2))


class LeakyReLUMoments(torch.autograd.Function):
    """``(Phi, Upsilon, Var)`` through the two operators, as an autograd.Function so that
    ``torch.func`` transforms work as well as autograd (as :class:`.ops.ReLUMoments`)."""

    @staticmethod
    def forward(mean, std, negative_slope):
        return tuple(torch.ops.cfbnn.leaky_relu_moments(mean, std, negative_slope))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_phi, grad_upsilon, grad_variance):
        mean, std, phi = ctx.saved_tensors
        grads = [g if g is not None else absent_gradient(mean) for g in (grad_phi, grad_upsilon, grad_variance)]
        if torch.is_grad_enabled() or any(is_transformed(t) for t in (mean, std, phi, *grads)):
            return (*_kernel_vjp(mean, std, phi, grads, ctx.negative_slope), None)
        return (*torch.ops.cfbnn.leaky_relu_moments_backward(mean, std, phi, *grads, ctx.negative_slope), None)

    @staticmethod
    def vmap(info, in_dims, mean, std, negative_slope):
        mean, std = align_batched(mean, std, in_dims[:2])
        return LeakyReLUMoments.apply(*torch.broadcast_tensors(mean, std), negative_slope), (0, 0, 0)


def leaky_relu_moments_function(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through the operators (autograd
    and ``torch.func`` included)."""
    mean, std = torch.broadcast_tensors(mean, std)
    negative_slope = float(negative_slope)
    if is_transformed(mean) or is_transformed(std):
        return LeakyReLUMoments.apply(mean, std, negative_slope)
    # outside torch.func the operator's own autograd registration serves (cheaper than the Function)
    return tuple(torch.ops.cfbnn.leaky_relu_moments(mean, std, negative_slope))


# ----------------------------------------------------------------------------- the route


def _self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Both Triton kernels on a few elements (compiling them)."""
    values = torch.linspace(-3.0, 3.0, 8, dtype=dtype, device=device)
    spread = torch.linspace(0.5, 2.0, 8, dtype=dtype, device=device)
    outputs = [
        *triton_leaky_relu_moments(values, spread, 0.1),
        *triton_leaky_relu_moments_backward(values, spread, values, spread, spread, spread, 0.1),
    ]
    if not all(bool(torch.isfinite(t).all()) for t in outputs):
        raise FloatingPointError("non-finite values on a well-conditioned problem")


def leaky_operator_route(mean: Tensor) -> bool:
    """Whether ``LeakyReLU.moments`` takes ``cfbnn::leaky_relu_moments`` for ``mean``: where
    :func:`.ops.operator_route` (the CPU with the C++ library's operators, CUDA), on CUDA once its
    Triton kernels' first run on that device and dtype passed."""
    if not operator_route(mean):
        return False
    return mean.device.type == "cpu" or first_use_check(
        "the Triton kernels of cfbnn::leaky_relu_moments", mean.device, mean.dtype, _self_check
    )
