"""What the fused nodes' bodies share: flat views, affine products with a bias column, weight
gradients, the KL folded into a layer's pass. Written once for every caller: eager calls on plain
tensors and torch.func's batched ones (out-of-place where a batched value meets an unbatched buffer)."""

from __future__ import annotations

import math
from typing import Optional

import torch

LOG_2PI = math.log(2.0 * math.pi)
_cfbnn = torch.ops.cfbnn


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``(rows, last)``, every leading dimension folded into the rows (a 2-D tensor as
    is: ``reshape`` is a dispatch of its own, a few of them per layer and step)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def affine(inputs: torch.Tensor, weight: torch.Tensor, bias_column) -> torch.Tensor:
    """``inputs @ weight^T (+ bias_column)`` over any leading dimensions, the bias added by
    the matrix product itself (``addmm``: no separate pass over the result)."""
    rows = flat(inputs)
    out = rows @ weight.mT if bias_column is None else torch.addmm(bias_column, rows, weight.mT)
    return out if inputs.dim() == 2 else out.reshape(*inputs.shape[:-1], weight.shape[0])


def sqrt_floored(variance: torch.Tensor) -> torch.Tensor:
    """The standard deviation, kept off exact zero, where sqrt's slope is infinite (in place on the
    fresh ``variance``: it is never seen by anyone else)."""
    return variance.clamp_min_(torch.finfo(variance.dtype).tiny).sqrt_()  # (clamp_min_: vmap has its rule)


def columns(matrix: torch.Tensor, width: int, bias: bool):
    """``(matrix[:, :width], matrix[:, width] or None)``: the weights on ``h`` and on the bias's 1.

    The bias column is made contiguous (a copy of ``rows`` numbers): broadcast from its strided
    view, adding it to an (N, rows) result takes torch's slow path (4-6x the contiguous add)."""
    return matrix[:, :width], (matrix[:, width].contiguous() if bias else None)


def gradient_with_bias_column(main: torch.Tensor, bias_part, bias: bool) -> torch.Tensor:
    """``[main, bias_part]`` as one ``(rows, width + 1)`` gradient (just ``main`` without a bias)."""
    return torch.cat([main, bias_part.unsqueeze(-1)], -1) if bias else main


def flat_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``sum_n left_n^T right_n`` over every leading dimension: ``(A, B)`` from ``(..., A)``, ``(..., B)``."""
    return flat(left).mT @ flat(right)


def weight_gradient(left: torch.Tensor, right: torch.Tensor, bias: bool, scale: float = 1.0) -> torch.Tensor:
    """``scale [sum_n left_n^T right_n, sum_n left_n]``: a layer's ``(rows, width [+ 1])`` weight
    gradient from the output-side factor ``left`` and the inputs ``right``, the bias column's input
    being 1 (the scale rides on the product: ``alpha``)."""
    flat_left, flat_right = flat(left), flat(right)
    main = torch.addmm(flat_left.new_zeros(()), flat_left.mT, flat_right, beta=0.0, alpha=scale)
    if not bias:
        return main
    column = flat_left.sum(0)
    return gradient_with_bias_column(main, column if scale == 1.0 else scale * column, True)


def fold_kl_into_gradients(loc, variance, grad_loc, half_grad_variance, prior_variance: float, grad_kl):
    """The layer's gradients finished in place with its KL's folded in
    (``cfbnn::finish_diagonal_gradients``): ``half_grad_variance`` (``dL/d Var / 2``) becomes ``dL/d
    log_scale`` in one pass over the matrix, and no second pair of gradient buffers reaches autograd."""
    if grad_kl is None:  # the KL unused: its gradient is not read (kl_sign 0)
        grad_kl, sign = constant(0.0, loc.dtype, loc.device), 0.0
    else:
        sign = 1.0
    _cfbnn.finish_diagonal_gradients(grad_loc, half_grad_variance, loc, variance, grad_kl, sign, float(prior_variance))
    return grad_loc, half_grad_variance


def no_kl(like: torch.Tensor) -> torch.Tensor:
    """A layer node's KL output where no prior was given: an empty tensor."""
    return like.new_empty(0)


def materialized(grad: Optional[torch.Tensor], shape, like: torch.Tensor) -> torch.Tensor:
    """An output's gradient, zeros where nothing used it."""
    return like.new_zeros(shape) if grad is None else grad


CONSTANTS = {}


def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor of ``value``, made once per (value, dtype, device): a fixed prior's variance
    is the same number every step (a few of them; never written to)."""
    key = (value, dtype, device)
    tensor = CONSTANTS.get(key)
    if tensor is None:
        if len(CONSTANTS) > 64:
            CONSTANTS.clear()
        tensor = CONSTANTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return tensor
