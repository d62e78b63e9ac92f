"""Monte Carlo baselines of the same objectives, vectorized over a leading sample dim.

Two ways to sample, as in the paper's experiments and the usual baselines:

* local reparameterization (Kingma et al. 2015): sample the pre-activations
  ``a_h^T x ~ N(gamma, xi^2)`` per data point, then the output ``B g`` given ``g`` from
  ``N(b_loc g, g^T Sigma_B g)`` -- the paper always samples this way;
* weight space: sample whole matrices ``A`` ``(S, H, D)`` and ``B`` ``(S, O, H)``.

Every function takes ``num_samples`` and an explicit ``torch.Generator`` and draws
all samples in one batched call (no Python loop over samples).
"""

from __future__ import annotations

import torch

from ..moments import get_activation
from .functional import (
    check_precision,
    covariance_kind,
    gaussian_log_likelihood,
    output_moments_given_hidden,
    output_rows,
    preactivation_moments,
    regression_ell_given_hidden,
)

__all__ = [
    "sample_hidden_local",
    "sample_outputs_local",
    "sample_weights",
    "sample_outputs_weight_space",
    "regression_ell_local_reparameterization",
    "regression_ell_weight_space",
    "regression_ell_sample_a",
]


def _normal(shape, like, generator):
    return torch.randn(shape, generator=generator, dtype=like.dtype, device=like.device)


def sample_hidden_local(x, a_loc, a_scale, activation, num_samples, generator=None):
    """``g(z)`` with ``z ~ N(gamma, xi^2)`` independently per (sample, n, h): ``(S, ..., N, H)``."""
    activation = get_activation(activation)
    gamma, xi = preactivation_moments(x, a_loc, a_scale)
    eps = _normal((num_samples,) + gamma.shape, gamma, generator)
    return activation(gamma + xi * eps)


def sample_outputs_local(x, a_loc, a_scale, b_loc, b_scale, activation, num_samples, generator=None):
    """Outputs ``B g(A x)`` by local reparameterization of both layers: ``(S, ..., N[, O])``."""
    hidden = sample_hidden_local(x, a_loc, a_scale, activation, num_samples, generator)
    mean, _, var_b = output_moments_given_hidden(hidden, torch.zeros_like(hidden), b_loc, b_scale)
    outputs = mean + var_b.clamp(min=0).sqrt() * _normal(mean.shape, mean, generator)
    return outputs.squeeze(-1) if b_loc.dim() == 1 else outputs


def sample_weights(a_loc, a_scale, b_loc, b_scale, num_samples, generator=None):
    """Weight-space samples ``A`` ``(S, H, D)`` and ``B`` ``(S, O, H)``."""
    kind = covariance_kind(a_scale, a_loc)
    eps = _normal((num_samples,) + a_loc.shape, a_loc, generator)
    if kind == "diagonal":
        A = a_loc + a_scale * eps
    elif kind == "full":
        A = a_loc + torch.einsum("hde,she->shd", a_scale, eps)
    else:
        rank = a_scale.factor.shape[-1]
        low = _normal((num_samples, a_loc.shape[0], rank), a_loc, generator)
        A = a_loc + a_scale.diag * eps + torch.einsum("hdr,shr->shd", a_scale.factor, low)
    _, loc, b_kind, scale = output_rows(b_loc, b_scale, a_loc.shape[0])
    eps_b = _normal((num_samples,) + loc.shape, loc, generator)
    B = loc + (torch.einsum("ohk,sok->soh", scale, eps_b) if b_kind == "full" else scale * eps_b)
    return A, B


def sample_outputs_weight_space(x, a_loc, a_scale, b_loc, b_scale, activation, num_samples, generator=None):
    """Outputs ``B g(A x)`` with whole weight matrices sampled: ``(S, N[, O])``."""
    activation = get_activation(activation)
    A, B = sample_weights(a_loc, a_scale, b_loc, b_scale, num_samples, generator)
    hidden = activation(torch.matmul(x, A.transpose(-1, -2)))  # (S, N, H)
    outputs = torch.matmul(hidden, B.transpose(-1, -2))  # (S, N, O)
    return outputs.squeeze(-1) if b_loc.dim() == 1 else outputs


def _per_sample_log_likelihood(y, outputs, precision):
    """``sum_n log N(y_n | outputs_sn, 1/beta)`` per sample: ``(S,)``."""
    return gaussian_log_likelihood(y, outputs, 0.0, check_precision(precision), data_dims=outputs.dim() - 1)


def regression_ell_local_reparameterization(
    x, y, a_loc, a_scale, b_loc, b_scale, precision, activation, num_samples, generator=None
):
    """Per-sample estimates ``(S,)`` of the ELL, all weights sampled by local reparameterization."""
    outputs = sample_outputs_local(x, a_loc, a_scale, b_loc, b_scale, activation, num_samples, generator)
    return _per_sample_log_likelihood(y, outputs, precision)


def regression_ell_weight_space(
    x, y, a_loc, a_scale, b_loc, b_scale, precision, activation, num_samples, generator=None
):
    """Per-sample estimates ``(S,)`` of the ELL with weight-space samples of A and B."""
    outputs = sample_outputs_weight_space(x, a_loc, a_scale, b_loc, b_scale, activation, num_samples, generator)
    return _per_sample_log_likelihood(y, outputs, precision)


def regression_ell_sample_a(x, y, a_loc, a_scale, b_loc, b_scale, precision, activation, num_samples, generator=None):
    """Per-sample estimates ``(S,)``: sample A's pre-activations, integrate B exactly."""
    hidden = sample_hidden_local(x, a_loc, a_scale, activation, num_samples, generator)
    return regression_ell_given_hidden(hidden, y, b_loc, b_scale, precision)
