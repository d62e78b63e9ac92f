"""The ReLU family's other members as torch operators, each declared once
(:func:`.operator_registration.define_moments_operators`):

``cfbnn::leaky_relu_moments(Tensor mean, Tensor std, float negative_slope) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    ``(E[g(z)], E[g(z)^2], Var[g(z)])`` of ``g(z) = z`` for ``z >= 0`` and ``negative_slope z``
    otherwise, ``z ~ N(mean, std^2)``, elementwise (paper eqs. (21), (22), errata 4 and 6; any
    real slope). For float32 tensors the slope is the float32 number torch's float32 arithmetic
    multiplies by.
``cfbnn::relu_squared_moments(Tensor mean, Tensor std) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    the same of ``g(z) = max(z, 0)^2`` (paper eqs. (28), (29) with the corrected rho of eq. (34),
    errata 1 and 2).

``mean`` and ``std`` of one shape, dtype float32 or float64. Each has a backward operator
``cfbnn::<name>_backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance[, negative_slope])
-> (grad_mean, grad_std)``: the vector-Jacobian product (the Gaussian factors recomputed; no gradient
through Var where its clamp at 0 bites, as the reference's ``clamp_min``).

Kernels, as ``cfbnn::relu_moments``' (:mod:`.ops`): on the CPU the C++ ``leaky`` and ``relusq``
kernels with their C++ autograd (``csrc/cfbnn_ops.cpp``; without a compiler the reference formulas
below); on CUDA the Triton :func:`~.triton_kernels.moments_kernel` with the member's ``ACTIVATION``,
one launch each way. Tested against quadrature and with ``opcheck`` in
``tests/moments/test_leaky_ops.py`` and ``tests/moments/test_relu_squared_ops.py``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .operator_registration import define_moments_operators, moments_function
from .ops import (
    ACTIVATION_KINDS,
    launch_moments,
    launch_moments_backward,
    slope_for,
)
from .relu_reference import small_tail

LEAKY = ACTIVATION_KINDS["leaky_relu"]
RELU_SQUARED = ACTIVATION_KINDS["relu_squared"]

# ----------------------------------------------------------------------------- reference formulas


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


def _with_upsilon(phi: Tensor, variance: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    variance = variance.clamp_min(0.0)  # rounding can leave -1 ulp; a variance is never negative
    return phi, variance + phi * phi, variance


def leaky_reference_forward(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of leaky ReLU in torch ops, the slope as the kernels take it."""
    return _with_upsilon(*reference_leaky_moments(mean, std, slope_for(negative_slope, mean.dtype)))


def relu_squared_reference_forward(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of ReLU^2 in torch ops."""
    return _with_upsilon(*reference_relu_squared_moments(mean, std))


def _vjp_formula(reference_forward):
    """The vector-Jacobian product through ``reference_forward`` (``phi`` unused: recomputed), to any
    order: the backward operator's formula, its own derivative and its no-compiler kernel."""

    def formula(mean, std, phi, grad_phi, grad_ups, grad_var, *numbers):
        _, vjp = torch.func.vjp(lambda m, s: reference_forward(m, s, *numbers), mean, std)
        return vjp((grad_phi, grad_ups, grad_var))

    return formula


_leaky_formula = _vjp_formula(leaky_reference_forward)
_relu_squared_formula = _vjp_formula(relu_squared_reference_forward)

# ----------------------------------------------------------------------------- Triton launches


def triton_leaky_relu_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    return launch_moments(mean, std, LEAKY, negative_slope)


def triton_leaky_relu_moments_backward(mean, std, phi, grad_phi, grad_ups, grad_var, negative_slope: float):
    """The Triton vector-Jacobian product of :func:`triton_leaky_relu_moments`."""
    return launch_moments_backward(mean, std, phi, (grad_phi, grad_ups, grad_var), LEAKY, negative_slope)


def triton_relu_squared_moments(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    return launch_moments(mean, std, RELU_SQUARED)


def triton_relu_squared_moments_backward(mean, std, phi, grad_phi, grad_ups, grad_var):
    """The Triton vector-Jacobian product of :func:`triton_relu_squared_moments`."""
    return launch_moments_backward(mean, std, phi, (grad_phi, grad_ups, grad_var), RELU_SQUARED)


# ----------------------------------------------------------------------------- the operators

leaky_relu_moments, leaky_relu_moments_backward = define_moments_operators(
    "leaky_relu_moments",
    ", float negative_slope",
    triton_leaky_relu_moments,
    triton_leaky_relu_moments_backward,
    leaky_reference_forward,
    _leaky_formula,
)
relu_squared_moments, relu_squared_moments_backward = define_moments_operators(
    "relu_squared_moments",
    "",
    triton_relu_squared_moments,
    triton_relu_squared_moments_backward,
    relu_squared_reference_forward,
    _relu_squared_formula,
)


def leaky_relu_moments_function(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through the operators (autograd
    and ``torch.func`` included)."""
    operators = (leaky_relu_moments, leaky_relu_moments_backward, _leaky_formula)
    return moments_function(*operators, mean, std, float(negative_slope))


def relu_squared_moments_function(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """As :func:`leaky_relu_moments_function`, for ReLU^2."""
    return moments_function(relu_squared_moments, relu_squared_moments_backward, _relu_squared_formula, mean, std)
