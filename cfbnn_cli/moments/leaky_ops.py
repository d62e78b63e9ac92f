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
``create_graph`` inside :class:`.operator_registration.KernelVJP`, whose own derivative is that of the
reference ops), fake and vmap registrations; ``opcheck`` in ``tests/moments/test_leaky_ops.py``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .operator_registration import (
    check_operands,
    moments_function,
    register_moments_operators,
)
from .ops import (
    ACTIVATION_KINDS,
    HAVE_TRITON,
    checked_operator_route,
    launch_family_moments,
    launch_family_moments_backward,
    moments_kernels_check,
    slope_for,
)
from .relu_reference import small_tail

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


def triton_leaky_relu_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    return launch_family_moments(mean, std, ACTIVATION_KINDS["leaky_relu"], negative_slope)


def triton_leaky_relu_moments_backward(
    mean: Tensor, std: Tensor, phi: Tensor, grad_phi: Tensor, grad_ups: Tensor, grad_var: Tensor, negative_slope: float
) -> Tuple[Tensor, Tensor]:
    """The Triton vector-Jacobian product of :func:`triton_leaky_relu_moments`."""
    return launch_family_moments_backward(
        mean, std, phi, grad_phi, grad_ups, grad_var, ACTIVATION_KINDS["leaky_relu"], negative_slope
    )


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


@leaky_relu_moments.register_fake
def _(mean, std, negative_slope):
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)


@leaky_relu_moments_backward.register_fake
def _(mean, std, phi, grad_phi, grad_upsilon, grad_variance, negative_slope):
    return torch.empty_like(mean), torch.empty_like(mean)


register_moments_operators(
    leaky_relu_moments, leaky_relu_moments_backward, _reference_forward, _differentiable_backward
)


def leaky_relu_moments_function(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through the operators (autograd
    and ``torch.func`` included)."""
    arguments = (leaky_relu_moments, leaky_relu_moments_backward, _differentiable_backward, mean, std)
    return moments_function(*arguments, float(negative_slope))


_KERNELS_CHECK = moments_kernels_check(triton_leaky_relu_moments, triton_leaky_relu_moments_backward, 0.1)


def leaky_operator_route(mean: Tensor) -> bool:
    """Whether ``LeakyReLU.moments`` takes ``cfbnn::leaky_relu_moments`` for ``mean``: where
    :func:`.ops.operator_route` (the CPU with the C++ library's operators, CUDA), on CUDA once its
    Triton kernels' first run on that device and dtype passed."""
    return checked_operator_route(mean, "the Triton kernels of cfbnn::leaky_relu_moments", _KERNELS_CHECK)
