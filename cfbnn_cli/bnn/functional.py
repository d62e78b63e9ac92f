"""Closed-form objectives of the one-hidden-layer BNN ``x -> A x -> g(Ax) -> B g(Ax)``.

Pure, batched, differentiable tensor functions (pyro/ops style); the modules in
:mod:`cfbnn_cli.bnn.network` calls them. Notation follows the paper's main text;
equation numbers are the arXiv version's (``docs/paper.md`` maps each one):

* ``x`` ``(..., N, D)``: inputs *already augmented* with a column of ones for the
  bias (paper footnote 2); any leading batch dims (e.g. a sample dimension when
  ``x`` are sampled activations of an earlier layer) broadcast through.
* ``a_loc`` ``(H, D)`` and ``a_scale``: the rows ``a_h ~ N(a_loc_h, Sigma_h)`` of A,
  independent across h. ``a_scale`` is one of

  - ``(H, D, D)`` lower-triangular Cholesky factors (``covariance: full``),
  - ``(H, D)`` standard deviations (``covariance: diagonal``, mean field),
  - :class:`LowRankScale` ``(diag (H, D), factor (H, D, r))`` with
    ``Sigma_h = diag(diag_h^2) + factor_h factor_h^T`` (``covariance: lowrank``).

* ``b_loc`` ``(H,)`` for one output, or ``(O, H)`` for O independent output rows;
  ``b_scale`` the Cholesky factor ``(H, H)`` / ``(O, H, H)`` or standard deviations
  ``(H,)`` / ``(O, H)``.
* ``activation``: a name (``"relu"``) or an activation from :mod:`cfbnn_cli.moments`.

With ``gamma_h = a_loc_h^T x``, ``xi_h^2 = x^T Sigma_h x``, ``Phi_h = E[g(a_h^T x)]`` and
``Var_h = Var[g(a_h^T x)]`` (eq. (9); computed directly, errata 9) the paper's
closed forms read, per output row o,

* predictive mean ``y_hat = b_loc . Phi`` (eq. (7)),
* ``var_A = diag(Xi_B) . Var`` with ``Xi_B = Sigma_B + b_loc^T b_loc`` (eq. (8), errata 5),
* ``var_B = Phi^T Sigma_B Phi`` (eq. (8) with the *full* Sigma_B: exact, since the hidden
  units are uncorrelated given x),
* ``E[(y - B g)^2] = (y - y_hat)^2 + var_A + var_B`` (eq. (7)).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Tuple, Union

import torch

from ..moments import get_activation, validating_args
from ..moments.relu_family import std_from_variance

__all__ = [
    "LowRankScale",
    "augment",
    "check_precision",
    "output_rows",
    "output_moments_given_hidden",
    "preactivation_moments",
    "diagonal_preactivation_moments",
    "hidden_moments",
    "predictive_moments",
    "regression_expected_log_likelihood",
    "regression_ell_given_hidden",
    "kl_normal_rows",
    "gaussian_log_likelihood",
]

_LOG_2PI = math.log(2.0 * math.pi)


def augment(x: torch.Tensor) -> torch.Tensor:
    """Append the bias column of ones (paper footnote 1: biases by augmented inputs)."""
    return torch.cat([x, torch.ones(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device)], dim=-1)


class LowRankScale(NamedTuple):
    """Scale of ``Sigma_h = diag(diag_h^2) + factor_h factor_h^T`` for each row h."""

    diag: torch.Tensor  # (H, D)
    factor: torch.Tensor  # (H, D, r)


AScale = Union[torch.Tensor, LowRankScale]


def covariance_kind(a_scale: AScale, a_loc: torch.Tensor) -> str:
    """``"full"``, ``"diagonal"`` or ``"lowrank"`` from the shape of ``a_scale``; ValueError otherwise."""
    H, D = a_loc.shape[-2:]
    if isinstance(a_scale, LowRankScale):
        if a_scale.diag.shape[-2:] != (H, D) or a_scale.factor.dim() < 3 or a_scale.factor.shape[-3:-1] != (H, D):
            raise ValueError(
                f"`a_scale` (LowRankScale) must have diag (H, D) = {(H, D)} and factor (H, D, r); "
                f"got diag {tuple(a_scale.diag.shape)}, factor {tuple(a_scale.factor.shape)}"
            )
        return "lowrank"
    if a_scale.shape[-3:] == (H, D, D) and a_scale.dim() >= 3:
        return "full"
    if a_scale.shape[-2:] == (H, D):
        return "diagonal"
    raise ValueError(
        f"`a_scale` must be (H, D, D) Cholesky factors, (H, D) standard deviations or a LowRankScale, "
        f"with a_loc of shape (H, D) = {(H, D)}; got {tuple(a_scale.shape)}"
    )


def _check_x(x: torch.Tensor, a_loc: torch.Tensor) -> None:
    if a_loc.dim() != 2:
        raise ValueError(f"`a_loc` must be (H, D); got shape {tuple(a_loc.shape)}")
    if x.dim() < 2 or x.shape[-1] != a_loc.shape[-1]:
        raise ValueError(
            f"`x` must be (..., N, D) with D = {a_loc.shape[-1]} (inputs augmented with the bias column, "
            f"matching a_loc); got shape {tuple(x.shape)}"
        )


def preactivation_moments(x: torch.Tensor, a_loc: torch.Tensor, a_scale: AScale) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gamma, xi)`` of the pre-activations ``a_h^T x``: each ``(..., N, H)`` (eq. (12)).

    ``gamma = x a_loc^T``; ``xi^2 = x^T Sigma_h x``, by batched matmuls: ``O(N H D)``
    for diagonal, ``O(N H D r)`` for low rank, ``O(N H D^2)`` for full covariance.
    """
    _check_x(x, a_loc)
    kind = covariance_kind(a_scale, a_loc)
    gamma = x @ a_loc.transpose(-1, -2)
    if kind == "diagonal":
        variance = (x * x) @ (a_scale * a_scale).transpose(-1, -2)
    elif kind == "lowrank":
        variance = (x * x) @ (a_scale.diag * a_scale.diag).transpose(-1, -2)
        projected = torch.einsum("...nd,hdr->...nhr", x, a_scale.factor)
        variance = variance + projected.square().sum(-1)
    else:
        # ||L_h^T x_n||^2 for every (n, h): (..., 1, N, D) @ (H, D, D) -> (..., H, N, D)
        projected = torch.matmul(x.unsqueeze(-3), a_scale)
        variance = projected.square().sum(-1).transpose(-1, -2)
    return gamma, std_from_variance(variance)


def diagonal_preactivation_moments(
    x: torch.Tensor, a_loc_and_variance: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`preactivation_moments` of a mean-field q given its means and elementwise
    variances stacked, ``a_loc_and_variance = stack([a_loc, a_scale**2])`` ``(2, H, D)``:
    ``gamma = x a_loc^T`` and ``xi^2 = x^2 (a_scale^2)^T`` (``a_h^T x ~ N(a_0^T x, x^T Sigma_a x)``,
    paper eqs. (11)-(12), with diagonal ``Sigma_a``).

    Both come from one batched product: for the few rows of a prediction batch, two
    small products leave most of a GPU idle. Prediction keeps the stacked weights
    (:meth:`~cfbnn_cli.bnn.network.GaussianMatrix.loc_and_variance`) across batches.
    """
    if a_loc_and_variance.dim() != 3 or a_loc_and_variance.shape[0] != 2:
        raise ValueError(
            f"`a_loc_and_variance` must be (2, H, D) (means, variances); got {tuple(a_loc_and_variance.shape)}"
        )
    _check_x(x, a_loc_and_variance[0])
    gamma, variance = (torch.stack([x, x * x], -3) @ a_loc_and_variance.transpose(-1, -2)).unbind(-3)
    return gamma, std_from_variance(variance)


def hidden_moments(x, a_loc, a_scale, activation) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(Phi, Var)`` of the hidden units ``g(a_h^T x)``: each ``(..., N, H)``."""
    activation = get_activation(activation)
    gamma, xi = preactivation_moments(x, a_loc, a_scale)
    phi, _, variance = activation.moments(gamma, xi, return_variance=True)
    return phi, variance


def output_rows(b_loc: torch.Tensor, b_scale: torch.Tensor, H: int):
    """``(single, loc (O, H), kind, scale)``: B with an explicit output dimension, ``kind``
    ``"full"`` or ``"diagonal"``; ValueError naming the argument for other shapes."""
    single = b_loc.dim() == 1
    loc = b_loc.unsqueeze(0) if single else b_loc
    if loc.dim() != 2 or loc.shape[-1] != H:
        raise ValueError(f"`b_loc` must be (H,) or (O, H) with H = {H}; got shape {tuple(b_loc.shape)}")
    scale = b_scale.unsqueeze(0) if single else b_scale
    O = loc.shape[0]
    if scale.shape == (O, H, H):
        kind = "full"
    elif scale.shape == (O, H):
        kind = "diagonal"
    else:
        expected = "(H, H) or (H,)" if single else "(O, H, H) or (O, H)"
        raise ValueError(f"`b_scale` must be {expected} for b_loc {tuple(b_loc.shape)}; got {tuple(b_scale.shape)}")
    return single, loc, kind, scale


def output_moments_given_hidden(phi, variance, b_loc, b_scale):
    """``(mean, var_A, var_B)`` of the outputs from hidden-unit moments, each ``(..., N, O)``.

    ``phi`` and ``variance`` are ``(..., N, H)``; with ``variance = 0`` and
    ``phi = g`` this is the exact expectation over B for fixed hidden activations g.
    """
    H = phi.shape[-1]
    _, loc, kind, scale = output_rows(b_loc, b_scale, H)
    mean = _times_rows(phi, loc)
    if kind == "full":
        b_var_diag = scale.square().sum(-1)  # diag(L L^T): (O, H)
        projected = torch.einsum("...nh,ohk->...nok", phi, scale)  # L_o^T phi
        var_b = projected.square().sum(-1)
    else:
        b_var_diag = scale * scale
        var_b = _times_rows(phi * phi, b_var_diag)
    xi_diag = b_var_diag + loc * loc  # diag(Sigma_B + B0^T B0), errata 5
    var_a = _times_rows(variance, xi_diag)
    return mean, var_a, var_b


def _times_rows(values, rows):
    """``values @ rows^T``: ``(..., N, H)`` by ``(O, H)`` rows, ``(..., N, O)``.

    For one row it is a product and a sum over H instead: a one-column matrix product is
    a matrix-vector call that the CPU's BLAS spreads over its threads, and on a shared
    2-core CPU each such call (three forward, more backward) waited milliseconds for a
    descheduled thread -- 92 ms against 17 ms per step of the README's Pyro example
    (benchmarks/bench_pyro.py).
    """
    if rows.shape[0] == 1:
        return (values * rows[0]).sum(-1, keepdim=True)
    return values @ rows.transpose(-1, -2)


def predictive_moments(x, a_loc, a_scale, b_loc, b_scale, activation):
    """Predictive ``(mean, variance from A, variance from B)`` without sampling.

    Paper remark 2, eq. (44): ``var(x) = diag(Xi_B).(Upsilon - Phi*Phi) + Phi^T Sigma_B Phi +
    1/beta``; the observation noise ``1/beta`` is left to the caller. Shapes
    ``(..., N)`` for ``b_loc (H,)`` and ``(..., N, O)`` for ``b_loc (O, H)``.
    """
    phi, variance = hidden_moments(x, a_loc, a_scale, activation)
    mean, var_a, var_b = output_moments_given_hidden(phi, variance, b_loc, b_scale)
    if b_loc.dim() == 1:
        return mean.squeeze(-1), var_a.squeeze(-1), var_b.squeeze(-1)
    return mean, var_a, var_b


def check_precision(precision):
    """beta as a tensor (a Python number becomes a float64 scalar, which keeps the
    dtype of whatever it multiplies); ValueError unless it is > 0 (a tensor is checked
    only while :func:`cfbnn_cli.moments.set_validate_args` is on: the check synchronizes)."""
    if not isinstance(precision, torch.Tensor):
        precision = torch.as_tensor(float(precision), dtype=torch.float64)
        if not precision > 0:
            raise ValueError(f"`precision` (the likelihood precision beta) must be > 0; got {precision.item()!r}")
    elif (
        validating_args() and precision.numel() == 1 and not torch._C._functorch.is_functorch_wrapped_tensor(precision)
    ):
        if not bool(precision.detach() > 0):
            raise ValueError(f"`precision` (the likelihood precision beta) must be > 0; got {precision.item()!r}")
    return precision


def gaussian_log_likelihood(y, mean, variance_terms, precision, data_dims: int = 1):
    """``sum -beta/2 [(y - mean)^2 + variance_terms] + 1/2 (log beta - log 2 pi)``.

    Summed over the last ``data_dims`` dimensions (N, or N and O); leading batch
    dims (e.g. samples of the layer's inputs) are kept.
    """
    squared = (y - mean).square() + variance_terms
    dims = tuple(range(squared.dim() - data_dims, squared.dim()))
    count = math.prod(squared.shape[squared.dim() - data_dims :])
    return -0.5 * precision * squared.sum(dims) + 0.5 * count * (torch.log(precision) - _LOG_2PI)


def _check_y(y, mean):
    if y.dim() == 0 or y.dim() > mean.dim() or y.shape != mean.shape[mean.dim() - y.dim() :]:
        raise ValueError(
            f"`y` must have shape {tuple(mean.shape)} (or its trailing dims) to match x and b_loc; got {tuple(y.shape)}"
        )


def regression_expected_log_likelihood(x, y, a_loc, a_scale_tril, b_loc, b_scale_tril, precision, activation):
    """Exact ``E_q(A) q(B)[sum_i log N(y_i | B g(A x_i), 1/beta)]`` (paper eq. (7)).

    Summed over the data (and outputs); leading batch dims of ``x`` are kept, so
    ``x`` of shape ``(S, N, D)`` (sampled inputs) gives ``(S,)`` values.
    ``y`` is ``(N,)`` for ``b_loc (H,)`` or ``(N, O)`` for ``b_loc (O, H)``;
    ``precision`` is beta (a positive scalar tensor, fixed or learned). Exact for
    full, diagonal or low-rank ``Sigma_h`` and a full or diagonal ``Sigma_B``.
    """
    precision = check_precision(precision)
    mean, var_a, var_b = predictive_moments(x, a_loc, a_scale_tril, b_loc, b_scale_tril, activation)
    _check_y(y, mean)
    return gaussian_log_likelihood(y, mean, var_a + var_b, precision, data_dims=1 if b_loc.dim() == 1 else 2)


def regression_ell_given_hidden(hidden, y, b_loc, b_scale, precision):
    """``E_q(B)[sum_n log N(y_n | B h_n, 1/beta)]`` for *given* hidden activations ``h`` ``(..., N, H)``.

    Returns one value per leading batch index (``(S,)`` for ``h`` of shape ``(S, N, H)``).

    The "sample A, integrate B" estimator: sample the pre-activations of A (local
    reparameterization), apply g, and pass the result here.
    """
    precision = check_precision(precision)
    mean, _, var_b = output_moments_given_hidden(hidden, torch.zeros_like(hidden), b_loc, b_scale)
    if b_loc.dim() == 1:
        mean, var_b = mean.squeeze(-1), var_b.squeeze(-1)
    _check_y(y, mean)
    return gaussian_log_likelihood(y, mean, var_b, precision, data_dims=1 if b_loc.dim() == 1 else 2)


def kl_normal_rows(loc: torch.Tensor, scale, prior_scale: float = 1.0) -> torch.Tensor:
    """``sum_h KL(N(loc_h, Sigma_h) || N(0, prior_scale^2 I))`` in closed form (the KL terms of eq. (4)).

    ``loc`` ``(R, D)``; ``scale`` as for ``a_scale`` (full Cholesky ``(R, D, D)``,
    standard deviations ``(R, D)`` or :class:`LowRankScale`). The low-rank log
    determinant uses the matrix determinant lemma.
    """
    if isinstance(prior_scale, torch.Tensor):
        prior_var = prior_scale * prior_scale
        if prior_scale.numel() == 1 and not bool(prior_scale.detach() > 0):
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale.item()!r}")
        log_prior_var = torch.log(prior_var)
    else:
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        prior_var = prior_scale * prior_scale
        log_prior_var = math.log(prior_var)
    D = loc.shape[-1]
    kind = covariance_kind(scale, loc)
    if kind == "diagonal":
        trace = scale.square().sum(-1)
        log_det = 2.0 * scale.log().sum(-1)
    elif kind == "full":
        trace = scale.square().sum((-1, -2))
        log_det = 2.0 * torch.diagonal(scale, dim1=-2, dim2=-1).log().sum(-1)
    else:
        diag_var = scale.diag.square()
        factor = scale.factor
        trace = diag_var.sum(-1) + factor.square().sum((-1, -2))
        # det(D + U U^T) = det(D) det(I + U^T D^-1 U)
        capacitance = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device) + torch.einsum(
            "hdr,hd,hds->hrs", factor, 1.0 / diag_var, factor
        )
        log_det = diag_var.log().sum(-1) + 2.0 * torch.linalg.cholesky(capacitance).diagonal(
            dim1=-2, dim2=-1
        ).log().sum(-1)
    kl = 0.5 * ((trace + loc.square().sum(-1)) / prior_var - D + D * log_prior_var - log_det)
    return kl.sum()
