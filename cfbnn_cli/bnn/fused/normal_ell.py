"""The output layer integrated exactly and the Normal likelihood, eqs. (7)-(8), per data point, from
the hidden units' ``Phi`` and ``Var`` (any activation, any number of outputs; the ReLU family's
one-output case from the pre-activations is the node ``cfbnn::normal_ell``, :mod:`.nodes`). Matrix
products and elementwise torch ops: autograd differentiates them."""

from __future__ import annotations

from typing import Optional

import torch

from . import support


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
    """``E_q[log N(y_n | W [g, 1], 1/beta)]`` per data point ``(..., N)`` for hidden units of mean
    ``phi`` and variance ``variance`` (independent given x) and a diagonal q over the output layer
    ``W`` (``loc``/``log_scale`` ``(O, H[+1])``), summed over the O outputs; ``y`` is ``(..., N, O)``.
    ``second_moment`` is ``E[h^2]`` (Upsilon, eq. (9)) where the caller has it."""
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
    outputs = loc.shape[0]
    return -0.5 * torch.exp(log_precision) * squares + 0.5 * outputs * (log_precision - support.LOG_2PI)
