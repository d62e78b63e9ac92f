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
)
from .relu_reference import small_tail

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
    return launch_family_moments(mean, std, ACTIVATION_KINDS["relu_squared"])


def triton_relu_squared_moments_backward(
    mean: Tensor, std: Tensor, phi: Tensor, grad_phi: Tensor, grad_ups: Tensor, grad_var: Tensor
) -> Tuple[Tensor, Tensor]:
    """The Triton vector-Jacobian product of :func:`triton_relu_squared_moments`."""
    return launch_family_moments_backward(
        mean, std, phi, grad_phi, grad_ups, grad_var, ACTIVATION_KINDS["relu_squared"]
    )


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


@relu_squared_moments.register_fake
def _(mean, std):
    return torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)


@relu_squared_moments_backward.register_fake
def _(mean, std, phi, grad_phi, grad_upsilon, grad_variance):
    return torch.empty_like(mean), torch.empty_like(mean)


register_moments_operators(
    relu_squared_moments, relu_squared_moments_backward, _reference_forward, _differentiable_backward
)


def relu_squared_moments_function(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through the operators (autograd
    and ``torch.func`` included)."""
    return moments_function(relu_squared_moments, relu_squared_moments_backward, _differentiable_backward, mean, std)


_KERNELS_CHECK = moments_kernels_check(triton_relu_squared_moments, triton_relu_squared_moments_backward)


def relu_squared_operator_route(mean: Tensor) -> bool:
    """Whether ``ReLUSquared.moments`` takes ``cfbnn::relu_squared_moments`` for ``mean``: where
    :func:`.ops.operator_route` (the CPU with the C++ library's operators, CUDA), on CUDA once its
    Triton kernels' first run on that device and dtype passed."""
    return checked_operator_route(mean, "the Triton kernels of cfbnn::relu_squared_moments", _KERNELS_CHECK)
