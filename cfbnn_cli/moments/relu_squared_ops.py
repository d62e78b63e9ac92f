"""ReLU^2's moments as torch operators: ``torch.ops.cfbnn.relu_squared_moments*``.

``cfbnn::relu_squared_moments(Tensor mean, Tensor std) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    ``(E[g(z)], E[g(z)^2], Var[g(z)])`` of ``g(z) = max(z, 0)^2``, ``z ~ N(mean, std^2)``,
    elementwise (paper eqs. (28), (29) with the corrected rho of eq. (34), errata 1 and 2);
    ``mean`` and ``std`` of one shape, dtype float32 or float64.
``cfbnn::relu_squared_moments_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance) -> (grad_mean, grad_std)``
    its vector-Jacobian product (the Gaussian factors recomputed; no gradient through Var where
    its clamp at 0 bites, as the reference's ``clamp_min``).

Kernels, as for ``cfbnn::leaky_relu_moments`` (:mod:`.leaky_ops`): on the CPU the C++ ``relusq``
kernels (``csrc/cfbnn_ops.cpp``, registered with their C++ autograd when the library loads;
before that, and without a compiler, :func:`reference_relu_squared_moments`); on CUDA the Triton
kernels of :mod:`.triton_kernels`, one launch each way, float64 arithmetic from the small tail
to its fourth order. Autograd, fake and vmap registrations; ``opcheck`` and the quadrature
references in ``tests/moments/test_relu_squared_ops.py``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from . import fast
from .gaussian import align_batched, is_transformed
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
    "reference_relu_squared_moments",
    "relu_squared_moments",
    "relu_squared_moments_backward",
    "relu_squared_moments_function",
    "relu_squared_operator_route",
    "triton_relu_squared_moments",
    "triton_relu_squared_moments_backward",
]


def reference_relu_squared_moments(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor]:
    """``(Phi, Var before its clamp)`` in torch ops from the small tail on the far side of 0 (the
    C++ ``relusq_combine``); differentiable to any order."""
    tail = small_tail(mean, std, 4)
    s2, s4 = tail[..., 2], tail[..., 4]
    upper = mean >= 0
    var = std * std
    mean_sq = mean * mean
    # mean >= 0: g - mean^2 = (z^2 - mean^2) - z^2 1{z<0}
    phi_upper = mean_sq + var - s2
    var_upper = 4.0 * mean_sq * var + 2.0 * var * var + 2.0 * var * s2 - s2 * s2 - s4 + 2.0 * mean_sq * s2
    # mean < 0: g = z^2 1{z>0}, all of it in the small tail
    var_lower = s4 - s2 * s2
    return torch.where(upper, phi_upper, s2), torch.where(upper, var_upper, var_lower)


def _reference_forward(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    phi, variance = reference_relu_squared_moments(mean, std)
    variance = variance.clamp_min(0.0)  # rounding can leave -1 ulp; a variance is never negative
    return phi, variance + phi * phi, variance


def _differentiable_backward(mean, std, phi, grad_phi, grad_ups, grad_var):
    """The vector-Jacobian product through the reference ops (``phi`` unused: recomputed), to any
    order."""
    _, vjp = torch.func.vjp(_reference_forward, mean, std)
    return vjp((grad_phi, grad_ups, grad_var))


# ----------------------------------------------------------------------------- Triton launches


def triton_relu_squared_moments(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    mean, std = mean.contiguous(), std.contiguous()
    phi, ups, var = (torch.empty_like(mean) for _ in range(3))
    n = mean.numel()
    triton_kernels.relu_squared_moments_kernel[triton_kernels.grid(n)](
        mean, std, phi, ups, var, n, triton_kernels.BLOCK, triton_kernels.cf_depth(mean.dtype)
    )
    return phi, ups, var


def triton_relu_squared_moments_backward(
    mean: Tensor, std: Tensor, phi: Tensor, grad_phi: Tensor, grad_ups: Tensor, grad_var: Tensor
) -> Tuple[Tensor, Tensor]:
    """The Triton vector-Jacobian product of :func:`triton_relu_squared_moments`."""
    tensors = [t.contiguous() for t in (mean, std, phi, grad_phi, grad_ups, grad_var)]
    grad_mean, grad_std = torch.empty_like(tensors[0]), torch.empty_like(tensors[0])
    n = mean.numel()
    triton_kernels.relu_squared_moments_backward_kernel[triton_kernels.grid(n)](
        *tensors, grad_mean, grad_std, n, triton_kernels.BLOCK, triton_kernels.cf_depth(mean.dtype)
    )
    return grad_mean, grad_std


# ----------------------------------------------------------------------------- the operators


@torch.library.custom_op("cfbnn::relu_squared_moments", mutates_args=())
def relu_squared_moments(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    # the default kernel (every device but the CPU, which has its own below): Triton
    check_operands("relu_squared_moments", mean, std)
    if not HAVE_TRITON:  # pragma: no cover - depends on the install
        return tuple(value.clone() for value in _reference_forward(mean, std))
    return triton_relu_squared_moments(mean, std)


@torch.library.custom_op("cfbnn::relu_squared_moments_backward", mutates_args=())
def relu_squared_moments_backward(
    mean: Tensor, std: Tensor, phi: Tensor, grad_phi: Tensor, grad_upsilon: Tensor, grad_variance: Tensor
) -> Tuple[Tensor, Tensor]:
    check_operands("relu_squared_moments_backward", mean, std, phi, grad_phi, grad_upsilon, grad_variance)
    if not HAVE_TRITON:  # pragma: no cover - depends on the install
        return _differentiable_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance)
    return triton_relu_squared_moments_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance)


@relu_squared_moments.register_kernel("cpu")
def _relu_squared_moments_cpu(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    # before the library has loaded: load it (its C++ kernel then takes over) or, without a
    # compiler, the reference ops (fresh tensors, as an operator must return)
    check_operands("relu_squared_moments", mean, std)
    if fast.load_kernels() is not None and fast.cpu_operators_registered():
        return torch.ops.cfbnn.relu_squared_moments(mean, std)
    return tuple(value.clone() for value in _reference_forward(mean, std))


@relu_squared_moments_backward.register_kernel("cpu")
def _relu_squared_moments_backward_cpu(mean, std, phi, grad_phi, grad_upsilon, grad_variance):
    check_operands("relu_squared_moments_backward", mean, std, phi, grad_phi, grad_upsilon, grad_variance)
    grads = (grad_phi, grad_upsilon, grad_variance)
    if fast.load_kernels() is not None and fast.cpu_operators_registered():
        return torch.ops.cfbnn.relu_squared_moments_backward(mean, std, phi, *grads)
    with torch.no_grad():
        return tuple(_differentiable_backward(mean, std, phi, *grads))


@relu_squared_moments.register_fake
def _(mean, std):
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)


@relu_squared_moments_backward.register_fake
def _(mean, std, phi, grad_phi, grad_upsilon, grad_variance):
    return torch.empty_like(mean), torch.empty_like(mean)


def _setup_context(ctx, inputs, output):
    mean, std = inputs
    ctx.set_materialize_grads(False)  # an unused output's gradient: absent_gradient, not a block of zeros
    ctx.save_for_backward(mean, std, output[0])


def _kernel_vjp(mean, std, phi, grads):
    """The backward kernel with a derivative of its own (:class:`.ops.KernelVJP`)."""
    kernel = torch.ops.cfbnn.relu_squared_moments_backward
    return KernelVJP.apply(kernel, _differentiable_backward, mean, std, phi, *grads)


def _backward(ctx, grad_phi, grad_upsilon, grad_variance):
    mean, std, phi = ctx.saved_tensors
    grads = [g if g is not None else absent_gradient(mean) for g in (grad_phi, grad_upsilon, grad_variance)]
    if torch.is_grad_enabled():  # a graph of the backward is wanted: the kernel, differentiable again
        return _kernel_vjp(mean, std, phi, grads)
    return relu_squared_moments_backward(mean, std, phi, *grads)


relu_squared_moments.register_autograd(_backward, setup_context=_setup_context)
differentiable_by_formula(relu_squared_moments_backward, _differentiable_backward, 6)
relu_squared_moments.register_vmap(elementwise_vmap(relu_squared_moments, 3))
relu_squared_moments_backward.register_vmap(elementwise_vmap(relu_squared_moments_backward, 2))


class ReLUSquaredMoments(torch.autograd.Function):
    """``(Phi, Upsilon, Var)`` through the two operators, as an autograd.Function so that
    ``torch.func`` transforms work as well as autograd (as :class:`.ops.ReLUMoments`)."""

    @staticmethod
    def forward(mean, std):
        return tuple(torch.ops.cfbnn.relu_squared_moments(mean, std))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_phi, grad_upsilon, grad_variance):
        mean, std, phi = ctx.saved_tensors
        grads = [g if g is not None else absent_gradient(mean) for g in (grad_phi, grad_upsilon, grad_variance)]
        if torch.is_grad_enabled() or any(is_transformed(t) for t in (mean, std, phi, *grads)):
            return _kernel_vjp(mean, std, phi, grads)
        return tuple(torch.ops.cfbnn.relu_squared_moments_backward(mean, std, phi, *grads))

    @staticmethod
    def vmap(info, in_dims, mean, std):
        mean, std = align_batched(mean, std, in_dims)
        return ReLUSquaredMoments.apply(*torch.broadcast_tensors(mean, std)), (0, 0, 0)


def relu_squared_moments_function(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through the operators (autograd
    and ``torch.func`` included)."""
    mean, std = torch.broadcast_tensors(mean, std)
    if is_transformed(mean) or is_transformed(std):
        return ReLUSquaredMoments.apply(mean, std)
    # outside torch.func the operator's own autograd registration serves (on the CPU: C++)
    return tuple(torch.ops.cfbnn.relu_squared_moments(mean, std))


# ----------------------------------------------------------------------------- the route


def _self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Both Triton kernels on a few elements (compiling them)."""
    values = torch.linspace(-3.0, 3.0, 8, dtype=dtype, device=device)
    spread = torch.linspace(0.5, 2.0, 8, dtype=dtype, device=device)
    outputs = [
        *triton_relu_squared_moments(values, spread),
        *triton_relu_squared_moments_backward(values, spread, values, spread, spread, spread),
    ]
    if not all(bool(torch.isfinite(t).all()) for t in outputs):
        raise FloatingPointError("non-finite values on a well-conditioned problem")


def relu_squared_operator_route(mean: Tensor) -> bool:
    """Whether ``ReLUSquared.moments`` takes ``cfbnn::relu_squared_moments`` for ``mean``: where
    :func:`.ops.operator_route` (the CPU with the C++ library's operators, CUDA), on CUDA once its
    Triton kernels' first run on that device and dtype passed."""
    if not operator_route(mean):
        return False
    return mean.device.type == "cpu" or first_use_check(
        "the Triton kernels of cfbnn::relu_squared_moments", mean.device, mean.dtype, _self_check
    )
