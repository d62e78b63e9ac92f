"""Cross-moments of a correlated Gaussian pair: what full-covariance moment propagation needs.

Deterministic VI with a full covariance across units (Wu et al. 2019, "DVI") carries the
covariance of a layer's activations ``Cov[g(u_i), g(u_j)]`` for ``(u_i, u_j)`` jointly
Normal. Which activations have it in closed form here:

* **ReLU** -- :func:`relu_cross_moment`, exact: with ``h_i = mu_i / sigma_i``, correlation
  ``rho``, ``s = sqrt(1 - rho^2)`` (the truncated bivariate Normal's moments, Rosenbaum 1961),

  ``E[relu(u_i) relu(u_j)] = (mu_i mu_j + S_ij) P + mu_i sigma_j B + mu_j sigma_i A
  + sigma_i sigma_j s phi(q) phi(h_j)``

  with ``P = Phi_2(h_i, h_j; rho)``, ``A = phi(h_i) Phi((h_j - rho h_i) / s)``,
  ``B = phi(h_j) Phi((h_i - rho h_j) / s)``, ``q = (h_i - rho h_j) / s``. ``Phi_2`` is
  Genz's algorithm (2004, "BVND", :func:`bivariate_normal_cdf`), double precision with
  6 to 20 Gauss-Legendre nodes by ``|rho|``. The backward pass is analytic (Price's theorem:
  ``dE/dS_ij = E[H(u_i) H(u_j)] = P``, ``dE/dmu_i = E[H(u_i) relu(u_j)]``,
  ``dE/dS_ii = E[delta(u_i) relu(u_j)] / 2``), so nothing of size ``pairs x nodes`` is kept.
* **leaky ReLU** and **identity** -- from ReLU's: ``leaky(u) = a u + (1 - a) relu(u)`` and
  ``Cov[u_i, relu(u_j)] = S_ij Phi(h_j)`` (Stein's lemma), in :func:`activation_covariance`.
* **not built**: ReLU² (needs the truncated pair's fourth moments), hard sigmoid
  (two shifted ReLUs: the same formula at shifted means, not wired up) and user-defined
  piecewise polynomials. :func:`activation_covariance` names them in its error.

Limits: ``rho = +-1`` (``s = 0``) and ``sigma -> 0`` give finite values and gradients (the
standardized means are clamped at +-40, where ``Phi`` and ``phi`` are exactly 1 and 0).
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch

from .gaussian import standard_normal_cdf, standard_normal_pdf

_T_MAX = 40.0  # |mean / sd| beyond which Phi and phi are exactly 1 and 0 in float64
_GENZ_HIGH_CORRELATION = 0.925  # Genz's switch to the expansion around |rho| = 1
# Genz's Gauss-Legendre orders by |rho| (double precision in each band): 6 below 0.3, 12 below
# 0.75, 20 beyond; on (-1, 1), weights summing to 2
_RULES = {count: np.polynomial.legendre.leggauss(count) for count in (6, 12, 20)}
_BANDS = ((0.3, 6), (0.75, 12), (_GENZ_HIGH_CORRELATION, 20))


def _nodes(like: torch.Tensor, count: int = 20):
    shape = (-1,) + (1,) * like.dim()
    nodes, weights = _RULES[count]
    nodes = torch.as_tensor(nodes, dtype=like.dtype, device=like.device).reshape(shape)
    weights = torch.as_tensor(weights, dtype=like.dtype, device=like.device).reshape(shape)
    return nodes, weights


def _upper_moderate(h, k, r, count: int):
    """``P(X > h, Y > k)``, ``|r| < 0.925``: Sheppard's integral over ``asin r`` (Genz's first branch)."""
    nodes, weights = _nodes(h, count)
    hk, hs, asr = h * k, 0.5 * (h * h + k * k), torch.asin(r)
    sn = torch.sin(asr * 0.5 * (nodes + 1.0))
    integral = (weights * torch.exp((sn * hk - hs) / (1.0 - sn * sn))).sum(0)
    return integral * asr / (4.0 * math.pi) + standard_normal_cdf(-h) * standard_normal_cdf(-k)


def _upper_high(h, k, r):
    """``P(X > h, Y > k)``, ``|r| >= 0.925``: Genz's expansion around ``|r| = 1`` (exact at it)."""
    nodes, weights = _nodes(h)
    k = torch.where(r < 0, -k, k)
    hk = h * k
    one_minus = (1.0 - r) * (1.0 + r)
    inside = one_minus > 0
    as_ = torch.where(inside, one_minus, torch.ones_like(one_minus))  # |r| = 1: the sum below is dropped
    a = as_.sqrt()
    bs = (h - k).square()
    c, d = (4.0 - hk) / 8.0, (12.0 - hk) / 16.0
    exponent = -(bs / as_ + hk) / 2.0
    total = torch.where(
        exponent > -100.0,
        a
        * torch.exp(exponent.clamp(min=-100.0))
        * (1.0 - c * (bs - as_) * (1.0 - d * bs / 5.0) / 3.0 + c * d * as_ * as_ / 5.0),
        torch.zeros_like(a),
    )
    b = bs.sqrt()
    tail = (
        torch.exp((-hk / 2.0).clamp(max=100.0))
        * math.sqrt(2.0 * math.pi)
        * standard_normal_cdf(-b / a)
        * b
        * (1.0 - c * bs * (1.0 - d * bs / 5.0) / 3.0)
    )
    total = total - torch.where(hk > -100.0, tail, torch.zeros_like(tail))
    half = a / 2.0
    xs = (half * (nodes + 1.0)).square()
    rs = (1.0 - xs).sqrt()
    exponent = -(bs / xs + hk) / 2.0
    sp = 1.0 + c * xs * (1.0 + d * xs)
    ep = torch.exp(-hk * (1.0 - rs) / (2.0 * (1.0 + rs))) / rs
    terms = torch.where(
        exponent > -100.0, half * weights * torch.exp(exponent.clamp(min=-100.0)) * (ep - sp), torch.zeros_like(xs)
    )
    total = torch.where(inside, -(total + terms.sum(0)) / (2.0 * math.pi), torch.zeros_like(total))
    positive = total + standard_normal_cdf(-torch.maximum(h, k))
    between = torch.where(
        h < 0, standard_normal_cdf(k) - standard_normal_cdf(h), standard_normal_cdf(-h) - standard_normal_cdf(-k)
    )
    negative = torch.where(h >= k, -total, between - total)
    return torch.where(r > 0, positive, negative)


def bivariate_normal_cdf(h: torch.Tensor, k: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``Phi_2(h, k; rho) = P(Z_1 <= h, Z_2 <= k)`` for standard Normals of correlation ``rho``
    (Genz 2004, BVND: 6-, 12- or 20-point Gauss-Legendre by ``|rho|``, its expansion for
    ``|rho| >= 0.925``; about 1e-15 absolute in float64). Not differentiable (the callers'
    backward passes use its closed-form partials); ``rho`` is clipped to [-1, 1]."""
    h, k, rho = torch.broadcast_tensors(h, k, rho)
    with torch.no_grad():
        h, k = -h.clamp(-_T_MAX, _T_MAX), -k.clamp(-_T_MAX, _T_MAX)  # P(Z1 <= h, Z2 <= k) = P(-Z1 > -h, -Z2 > -k)
        rho = rho.clamp(-1.0, 1.0)
        magnitude = rho.abs()
        high = magnitude >= _GENZ_HIGH_CORRELATION
        result = torch.empty_like(h)
        lower = 0.0
        for upper, count in _BANDS:  # each band on its own elements: no pair pays for more nodes than it needs
            band = (magnitude >= lower) & (magnitude < upper)
            lower = upper
            if band.any():
                result[band] = _upper_moderate(h[band], k[band], rho[band], count)
        if high.any():
            result[high] = _upper_high(h[high], k[high], rho[high])
        return result.clamp(0.0, 1.0)


def _pair_terms(mean_i, mean_j, sd_i, sd_j, cov_ij, P=None):
    """The standardized quantities of each pair: ``(h_i, h_j, rho, s, P, A, B, phi(q) phi(h_j))``
    (``P``, the costly one, is passed in when known)."""
    h_i = (mean_i / sd_i).clamp(-_T_MAX, _T_MAX)
    h_j = (mean_j / sd_j).clamp(-_T_MAX, _T_MAX)
    rho = (cov_ij / (sd_i * sd_j)).clamp(-1.0, 1.0)
    s = ((1.0 - rho) * (1.0 + rho)).clamp(min=0.0).sqrt()
    tiny = torch.finfo(s.dtype).tiny
    safe_s = s.clamp(min=tiny)
    # (h_j - rho h_i) / s: at s = 0 a zero numerator gives the limit 0 (Phi = 1/2), any other +-inf
    a_arg = (h_j - rho * h_i) / safe_s
    b_arg = (h_i - rho * h_j) / safe_s
    if P is None:
        P = bivariate_normal_cdf(h_i, h_j, rho)
    A = standard_normal_pdf(h_i) * standard_normal_cdf(a_arg)
    B = standard_normal_pdf(h_j) * standard_normal_cdf(b_arg)
    # exp(-(h_i^2 - 2 rho h_i h_j + h_j^2) / (2 s^2)) / (2 pi), written as phi(q) phi(h_j) so that
    # s -> 0 neither divides 0 by 0 nor overflows
    E = standard_normal_pdf(b_arg.clamp(-_T_MAX, _T_MAX)) * standard_normal_pdf(h_j)
    return h_i, h_j, rho, s, P, A, B, E


def relu_cross_moment_forward(mean_i, mean_j, sd_i, sd_j, cov_ij):
    """``(E[relu(u_i) relu(u_j)], Phi_2)`` of tensors of one shape: ``cfbnn::relu_cross_moment``'s
    reference kernel."""
    _, _, _, s, P, A, B, E = _pair_terms(mean_i, mean_j, sd_i, sd_j, cov_ij)
    value = (mean_i * mean_j + cov_ij) * P + mean_i * sd_j * B + mean_j * sd_i * A + sd_i * sd_j * s * E
    return value, P


def relu_cross_moment_vjp(mean_i, mean_j, sd_i, sd_j, cov_ij, P, grad):
    """Its gradients by Price's theorem with the natural parameters (means, covariance entries); the
    standard deviations enter through the variances: ``d/d sd = 2 sd d/d var``."""
    h_i, h_j, rho, s, P, A, B, E = _pair_terms(mean_i, mean_j, sd_i, sd_j, cov_ij, P)
    grad_mean_i = grad * (mean_j * P + sd_j * B + rho * sd_j * A)
    grad_mean_j = grad * (mean_i * P + sd_i * A + rho * sd_i * B)
    grad_cov = grad * P
    # d/d var_i = E[delta(u_i) relu(u_j)] / 2 = sd_j / (2 sd_i) ((h_j - rho h_i) A + s E); times 2 sd_i
    grad_sd_i = grad * sd_j * ((h_j - rho * h_i) * A + s * E)
    grad_sd_j = grad * sd_i * ((h_i - rho * h_j) * B + s * E)
    return grad_mean_i, grad_mean_j, grad_sd_i, grad_sd_j, grad_cov


def relu_cross_moment(mean_i, mean_j, sd_i, sd_j, cov_ij) -> torch.Tensor:
    """``E[relu(u_i) relu(u_j)]`` for ``(u_i, u_j)`` Normal with means ``mean_*``, standard
    deviations ``sd_*`` (> 0) and covariance ``cov_ij`` (broadcast elementwise); the formula
    is in the module doc. ``cov_ij`` is held fixed when the ``sd`` move (its own argument)."""
    return torch.ops.cfbnn.relu_cross_moment(*torch.broadcast_tensors(mean_i, mean_j, sd_i, sd_j, cov_ij))[0]


FULL_COVARIANCE_ACTIVATIONS = ("relu", "leaky_relu", "identity")


def activation_covariance(
    activation, mean: torch.Tensor, covariance: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(E[g(u)] (..., H), Cov[g(u)] (..., H, H))`` for ``u ~ N(mean, covariance)``.

    The diagonal and the means come from the activation's own exact univariate moments;
    the off-diagonal from :func:`relu_cross_moment` (ReLU, and leaky ReLU through it) or
    ``covariance`` itself (identity). Batched over every pair; no loop over units.
    """
    name = getattr(activation, "name", type(activation).__name__)
    if name not in FULL_COVARIANCE_ACTIVATIONS:
        raise ValueError(
            f"full-covariance propagation has closed-form cross-moments for {list(FULL_COVARIANCE_ACTIVATIONS)}; "
            f"got activation {name!r} (relu_squared, hard_sigmoid and user-defined pieces: use the diagonal "
            f"`deterministic` estimator)"
        )
    variance_diag = torch.diagonal(covariance, dim1=-2, dim2=-1)
    tiny = torch.finfo(mean.dtype).tiny
    sd = variance_diag.clamp(min=tiny).sqrt()
    phi, _, variance = activation.moments(mean, sd, return_variance=True)
    if name == "identity":  # g(u) = u: its covariance is the input's
        return phi, covariance
    width = mean.shape[-1]
    # each unordered pair once (the upper triangle), mirrored below: half the work of the square
    rows, cols = torch.triu_indices(width, width, offset=1, device=mean.device)
    cov_ij = covariance[..., rows, cols]
    if name == "relu":
        relu_mean = phi
    else:  # ReLU's own exact mean (finite at sd -> 0, where mean / sd is not)
        from .activations import get_activation

        relu_mean = get_activation("relu").mean(mean, sd)
    relu_cov = (
        relu_cross_moment(mean[..., rows], mean[..., cols], sd[..., rows], sd[..., cols], cov_ij)
        - relu_mean[..., rows] * relu_mean[..., cols]
    )
    if name == "relu":
        upper = relu_cov
    else:  # leaky(u) = a u + (1 - a) relu(u); Cov[u_i, relu(u_j)] = S_ij Phi(h_j) (Stein's lemma)
        slope = activation.negative_slope
        step = standard_normal_cdf((mean / sd).clamp(-_T_MAX, _T_MAX))
        mixed = cov_ij * (step[..., rows] + step[..., cols])
        upper = slope * slope * cov_ij + slope * (1.0 - slope) * mixed + (1.0 - slope) ** 2 * relu_cov
    off = torch.zeros_like(covariance)
    off[..., rows, cols] = upper
    return phi, off + off.transpose(-1, -2) + torch.diag_embed(variance)


__all__ = ["FULL_COVARIANCE_ACTIVATIONS", "activation_covariance", "bivariate_normal_cdf", "relu_cross_moment"]
