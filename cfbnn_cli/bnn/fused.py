"""The closed form's hot path as four autograd functions with analytic backward passes.

Written as ordinary torch code, one closed-form ELBO step of a mean-field layer is some
130 small operations forward and backward (each exp, square, cat, sum and their
autograd nodes), and on a CPU their overhead, not the arithmetic, is most of the
step. Here the same mathematics is four functions whose backward passes are written
out, reusing what the forward computed:

* :func:`diagonal_preactivation` -- ``(gamma, xi)`` of ``W [h, 1]`` under a diagonal q,
  paper eq. (12), the bias column handled without building ``[h, 1]``;
* :func:`propagated_preactivation` -- the same when ``h`` is itself uncertain (mean and
  variance per unit, the ``deterministic`` estimator's moment propagation);
* :func:`diagonal_kl` -- ``KL(N(loc, diag exp(2 log_scale)) || N(0, s^2 I))``, the KL terms
  of eq. (4), straight from ``log_scale`` (no ``log(exp(.))``);
* :func:`normal_ell_given_hidden` -- the output layer integrated exactly and the Normal
  likelihood, eqs. (7)-(8), per data point, from the hidden units' ``Phi`` and ``Var``.

They compute what :mod:`.functional` computes (``tests/bnn/test_fused.py`` checks values
and gradients against it in float64, and ``torch.autograd.gradcheck``), and they
support ``torch.func.vmap`` / ``grad`` (``generate_vmap_rule``), which the gradient-
variance measurement uses.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from ..moments.gaussian import is_transformed

_LOG_2PI = math.log(2.0 * math.pi)


def _flat(tensor: torch.Tensor, last: int) -> torch.Tensor:
    return tensor.reshape(-1, last)


def _bias_column_and_sqrt(gamma, xi2, loc, weight_variance, width: int, bias: bool):
    """``(gamma, xi)``: the bias column's mean and variance added (its input is the constant 1),
    and the standard deviation kept off exact zero, where sqrt's slope is infinite."""
    if bias:
        gamma = gamma + loc[:, width]
        xi2 = xi2 + weight_variance[:, width]
    return gamma, xi2.clamp(min=torch.finfo(xi2.dtype).tiny).sqrt()


class _DiagonalPreactivation(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(h, loc, log_scale, bias: bool):
        variance = torch.exp(2.0 * log_scale)
        width = h.shape[-1]
        gamma = h @ loc[:, :width].mT
        xi2 = (h * h) @ variance[:, :width].mT
        return _bias_column_and_sqrt(gamma, xi2, loc, variance, width, bias)  # as functional does

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, loc, log_scale, bias = inputs
        _, xi = output
        ctx.bias = bias
        ctx.save_for_backward(h, loc, log_scale, xi)

    @staticmethod
    def backward(ctx, grad_gamma, grad_xi):
        h, loc, log_scale, xi = ctx.saved_tensors
        width = h.shape[-1]
        variance = torch.exp(2.0 * log_scale)  # recomputed: one pass, cheaper than a saved buffer's page faults
        # d sqrt(v) / dv = 1 / (2 sqrt v). No mask for the clamp's floor (a bool mask costs more than
        # the rest of this line on a CPU): xi >= sqrt(tiny) keeps it finite, and a variance under
        # float's tiny needs every scale below ~1e-19 (the bias column alone keeps v above its own)
        grad_xi2 = grad_xi / (2.0 * xi)
        rows = loc.shape[0]
        flat_gamma, flat_xi2, flat_h = _flat(grad_gamma, rows), _flat(grad_xi2, rows), _flat(h, width)
        if ctx.bias and not is_transformed(grad_gamma):  # write the bias column in place: no copy
            grad_loc, grad_variance = torch.empty_like(loc), torch.empty_like(variance)
            torch.mm(flat_gamma.mT, flat_h, out=grad_loc[:, :width])
            torch.mm(flat_xi2.mT, flat_h * flat_h, out=grad_variance[:, :width])
            torch.sum(flat_gamma, 0, out=grad_loc[:, width])
            torch.sum(flat_xi2, 0, out=grad_variance[:, width])
        else:  # out of place (torch.cat): under vmap the batched gradients cannot be written into
            grad_loc = flat_gamma.mT @ flat_h
            grad_variance = flat_xi2.mT @ (flat_h * flat_h)
            if ctx.bias:
                grad_loc = torch.cat([grad_loc, flat_gamma.sum(0).unsqueeze(-1)], -1)
                grad_variance = torch.cat([grad_variance, flat_xi2.sum(0).unsqueeze(-1)], -1)
        grad_h = None
        if ctx.needs_input_grad[0]:
            grad_h = grad_gamma @ loc[:, :width] + 2.0 * h * (grad_xi2 @ variance[:, :width])
        return grad_h, grad_loc, grad_variance.mul_(variance).mul_(2.0), None


def diagonal_preactivation(h: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor,
                           bias: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gamma, xi)`` of the pre-activations of ``[h, 1]`` (``bias``) or ``h`` under a
    mean-field q with means ``loc`` and standard deviations ``exp(log_scale)`` (eq. (12))."""
    return _DiagonalPreactivation.apply(h, loc, log_scale, bias)


class _PropagatedPreactivation(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(phi, variance, loc, log_scale, bias: bool):
        weight_variance = torch.exp(2.0 * log_scale)
        width = phi.shape[-1]
        loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
        gamma = phi @ loc_h.mT
        # Var = E[h^2]^T Var W + Var[h]^T loc^2, as one product over [E[h^2], Var h]
        second = torch.cat([phi * phi + variance, variance], -1)
        xi2 = second @ torch.cat([variance_h, loc_h * loc_h], -1).mT
        return _bias_column_and_sqrt(gamma, xi2, loc, weight_variance, width, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        phi, variance, loc, log_scale, bias = inputs
        ctx.bias = bias
        ctx.save_for_backward(phi, variance, loc, log_scale, output[1])

    @staticmethod
    def backward(ctx, grad_gamma, grad_xi):
        phi, variance, loc, log_scale, xi = ctx.saved_tensors
        width, rows = phi.shape[-1], loc.shape[0]
        weight_variance = torch.exp(2.0 * log_scale)
        loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
        grad_xi2 = grad_xi / (2.0 * xi)
        # [grad_xi2 @ Var W, grad_xi2 @ loc^2] in one product
        back = grad_xi2 @ torch.cat([variance_h, loc_h * loc_h], -1)
        through_variance, through_loc2 = back[..., :width], back[..., width:]
        grad_phi = grad_gamma @ loc_h + 2.0 * phi * through_variance
        grad_variance = through_variance + through_loc2
        flat_gamma, flat_xi2 = _flat(grad_gamma, rows), _flat(grad_xi2, rows)
        flat_phi, flat_variance = _flat(phi, width), _flat(variance, width)
        # [sum_n g_n E[h_n^2], sum_n g_n Var h_n] in one product
        weighted = flat_xi2.mT @ torch.cat([flat_phi * flat_phi + flat_variance, flat_variance], -1)
        grad_loc = flat_gamma.mT @ flat_phi + 2.0 * loc_h * weighted[:, width:]
        grad_weight_variance = weighted[:, :width]
        if ctx.bias:  # out of place (torch.cat): the backward must run under vmap too
            grad_loc = torch.cat([grad_loc, flat_gamma.sum(0).unsqueeze(-1)], -1)
            grad_weight_variance = torch.cat([grad_weight_variance, flat_xi2.sum(0).unsqueeze(-1)], -1)
        return grad_phi, grad_variance, grad_loc, 2.0 * weight_variance * grad_weight_variance, None


def propagated_preactivation(phi: torch.Tensor, variance: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor,
                             bias: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gamma, xi)`` of ``W [h, 1]`` under a mean-field q when the inputs ``h`` are uncertain
    too: independent, of means ``phi`` and variances ``variance`` (the deterministic estimator's
    diagonal propagation), ``xi^2 = E[h^2]^T Var W + Var[h]^T loc^2`` per row."""
    return _PropagatedPreactivation.apply(phi, variance, loc, log_scale, bias)


class _DiagonalKL(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(loc, log_scale, prior_variance):
        count = loc.numel()
        second_moment = torch.exp(2.0 * log_scale).sum() + torch.dot(loc.reshape(-1), loc.reshape(-1))
        return 0.5 * (second_moment / prior_variance - count + count * torch.log(prior_variance)
                      - 2.0 * log_scale.sum())

    @staticmethod
    def setup_context(ctx, inputs, output):
        loc, log_scale, prior_variance = inputs
        ctx.save_for_backward(loc, log_scale, prior_variance)

    @staticmethod
    def backward(ctx, grad):
        loc, log_scale, prior_variance = ctx.saved_tensors
        scaled = grad / prior_variance
        grad_loc = scaled * loc
        variance = torch.exp(2.0 * log_scale)
        grad_log_scale = scaled * variance - grad
        grad_prior = None
        if ctx.needs_input_grad[2]:
            second_moment = variance.sum() + torch.dot(loc.reshape(-1), loc.reshape(-1))
            grad_prior = grad * 0.5 * (loc.numel() / prior_variance - second_moment / prior_variance ** 2)
        return grad_loc, grad_log_scale, grad_prior


def diagonal_kl(loc: torch.Tensor, log_scale: torch.Tensor, prior_variance) -> torch.Tensor:
    """``KL(N(loc, diag(exp(2 log_scale))) || N(0, prior_variance I))`` summed over the matrix."""
    if not isinstance(prior_variance, torch.Tensor):
        prior_variance = torch.tensor(float(prior_variance), dtype=loc.dtype, device=loc.device)
    return _DiagonalKL.apply(loc, log_scale, prior_variance)


class _NormalELLGivenHidden(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(phi, variance, loc, log_scale, y, log_precision, bias: bool):
        width = phi.shape[-1]
        weight_variance = torch.exp(2.0 * log_scale)
        mean = phi @ loc[:, :width].mT
        var_a = variance @ (weight_variance[:, :width] + loc[:, :width] * loc[:, :width]).mT
        var_b = (phi * phi) @ weight_variance[:, :width].mT
        if bias:
            mean = mean + loc[:, width]
            var_b = var_b + weight_variance[:, width]
        residual = y - mean
        squares = (residual * residual + var_a + var_b).sum(-1)  # (..., N)
        precision = torch.exp(log_precision)
        outputs = loc.shape[0]
        ell = -0.5 * precision * squares + 0.5 * outputs * (log_precision - _LOG_2PI)
        return ell, residual, squares

    @staticmethod
    def setup_context(ctx, inputs, output):
        phi, variance, loc, log_scale, y, log_precision, bias = inputs
        _, residual, squares = output
        ctx.bias = bias
        ctx.mark_non_differentiable(residual, squares)
        ctx.save_for_backward(phi, variance, loc, log_scale, log_precision, residual, squares)

    @staticmethod
    def backward(ctx, grad_ell, _grad_residual, _grad_squares):
        phi, variance, loc, log_scale, log_precision, residual, squares = ctx.saved_tensors
        width, rows = phi.shape[-1], loc.shape[0]
        precision = torch.exp(log_precision)
        weight_variance = torch.exp(2.0 * log_scale)
        half = -0.5 * precision * grad_ell  # (..., N): d ELL_n / d (each squared term)
        grad_mean = (precision * grad_ell).unsqueeze(-1) * residual  # (..., N, O)
        loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
        column_b = variance_h.sum(0)  # (H,)
        grad_phi = grad_mean @ loc_h + 2.0 * half.unsqueeze(-1) * phi * column_b
        grad_variance = half.unsqueeze(-1) * (column_b + (loc_h * loc_h).sum(0))
        flat_half, flat_phi = half.reshape(-1), _flat(phi, width)
        weighted_variance = flat_half @ _flat(variance, width)  # sum_n c_n Var_n: (H,)
        weighted_phi2 = flat_half @ (flat_phi * flat_phi)
        flat_mean = _flat(grad_mean, rows)
        grad_loc = flat_mean.mT @ flat_phi + 2.0 * loc_h * weighted_variance
        grad_weight_variance = (weighted_variance + weighted_phi2).expand(rows, width)
        if ctx.bias:  # out of place (torch.cat): the backward must run under vmap too
            grad_loc = torch.cat([grad_loc, flat_mean.sum(0).unsqueeze(-1)], -1)
            grad_weight_variance = torch.cat([grad_weight_variance, flat_half.sum().expand(rows, 1)], -1)
        grad_log_precision = (grad_ell * (-0.5 * precision * squares + 0.5 * rows)).sum()
        return (grad_phi, grad_variance, grad_loc, 2.0 * weight_variance * grad_weight_variance, None,
                grad_log_precision, None)


def normal_ell_given_hidden(phi: torch.Tensor, variance: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor,
                            y: torch.Tensor, log_precision: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``E_q[log N(y_n | W [g, 1], 1/beta)]`` per data point ``(..., N)`` for hidden units of
    mean ``phi`` and variance ``variance`` (independent given x) and a diagonal q over the
    output layer ``W`` (``loc``/``log_scale`` ``(O, H[+1])``): eqs. (7)-(8), summed over the O
    outputs. ``y`` is ``(..., N, O)``."""
    return _NormalELLGivenHidden.apply(phi, variance, loc, log_scale, y, log_precision, bias)[0]
