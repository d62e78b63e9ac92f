"""The last hidden layer's tail pass as torch operators: ``torch.ops.cfbnn.relu_tail*``.

``cfbnn::relu_tail(Tensor mean, Tensor variance, Tensor weight_phi, Tensor weight_variance, Tensor weight_second, int activation=0, float negative_slope=0.0) -> (Tensor mean_sum, Tensor spread_sum)``
    For pre-activation means and *variances* ``(rows, H)`` of the last hidden layer and three
    ``(H,)`` weight vectors, the two row sums that one integrated output needs (paper eqs.
    (7)-(9)): ``mean_sum_r = sum_c Phi_rc w_phi_c`` and ``spread_sum_r = sum_c Var_rc w_var_c +
    Upsilon_rc w_second_c``, with ``(Phi, Upsilon, Var)`` the moments of the ReLU family's
    ``activation`` (:data:`ACTIVATION_KINDS`: 0 ReLU, eq. (20); 1 leaky ReLU of slope
    ``negative_slope``, eqs. (21), (22); 2 ReLU^2, eqs. (28), (29)) --
    computed and reduced in one pass, never written to memory. For the output weights' mean
    ``m`` and variance ``v``: ``w_phi = m``, ``w_var = m^2``, ``w_second = v`` give the output's
    mean (less its bias) and its variance. The variance is floored at the dtype's smallest
    normal number, as ``cfbnn::relu_family_moments`` does ``from_variance``.
``cfbnn::relu_tail_backward(mean, variance, weight_phi, weight_variance, weight_second, grad_mean_sum, grad_spread_sum, int activation=0, float negative_slope=0.0) -> (grad_mean, grad_variance, columns)``
    its vector-Jacobian product: ``dL/d mean``, ``dL/d variance`` and ``columns`` ``(3, H)``,
    float64, the weights' gradients ``(sum_r u_r Phi_rc, sum_r k_r Var_rc, sum_r k_r Upsilon_rc)``.

Kernels: on the CPU the C++ ``tail_pass`` (registered by ``csrc/cfbnn_ops.cpp``),
elsewhere the Triton kernels of :mod:`.triton_tail_kernels` (one launch forward, one backward
and the column sums' addition); the reference torch ops where neither is at hand. Autograd
(differentiable torch ops where a graph of the backward is wanted), fake and vmap
registrations as for :mod:`.ops`.
"""

from typing import Tuple

import torch
from torch import Tensor

from . import elbo_reference
from .operator_registration import check_operands
from .ops import (
    ACTIVATION_KINDS,
    HAVE_TRITON,
    slope_operand,
    triton,
    triton_kernels,
    triton_tail_kernels,
    variance_floor,
)
from .relu_family import check_activation, family_moments_vjp

__all__ = [
    "ACTIVATION_KINDS",
    "relu_tail",
    "relu_tail_backward",
    "reference_relu_tail",
    "triton_relu_tail",
    "triton_relu_tail_backward",
    "reference_relu_tail_with_gradients",
    "triton_relu_tail_with_gradients",
]


def _check_tail(name: str, mean: Tensor, variance: Tensor, *weights: Tensor, activation: int = 0) -> None:
    check_activation(name, activation)
    check_operands(name, mean, variance)
    if mean.dim() != 2:
        raise ValueError(f"cfbnn::{name}: `mean` and `variance` must be (rows, H); got shape {tuple(mean.shape)}")
    for weight in weights:
        if weight.shape != mean.shape[1:] or weight.dtype != mean.dtype:
            raise ValueError(
                f"cfbnn::{name}: each weight must be ({mean.shape[1]},) of dtype {mean.dtype}; "
                f"got {tuple(weight.shape)} {weight.dtype}"
            )


# ----------------------------------------------------------------------------- reference (torch ops)


def _family_moments(mean, variance, activation: int, negative_slope: float):
    """``(Phi, Upsilon, Var)`` of ``activation`` from the pre-activations' variances through the
    family's operator, differentiable to any order."""
    return torch.ops.cfbnn.relu_family_moments(mean, variance, activation, float(negative_slope), True)


def reference_relu_tail(
    mean, variance, weight_phi, weight_variance, weight_second, activation: int = 0, negative_slope: float = 0.0
) -> Tuple[Tensor, Tensor]:
    """The two row sums from the activation's moments and torch ops (any leading batch
    dimensions; differentiable to any order)."""
    phi, ups, var = _family_moments(mean, variance, activation, negative_slope)
    return (phi * weight_phi).sum(-1), (var * weight_variance + ups * weight_second).sum(-1)


def _differentiable_tail_backward(
    mean, variance, weight_phi, weight_variance, weight_second, row_u, row_k, activation: int = 0, negative_slope=0.0
):
    """The vector-Jacobian product in differentiable ops (double backward, batched calls)."""
    u, k = row_u.unsqueeze(-1), row_k.unsqueeze(-1)
    grads = (u * weight_phi, k * weight_second, k * weight_variance)
    phi, ups, var = _family_moments(mean, variance, activation, negative_slope)
    grad_mean, grad_variance = family_moments_vjp(mean, variance, phi, *grads, activation, negative_slope, True)
    rows = tuple(range(mean.dim() - 2, mean.dim() - 1))  # the rows' dimension, batch dims kept
    columns = torch.stack([(u * phi).sum(rows), (k * var).sum(rows), (k * ups).sum(rows)], -2)
    return grad_mean, grad_variance, columns


# ----------------------------------------------------------------------------- Triton launches


def _tail_operands(mean, variance, weights, activation: int, negative_slope: float):
    """The Triton kernels' ``tail`` tuple (:mod:`.triton_tail_kernels`): the means, variances and
    three weights, contiguous, and the slope operand; with ``(rows, width)`` and the launch's
    constants ``(FLOOR, CF_DEPTH, ACTIVATION)``."""
    mean, variance = mean.contiguous(), variance.contiguous()
    tail = (mean, variance, *(w.contiguous() for w in weights), slope_operand(mean, activation, negative_slope))
    constants = (variance_floor(mean.dtype), triton_kernels.cf_depth(mean.dtype), activation)
    return tail, mean.shape, constants


def triton_relu_tail(
    mean, variance, weight_phi, weight_variance, weight_second, activation: int = 0, negative_slope: float = 0.0
) -> Tuple[Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    weights = (weight_phi, weight_variance, weight_second)
    tail, (rows, width), (floor, depth, kind) = _tail_operands(mean, variance, weights, activation, negative_slope)
    sums = (mean.new_empty(rows), mean.new_empty(rows))
    block_r, block_c = triton_tail_kernels.FORWARD_ROWS, triton_tail_kernels.FORWARD_COLUMNS
    unread = tail[0]  # the likelihood's operands and the gradients' outputs, which the forward alone skips
    triton_tail_kernels.relu_tail_kernel[(triton.cdiv(max(rows, 1), block_r),)](
        tail, sums, *(unread,) * 6, rows, width, 1.0, floor, block_r, block_c, depth, kind, False, False
    )
    return sums


def triton_relu_tail_backward(
    mean, variance, weight_phi, weight_variance, weight_second, row_u, row_k, activation: int = 0, negative_slope=0.0
):
    """The Triton vector-Jacobian product: one launch over ``(row block, column block)`` tiles,
    then the tiles' float64 column sums added over the row blocks."""
    weights = (weight_phi, weight_variance, weight_second)
    tail, (rows, width), (floor, depth, kind) = _tail_operands(mean, variance, weights, activation, negative_slope)
    block_r, block_c = triton_tail_kernels.BACKWARD_ROWS, triton_tail_kernels.BACKWARD_COLUMNS
    row_blocks = triton.cdiv(max(rows, 1), block_r)
    grad_mean, grad_variance = torch.empty_like(tail[0]), torch.empty_like(tail[0])
    # every entry is written: each tile stores its columns' three sums for its row block
    partial = torch.empty(row_blocks, 3, width, dtype=torch.float64, device=mean.device)
    triton_tail_kernels.relu_tail_backward_kernel[(row_blocks, triton.cdiv(max(width, 1), block_c))](
        tail, row_u.contiguous(), row_k.contiguous(), grad_mean, grad_variance, partial,
        rows, width, floor, block_r, block_c, depth, kind,
    )  # fmt: skip
    return grad_mean, grad_variance, partial.sum(0)


def _unit_row_gradients(mean_sum, y, loc, log_precision, scale: float, bias: bool):
    """The Normal likelihood's row gradients at ``dL/d ELBO = 1`` (``cfbnn::normal_rows_backward``'s
    ``u = scale tau residual``, ``k = -scale tau / 2``), the residual as ``cfbnn::normal_elbo_rows``
    takes it: ``y - mean_sum - b``, ``b`` the one-output layer's bias column of ``loc``."""
    residual = elbo_reference.residuals(mean_sum, y, loc, bias)
    unit = scale * torch.exp(log_precision.reshape(()))
    return unit * residual, (-0.5 * unit).expand_as(residual)


def reference_relu_tail_with_gradients(
    mean, variance, w_phi, w_var, w_second, y, loc, log_precision, scale, bias, activation=0, slope=0.0
):
    """``cfbnn::relu_tail_with_gradients`` in torch ops: :func:`reference_relu_tail`'s row sums and
    the vector-Jacobian product for the rows' gradients at ``dL/d ELBO = 1``."""
    weights = (w_phi, w_var, w_second)
    with torch.no_grad():
        mean_sum, spread_sum = reference_relu_tail(mean, variance, *weights, activation, slope)
        row_u, row_k = _unit_row_gradients(mean_sum, y, loc, log_precision, scale, bias)
        grads = _differentiable_tail_backward(mean, variance, *weights, row_u, row_k, activation, slope)
    return mean_sum, spread_sum, grads[0], grads[1], grads[2].double()


def triton_relu_tail_with_gradients(
    mean, variance, w_phi, w_var, w_second, y, loc, log_precision, scale, bias, activation=0, slope=0.0
):
    """The Triton kernel of ``cfbnn::relu_tail_with_gradients``: one launch (a program per block of
    rows), then the row blocks' float64 column sums added."""
    tail, (rows, width), (floor, depth, kind) = _tail_operands(
        mean, variance, (w_phi, w_var, w_second), activation, slope
    )
    block_r, block_c = triton_tail_kernels.FORWARD_ROWS, triton_tail_kernels.FORWARD_COLUMNS
    row_blocks = triton.cdiv(max(rows, 1), block_r)
    sums = (mean.new_empty(rows), mean.new_empty(rows))
    grad_mean, grad_variance = torch.empty_like(tail[0]), torch.empty_like(tail[0])
    partial = torch.empty(row_blocks, 3, width, dtype=torch.float64, device=mean.device)
    triton_tail_kernels.relu_tail_kernel[(row_blocks,)](
        tail, sums, y.contiguous(), loc.contiguous(), log_precision, grad_mean, grad_variance, partial,
        rows, width, float(scale), floor, block_r, block_c, depth, kind, bias, True,
    )  # fmt: skip
    return *sums, grad_mean, grad_variance, partial.sum(0)


# ----------------------------------------------------------------------------- the operators

_define = torch.library.custom_op


# the operands both operators' schemas share: the pre-activations' moments, the one-output layer's
# weights and the activation (the C++ and Triton kernels take them in this order)
_TAIL = "Tensor mean, Tensor variance, Tensor weight_phi, Tensor weight_variance, Tensor weight_second"
_FAMILY = "SymInt activation=0, float negative_slope=0."


def _reference_tail(mean, variance, weight_phi, weight_variance, weight_second, activation=0, negative_slope=0.0):
    # the default kernel (every device without its own: the C++ library registers the CPU's)
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail("relu_tail", mean, variance, *weights, activation=activation)
    return tuple(t.clone() for t in reference_relu_tail(mean, variance, *weights, activation, negative_slope))


def _reference_tail_backward(
    mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum, activation=0, slope=0.0
):
    tensors = (mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum)
    _check_tail_backward(*tensors, activation)
    with torch.no_grad():
        grads = _differentiable_tail_backward(*tensors, activation, slope)
    return grads[0], grads[1], grads[2].double()


def _check_tail_backward(mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum, activation=0):
    _check_tail("relu_tail_backward", mean, variance, w_phi, w_var, w_second, activation=activation)
    _check_rows("relu_tail_backward", mean, grad_mean_sum, grad_spread_sum)


def _check_rows(name: str, mean: Tensor, *row_grads: Tensor) -> None:
    for grad in row_grads:
        if grad.shape != mean.shape[:1] or grad.dtype != mean.dtype:
            raise ValueError(
                f"cfbnn::{name}: the row gradients must be ({mean.shape[0]},) of dtype {mean.dtype}; "
                f"got {tuple(grad.shape)} {grad.dtype}"
            )


relu_tail = _define(
    "cfbnn::relu_tail", _reference_tail, mutates_args=(), schema=f"({_TAIL}, {_FAMILY}) -> (Tensor, Tensor)"
)
relu_tail_backward = _define(
    "cfbnn::relu_tail_backward",
    _reference_tail_backward,
    mutates_args=(),
    schema=f"({_TAIL}, Tensor grad_mean_sum, Tensor grad_spread_sum, {_FAMILY}) -> (Tensor, Tensor, Tensor)",
)

if HAVE_TRITON:

    @relu_tail.register_kernel("cuda")
    def _relu_tail_cuda(mean, variance, weight_phi, weight_variance, weight_second, activation=0, negative_slope=0.0):
        weights = (weight_phi, weight_variance, weight_second)
        _check_tail("relu_tail", mean, variance, *weights, activation=activation)
        return triton_relu_tail(mean, variance, *weights, activation, negative_slope)

    @relu_tail_backward.register_kernel("cuda")
    def _relu_tail_backward_cuda(
        mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum, activation=0, slope=0.0
    ):
        rows = (grad_mean_sum, grad_spread_sum)
        _check_tail_backward(mean, variance, w_phi, w_var, w_second, *rows, activation)
        return triton_relu_tail_backward(mean, variance, w_phi, w_var, w_second, *rows, activation, slope)


@relu_tail.register_fake
def _(mean, variance, weight_phi, weight_variance, weight_second, activation=0, negative_slope=0.0):
    return mean.new_empty(mean.shape[:1]), mean.new_empty(mean.shape[:1])


@relu_tail_backward.register_fake
def _(
    mean, variance, weight_phi, weight_variance, weight_second, grad_mean_sum, grad_spread_sum, activation=0, slope=0.0
):
    columns = mean.new_empty((3, mean.shape[1]), dtype=torch.float64)
    return torch.empty_like(mean), torch.empty_like(mean), columns


def _tail_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.activation = inputs[5:]  # (activation, negative_slope)


def _tail_backward(ctx, grad_mean_sum, grad_spread_sum):
    mean, variance, *weights = ctx.saved_tensors
    grads = [g if g is not None else mean.new_zeros(mean.shape[:1]) for g in (grad_mean_sum, grad_spread_sum)]
    if torch.is_grad_enabled():  # a graph of the backward is wanted: differentiable ops
        grad_mean, grad_variance, columns = _differentiable_tail_backward(
            mean, variance, *weights, *grads, *ctx.activation
        )
    else:
        grad_mean, grad_variance, columns = relu_tail_backward(mean, variance, *weights, *grads, *ctx.activation)
    columns = columns.to(mean.dtype)
    return grad_mean, grad_variance, columns[0], columns[1], columns[2], None, None


relu_tail.register_autograd(_tail_backward, setup_context=_tail_setup_context)


def _batched(info, in_dims, *tensors):
    return [
        t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(info.batch_size, *t.shape)
        for t, d in zip(tensors, in_dims)
    ]


def _tail_vmap(
    info, in_dims, mean, variance, weight_phi, weight_variance, weight_second, activation=0, negative_slope=0.0
):
    if in_dims[2:5] == (None, None, None):  # shared weights: the batch's rows are rows of one call
        mean, variance = _batched(info, in_dims[:2], mean, variance)
        batch, rows, width = mean.shape
        sums = relu_tail(
            mean.reshape(-1, width),
            variance.reshape(-1, width),
            weight_phi,
            weight_variance,
            weight_second,
            activation,
            negative_slope,
        )
        return tuple(s.reshape(batch, rows) for s in sums), (0, 0)
    tensors = _batched(info, in_dims[:5], mean, variance, weight_phi, weight_variance, weight_second)
    weights = [w.unsqueeze(1) for w in tensors[2:]]
    return reference_relu_tail(*tensors[:2], *weights, activation, negative_slope), (0, 0)


def _tail_backward_vmap(info, in_dims, *arguments):
    tensors = _batched(info, in_dims[:7], *arguments[:7])
    weights = [w.unsqueeze(1) for w in tensors[2:5]]
    grad_mean, grad_variance, columns = _differentiable_tail_backward(
        *tensors[:2], *weights, *tensors[5:], *arguments[7:]
    )
    return (grad_mean, grad_variance, columns.double()), (0, 0, 0)


relu_tail.register_vmap(_tail_vmap)
relu_tail_backward.register_vmap(_tail_backward_vmap)
