"""The output layer integrated exactly and the Normal likelihood, eqs. (7)-(8), per data point:
from the hidden units' ``Phi`` and ``Var``, or for one output straight from the last hidden
layer's pre-activation means and variances (eqs. (7)-(9) in one C++ pass each way, ``tail_pass``
in moments/csrc/cfbnn_moments.cpp); and which activations' kernels take given tensors."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...moments import fast as fast_moments
from ...moments.gaussian import check_mean_std
from . import support


class _NormalELLGivenHidden(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(phi, variance, second_moment, loc, log_scale, y, log_precision, bias: bool):
        width = phi.shape[-1]
        weight_variance = torch.exp(2.0 * log_scale)
        loc_h, loc_b = support.columns(loc, width, bias)
        variance_h = weight_variance[:, :width]
        mean = support.affine(phi, loc_h, loc_b)
        # summed over the outputs o: sum_o (var_A + var_B) = Var h . sum_o loc_o^2 + E[h^2] . sum_o Var W_o
        # (E[h^2] = Var h + phi^2), two matrix-vector products and no pass over phi^2
        column_variance, column_loc2 = variance_h.sum(0), (loc_h * loc_h).sum(0)
        if second_moment is None:
            spread = variance @ (column_variance + column_loc2) + (phi * phi) @ column_variance
        else:
            spread = variance @ column_loc2 + second_moment @ column_variance
        residual = y - mean
        squares = (residual * residual).sum(-1) + spread  # (..., N)
        if bias:
            squares = squares + weight_variance[:, width].sum()
        precision = torch.exp(log_precision)
        outputs = loc.shape[0]
        ell = -0.5 * precision * squares + 0.5 * outputs * (log_precision - support.LOG_2PI)
        return ell, residual, squares, weight_variance

    @staticmethod
    def setup_context(ctx, inputs, output):
        phi, variance, second_moment, loc, log_scale, y, log_precision, bias = inputs
        _, residual, squares, weight_variance = output
        ctx.bias = bias
        ctx.given_second_moment = second_moment is not None
        ctx.mark_non_differentiable(residual, squares, weight_variance)
        ctx.save_for_backward(phi, variance, second_moment, loc, weight_variance, log_precision, residual, squares)

    @staticmethod
    @support.first_order_only  # written-out backward: a second order raises
    def backward(ctx, grad_ell, _grad_residual, _grad_squares, _grad_weight_variance):
        if grad_ell is None:  # the ELL itself unused (the classic form passes no zeros)
            return None, None, None, None, None, None, None, None
        phi, variance, second_moment, loc, weight_variance, log_precision, residual, squares = ctx.saved_tensors
        width, rows = phi.shape[-1], loc.shape[0]
        precision = torch.exp(log_precision)
        half = -0.5 * precision * grad_ell  # (..., N): d ELL_n / d (each squared term)
        grad_mean = (precision * grad_ell).unsqueeze(-1) * residual  # (..., N, O)
        loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
        column_variance, column_loc2 = variance_h.sum(0), (loc_h * loc_h).sum(0)
        column = half.unsqueeze(-1)
        grad_phi = grad_mean @ loc_h
        flat_half = half.reshape(-1)
        weighted_variance = flat_half @ variance.reshape(-1, width)  # sum_n c_n Var_n: (H,)
        if ctx.given_second_moment:  # the three moments' own gradients: outer products, one pass each
            grad_second = column * column_variance
            grad_variance = column * column_loc2
            weighted_second = flat_half @ second_moment.reshape(-1, width)
        else:
            grad_second = None
            grad_variance = column * (column_variance + column_loc2)
            grad_phi = torch.addcmul(grad_phi, column * column_variance, phi, value=2.0)
            weighted_second = weighted_variance + flat_half @ (phi * phi).reshape(-1, width)
        flat_mean = grad_mean.reshape(-1, rows)
        grad_loc = support.gradient_with_bias_column(
            support.flat_product(grad_mean, phi) + 2.0 * loc_h * weighted_variance, flat_mean.sum(0), ctx.bias
        )
        grad_weight_variance = support.gradient_with_bias_column(
            weighted_second.expand(rows, width), flat_half.sum().expand(rows), ctx.bias
        )
        grad_log_precision = (grad_ell * (-0.5 * precision * squares + 0.5 * rows)).sum()
        return (
            grad_phi,
            grad_variance,
            grad_second,
            grad_loc,
            2.0 * weight_variance * grad_weight_variance,
            None,
            grad_log_precision,
            None,
        )


_NormalELLGivenHiddenClassic = support.classic_twin(_NormalELLGivenHidden)


def normal_ell_given_hidden(
    phi: torch.Tensor,
    variance: torch.Tensor,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    y: torch.Tensor,
    log_precision: torch.Tensor,
    bias: bool = True,
    second_moment: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``E_q[log N(y_n | W [g, 1], 1/beta)]`` per data point ``(..., N)`` for hidden units of
    mean ``phi`` and variance ``variance`` (independent given x) and a diagonal q over the
    output layer ``W`` (``loc``/``log_scale`` ``(O, H[+1])``): eqs. (7)-(8), summed over the O
    outputs. ``y`` is ``(..., N, O)``. ``second_moment`` is ``E[h^2]`` (Upsilon, eq. (9))
    when the caller has it, as for :func:`propagated_preactivation`."""
    return support.apply(
        _NormalELLGivenHidden,
        _NormalELLGivenHiddenClassic,
        phi,
        variance,
        second_moment,
        loc,
        log_scale,
        y,
        log_precision,
        bias,
    )[0]


class NormalELLGivenPreactivation(torch.autograd.Function):
    """The last hidden layer's activation moments, the output layer integrated exactly and the
    Normal likelihood, for one output, through the kernel ``tail_pass`` (moments/fast.py):
    ``Phi``, ``Upsilon`` and ``Var`` of the (N, H) block are never written to memory, and the
    backward pass returns ``d/d gamma``, ``d/d xi`` and the output layer's column sums from one
    more pass. Plain CPU tensors only (no torch.func transforms): see :func:`normal_ell_given_preactivation`."""

    @staticmethod
    def forward(ctx, gamma, xi2, loc, log_scale, y, log_precision, bias: bool, op, prior_variance=None):
        width = gamma.shape[-1]
        flat_gamma, flat_xi = support.flat(gamma), support.flat(xi2)
        folded = support.folded_kl_forward(loc, log_scale, prior_variance)
        weight_variance, kl = folded if folded is not None else (torch.exp(2.0 * log_scale), support.placeholder(loc))
        weight_phi = loc[0, :width].contiguous()
        weight_loc2 = weight_phi * weight_phi
        weight_second = weight_variance[0, :width].contiguous()
        mean, spread = fast_moments.normal_tail(op, flat_gamma, flat_xi, weight_phi, weight_loc2, weight_second)
        # the precision and the bias as numbers, the rows in one kernel loop (seven small tensor
        # operations were most of this function's time)
        log_beta = float(log_precision)
        # as torch.exp would: +inf past the float64 range (an L-BFGS line search probes such steps,
        # and must see the -inf ELL the reference path gives, not an OverflowError)
        precision = math.exp(log_beta) if log_beta < support.LOG_MAX_DOUBLE else math.inf
        mean_bias, spread_bias = (float(loc[0, width]), float(weight_variance[0, width])) if bias else (0.0, 0.0)
        residual, squares, ell, ell_sum = fast_moments.normal_rows(
            mean, spread, y, mean_bias, spread_bias, precision, 0.5 * (log_beta - support.LOG_2PI)
        )
        ctx.bias, ctx.op, ctx.shape, ctx.precision = bias, op, gamma.shape, precision
        ctx.prior_variance = prior_variance if folded is not None else None
        ctx.ell_sum = ell_sum  # for the single-node ELBO (no pass over ELL to sum it)
        ctx.save_for_backward(
            flat_gamma, flat_xi, loc, weight_variance, weight_phi, weight_loc2, weight_second, residual, squares
        )
        return ell.reshape(gamma.shape[:-1]), kl

    @staticmethod
    @support.first_order_only  # written-out backward: a second order raises
    def backward(ctx, grad_ell, grad_kl):
        (flat_gamma, flat_xi, loc, weight_variance, weight_phi, weight_loc2, weight_second, residual, squares) = (
            ctx.saved_tensors
        )
        precision = ctx.precision
        grad_ell = grad_ell.reshape(-1).contiguous()
        row_mean_grad, row_spread_grad, sums = fast_moments.normal_row_gradients(grad_ell, residual, squares, precision)
        sum_u, sum_k, log_beta_grad = sums.tolist()
        grad_gamma, grad_xi, columns = fast_moments.normal_tail(
            ctx.op, flat_gamma, flat_xi, weight_phi, weight_loc2, weight_second, row_mean_grad, row_spread_grad
        )
        # d/d loc_c = sum_n u_n Phi_nc + 2 loc_c sum_n k_n Var_nc; d/d Var W_c = sum_n k_n Ups_nc;
        # the bias column's input is 1
        grad_loc, grad_variance = torch.empty_like(loc), torch.empty_like(weight_variance)
        fast_moments.normal_output_gradients(columns, weight_phi, ctx.bias, sum_u, sum_k, grad_loc, grad_variance)
        if ctx.prior_variance is not None:  # the output layer's KL folded in
            grad_loc, grad_log_scale = support.folded_kl_backward(
                loc, weight_variance, grad_loc, grad_variance, 2.0, ctx.prior_variance, grad_kl
            )
        else:
            grad_log_scale = grad_variance.mul_(weight_variance).mul_(2.0)
        grad_log_precision = None
        if ctx.needs_input_grad[5]:  # sum_n g_n (-beta/2 squares_n + 1/2)
            grad_log_precision = torch.scalar_tensor(log_beta_grad, dtype=loc.dtype)
        return (
            grad_gamma.reshape(ctx.shape),
            grad_xi.reshape(ctx.shape),
            grad_loc,
            grad_log_scale,
            None,
            grad_log_precision,
            None,
            None,
            None,
        )


def activation_kernels(activation):
    """The activation's kernel object (``None`` for one without kernels); whether they take
    given tensors is :func:`~cfbnn_cli.moments.fast.layer_kernels_apply`'s question."""
    return activation.cpu_kernels if hasattr(activation, "cpu_kernels") else None


def layer_kernel_op(activation, *tensors):
    """The activation's kernels when the layer kernels (the fused tail, the hidden layers'
    moments from variances) take these tensors, else ``None``: an activation without them
    (identity and the piecewise-polynomial engine), tensors that are not plain contiguous CPU
    float32/float64 of one dtype, torch.func transforms or the fast path switched off."""
    if support.transforms_active():
        return None
    op = activation_kernels(activation)
    return op if fast_moments.layer_kernels_apply(op, *tensors) else None


def normal_tail_op(activation, loc: torch.Tensor, *tensors):
    """:func:`layer_kernel_op` for :func:`normal_ell_given_preactivation` on a one-output layer
    ``loc`` (``None`` for more than one output: then take the other route)."""
    return layer_kernel_op(activation, loc, *tensors) if loc.shape[0] == 1 else None


def normal_ell_given_preactivation(gamma, xi2, op, loc, log_scale, y, log_precision, bias: bool = True) -> torch.Tensor:
    """``E_q[log N(y_n | W [g(a), 1], 1/beta)]`` per data point for last-hidden-layer
    pre-activations ``a ~ N(gamma, xi2)`` (independent units; ``xi2`` the variance) and a
    diagonal q over a one-output layer ``W`` (``loc``/``log_scale`` ``(1, H[+1])``):
    eqs. (7)-(9) in one fused kernel pass forward and one backward. What
    :func:`normal_ell_given_hidden` of ``activation.moments(gamma, sqrt(xi2))`` computes.
    ``op`` is :func:`normal_tail_op`'s answer (not ``None``)."""
    return normal_ell_given_preactivation_and_kl(gamma, xi2, op, loc, log_scale, y, log_precision, bias)[0]


def normal_ell_given_preactivation_and_kl(
    gamma: torch.Tensor,
    xi2: torch.Tensor,
    op,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    y: torch.Tensor,
    log_precision: torch.Tensor,
    bias: bool = True,
    prior_variance: Optional[float] = None,
):
    """``(ELL per point, KL)``: :func:`normal_ell_given_preactivation` with the output layer's
    ``KL(q || N(0, prior_variance I))`` from the same function (its gradient folded into the
    layer's); ``KL`` is ``None`` when no prior is given or the kernels do not take the layer."""
    check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the argument checks activation.moments makes (if on)
    gamma, xi2 = torch.broadcast_tensors(gamma, xi2)
    y = torch.broadcast_to(y, gamma.shape[:-1] + (1,)).contiguous()  # one target per row of gamma
    ell, kl = NormalELLGivenPreactivation.apply(
        gamma.contiguous(),
        xi2.contiguous(),
        loc,
        log_scale,
        y,
        log_precision,
        bias,
        op,
        None if prior_variance is None else float(prior_variance),
    )
    return ell, (kl if kl.numel() == 1 else None)
