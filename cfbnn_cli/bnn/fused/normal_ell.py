"""The output layer integrated exactly and the Normal likelihood, eqs. (7)-(8), per data point,
from the hidden units' ``Phi`` and ``Var`` (any activation, any number of outputs; the ReLU
family's one-output case from the pre-activations is :class:`.operator_elbo.NormalELL`)."""

from __future__ import annotations

from typing import Optional

import torch

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
