"""The ReLU family -- ReLU, leaky ReLU and ReLU^2 -- as numbers, and its reference formulas.

Each member is a number, :data:`ACTIVATION_KINDS`: the ``activation`` argument of every family
operator (``cfbnn::relu_family_moments``, ``cfbnn::relu_tail*``, ``cfbnn::prediction_*``) and of
their kernels (C++: ``by_kind`` in ``csrc/cfbnn_moments.cpp``; Triton: the ``ACTIVATION``
constexpr of :mod:`.triton_kernels`). The formulas below, in torch ops, are those operators' default
kernels and the tests' oracle:

* ReLU: paper eq. (20) (:mod:`.relu_reference`);
* leaky ReLU ``g(z) = z`` for ``z >= 0``, ``negative_slope z`` otherwise: eqs. (21), (22), errata 4
  and 6, any real slope;
* ReLU^2 ``g(z) = max(z, 0)^2``: eqs. (28), (29) with the corrected rho of eq. (34), errata 1, 2.

Each is written through the small tail on the far side of 0 (the printed forms cancel there) and is
differentiable to any order. A new member is its number and formulas here, its class in
:mod:`.activations` (``family_kind``), a branch of the Triton ``family_partials`` and
``family_pointwise``, and a case of the C++ ``by_kind`` (CONTRIBUTING.md).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np
import torch
from torch import Tensor

from .gaussian import standard_normal_cdf, standard_normal_pdf, standardize
from .relu_reference import relu_forward, small_tail

__all__ = [
    "ACTIVATION_KINDS",
    "check_activation",
    "family_moments_vjp",
    "pointwise",
    "reference_family_moments",
    "reference_moments",
    "slope_for",
    "std_from_variance",
    "variance_floor",
]

# the family's members by name: their ``activation`` number everywhere
ACTIVATION_KINDS = {"relu": 0, "leaky_relu": 1, "relu_squared": 2}
RELU, LEAKY_RELU, RELU_SQUARED = (ACTIVATION_KINDS[name] for name in ("relu", "leaky_relu", "relu_squared"))


def check_activation(operator: str, activation: int, also: str = "") -> None:
    """A ``ValueError`` naming ``cfbnn::<operator>`` unless ``activation`` is a member's number
    (``also``: what else the operator takes, said in the message)."""
    if activation not in ACTIVATION_KINDS.values():
        members = ", ".join(f"{number} {name}" for name, number in ACTIVATION_KINDS.items())
        raise ValueError(
            f"cfbnn::{operator}: `activation` must be one of the ReLU family's members "
            f"0 .. {len(ACTIVATION_KINDS) - 1} ({members}){also}; got {activation}"
        )


def slope_for(negative_slope: float, dtype: torch.dtype) -> float:
    """Leaky ReLU's slope as its kernels take it: for float32 tensors the float32 number float32
    torch arithmetic multiplies by."""
    return float(np.float32(negative_slope)) if dtype == torch.float32 else float(negative_slope)


def variance_floor(dtype: torch.dtype) -> float:
    """The floor of a variance the family's operators take (``from_variance``): the dtype's
    smallest normal number, so its square root is never 0."""
    return float(torch.finfo(dtype).tiny)


def std_from_variance(variance: Tensor) -> Tensor:
    """The standard deviation of a variance kept at or above :func:`variance_floor` (sqrt's slope
    is infinite at 0)."""
    return variance.clamp(min=variance_floor(variance.dtype)).sqrt()


# ----------------------------------------------------------------------------- each member


def reference_leaky_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor]:
    """``(Phi, Var before its clamp)`` of leaky ReLU (the slope as given)."""
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
    """``(Phi, Var before its clamp)`` of ReLU^2 (the C++ ``relusq_combine``)."""
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


def reference_relu_moments(mean: Tensor, std: Tensor) -> Tuple[Tensor, Tensor]:
    """``(Phi, Var before its clamp)`` of ReLU through the small tail (the continued fraction where the
    recursion loses digits: float64 results to 1e-10 out to ``|t| = 40``)."""
    tail = small_tail(mean, std, 2)
    s1, s2 = tail[..., 1], tail[..., 2]
    upper = mean >= 0
    phi = torch.where(upper, mean + s1, s1)
    var_upper = std * std - (s2 + 2.0 * mean * s1 + s1 * s1)
    var_lower = s2 - s1 * s1
    return phi, torch.where(upper, var_upper, var_lower)


def _relu_moments(mean: Tensor, std: Tensor, negative_slope: float) -> Tuple[Tensor, Tensor, Tensor]:
    """ReLU's moments: float64 through :func:`reference_relu_moments`; other dtypes through the block
    recursion in float64 (:func:`.relu_reference.relu_forward`), accurate for their results."""
    if mean.dtype == torch.float64:
        return _with_upsilon(*reference_relu_moments(mean, std))
    phi, ups, var, *_ = relu_forward(mean, std)
    return phi, ups, var


# activation -> (mean, std, slope) -> (Phi, Upsilon, Var), and -> (x, slope) -> g(x)
MOMENTS: Dict[int, Callable] = {
    RELU: _relu_moments,
    LEAKY_RELU: lambda mean, std, slope: _with_upsilon(*reference_leaky_moments(mean, std, slope)),
    RELU_SQUARED: lambda mean, std, slope: _with_upsilon(*reference_relu_squared_moments(mean, std)),
}
POINTWISE: Dict[int, Callable] = {
    RELU: lambda x, slope: torch.relu(x),
    LEAKY_RELU: lambda x, slope: torch.where(x >= 0, x, slope * x),
    RELU_SQUARED: lambda x, slope: torch.relu(x).square(),
}


def reference_moments(mean: Tensor, std: Tensor, activation: int, negative_slope: float = 0.0):
    """``(Phi, Upsilon, Var)`` of the member ``activation`` for ``z ~ N(mean, std^2)`` in torch ops,
    the slope as the kernels take it (:func:`slope_for`)."""
    check_activation("relu_family_moments", activation)
    return MOMENTS[activation](mean, std, slope_for(negative_slope, mean.dtype))


def pointwise(x: Tensor, activation: int, negative_slope: float = 0.0) -> Tensor:
    """``g(x)`` of the member ``activation`` (a NaN stays NaN), the slope as the kernels take it."""
    return POINTWISE[activation](x, slope_for(negative_slope, x.dtype))


# ----------------------------------------------------------------------------- the operator's formulas


def reference_family_moments(mean: Tensor, spread: Tensor, activation: int, negative_slope: float, from_variance: bool):
    """``cfbnn::relu_family_moments``' formula: :func:`reference_moments` with ``spread`` the standard
    deviation, or with ``from_variance`` the variance (floored: :func:`std_from_variance`)."""
    std = std_from_variance(spread) if from_variance else spread
    return reference_moments(mean, std, activation, negative_slope)


def _relu_vjp(mean, std, phi, grad_phi, grad_ups, grad_var) -> Tuple[Tensor, Tensor]:
    """ReLU's vector-Jacobian product (the heat-equation identities) in differentiable torch ops."""
    t, _, _ = standardize(mean, std)
    cdf, cdf_neg, pdf = standard_normal_cdf(t), standard_normal_cdf(-t), standard_normal_pdf(t)
    twice_phi = 2.0 * phi
    grad_mean = grad_phi * cdf + twice_phi * (grad_ups + grad_var * cdf_neg)
    grad_std = grad_phi * pdf + 2.0 * std * cdf * (grad_ups + grad_var) - twice_phi * pdf * grad_var
    return grad_mean, grad_std


def _member_derivatives(mean, std, activation, slope):
    """``(Phi, dPhi/dmean, dPhi/dstd, dUpsilon/dmean, dUpsilon/dstd)`` of leaky ReLU or ReLU^2 by the
    heat-equation identities ``dE[g]/dmean = E[g']``, ``dE[g]/dstd = std E[g'']``, written with the
    small tail like the moments (``E[relu(z)^k]`` below as ``R_k``)."""
    tail = small_tail(mean, std, 4 if activation == RELU_SQUARED else 2)
    upper = mean >= 0
    t, _, _ = standardize(mean, std)
    cdf, pdf = standard_normal_cdf(t), standard_normal_pdf(t)
    var = std * std
    r1 = torch.where(upper, mean + tail[..., 1], tail[..., 1])
    if activation == LEAKY_RELU:  # g = relu(z) - slope relu(-z); g^2 = (1 - slope^2) relu(z)^2 + slope^2 z^2
        a = slope
        phi = (1.0 - a) * r1 + a * mean
        return (
            phi,
            a + (1.0 - a) * cdf,
            (1.0 - a) * pdf,
            2.0 * ((1.0 - a * a) * r1 + a * a * mean),
            2.0 * std * ((1.0 - a * a) * cdf + a * a),
        )
    # ReLU^2: g = relu(z)^2, g^2 = relu(z)^4
    r2 = torch.where(upper, mean * mean + var - tail[..., 2], tail[..., 2])
    r3 = torch.where(upper, mean * (mean * mean + 3.0 * var) + tail[..., 3], tail[..., 3])
    return r2, 2.0 * r1, 2.0 * std * cdf, 4.0 * r3, 12.0 * std * r2


def family_moments_vjp(mean, spread, phi, grad_phi, grad_ups, grad_var, activation, negative_slope, from_variance):
    """``cfbnn::relu_family_moments_backward``'s formula in torch ops, differentiable to any order (no
    autograd inside: it runs as a kernel, below autograd): ReLU's identities, the other members'
    :func:`_member_derivatives` (their ``Phi`` recomputed); from the variances ``phi`` is recomputed
    (the kernels do not read it) and ``d variance = d std / (2 std)`` (at the floor too: a value's
    floor, not a gradient's cut)."""
    std = std_from_variance(spread) if from_variance else spread
    if activation == RELU:
        if from_variance:
            phi = _relu_moments(mean, std, 0.0)[0]
        grad_mean, grad_std = _relu_vjp(mean, std, phi, grad_phi, grad_ups, grad_var)
    else:
        check_activation("relu_family_moments_backward", activation)
        slope = slope_for(negative_slope, mean.dtype)
        phi, phi_mean, phi_std, ups_mean, ups_std = _member_derivatives(mean, std, activation, slope)
        # Var = Upsilon - Phi^2
        by_phi, by_ups = grad_phi - 2.0 * phi * grad_var, grad_ups + grad_var
        grad_mean = by_phi * phi_mean + by_ups * ups_mean
        grad_std = by_phi * phi_std + by_ups * ups_std
    return grad_mean, (0.5 * grad_std / std) if from_variance else grad_std
