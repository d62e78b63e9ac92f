"""The last hidden layer's tail pass as torch operators: ``torch.ops.cfbnn.relu_tail*``.

``cfbnn::relu_tail(Tensor mean, Tensor variance, Tensor weight_phi, Tensor weight_variance, Tensor weight_second) -> (Tensor mean_sum, Tensor spread_sum)``
    For pre-activation means and *variances* ``(rows, H)`` of the last hidden layer and three
    ``(H,)`` weight vectors, the two row sums that one integrated output needs (paper eqs.
    (7)-(9)): ``mean_sum_r = sum_c Phi_rc w_phi_c`` and ``spread_sum_r = sum_c Var_rc w_var_c +
    Upsilon_rc w_second_c``, with ``(Phi, Upsilon, Var)`` the ReLU moments (eq. (20)) --
    computed and reduced in one pass, never written to memory. For the output weights' mean
    ``m`` and variance ``v``: ``w_phi = m``, ``w_var = m^2``, ``w_second = v`` give the output's
    mean (less its bias) and its variance. The variance is floored at the dtype's smallest
    normal number, as in ``cfbnn::relu_moments_from_variance``.
``cfbnn::relu_tail_backward(mean, variance, weight_phi, weight_variance, weight_second, grad_mean_sum, grad_spread_sum) -> (grad_mean, grad_variance, columns)``
    its vector-Jacobian product: ``dL/d mean``, ``dL/d variance`` and ``columns`` ``(3, H)``,
    float64, the weights' gradients ``(sum_r u_r Phi_rc, sum_r k_r Var_rc, sum_r k_r Upsilon_rc)``.

Kernels: on the CPU the C++ ``tail_pass`` (:func:`cfbnn_cli.moments.elbo_kernels.normal_tail`),
elsewhere the Triton kernels of :mod:`.triton_tail_kernels` (one launch forward, one backward
and the column sums' addition); the reference torch ops where neither is at hand. Autograd
(differentiable torch ops where a graph of the backward is wanted), fake and vmap
registrations as for :mod:`.ops`.
"""

from typing import Tuple

import torch
from torch import Tensor

from . import elbo_kernels, fast, kernel_handles
from .ops import (
    HAVE_TRITON,
    check_operands,
    differentiable_from_variance_backward,
    variance_floor,
)

if HAVE_TRITON:
    import triton

    from . import triton_kernels, triton_tail_kernels

__all__ = ["relu_tail", "relu_tail_backward", "reference_relu_tail", "triton_relu_tail", "triton_relu_tail_backward"]


def _check_tail(name: str, mean: Tensor, variance: Tensor, *weights: Tensor) -> None:
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


def reference_relu_tail(mean, variance, weight_phi, weight_variance, weight_second) -> Tuple[Tensor, Tensor]:
    """The two row sums from ``cfbnn::relu_moments_from_variance`` and torch ops (any leading batch
    dimensions; differentiable to any order)."""
    phi, ups, var = torch.ops.cfbnn.relu_moments_from_variance(mean, variance)
    return (phi * weight_phi).sum(-1), (var * weight_variance + ups * weight_second).sum(-1)


def _differentiable_tail_backward(mean, variance, weight_phi, weight_variance, weight_second, row_u, row_k):
    """The vector-Jacobian product in differentiable ops (double backward, batched calls)."""
    phi, ups, var = torch.ops.cfbnn.relu_moments_from_variance(mean, variance)
    u, k = row_u.unsqueeze(-1), row_k.unsqueeze(-1)
    grad_mean, grad_variance = differentiable_from_variance_backward(
        mean, variance, u * weight_phi, k * weight_second, k * weight_variance
    )
    rows = tuple(range(mean.dim() - 2, mean.dim() - 1))  # the rows' dimension, batch dims kept
    columns = torch.stack([(u * phi).sum(rows), (k * var).sum(rows), (k * ups).sum(rows)], -2)
    return grad_mean, grad_variance, columns


# ----------------------------------------------------------------------------- Triton launches


def triton_relu_tail(mean, variance, weight_phi, weight_variance, weight_second) -> Tuple[Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    mean, variance = mean.contiguous(), variance.contiguous()
    weights = [w.contiguous() for w in (weight_phi, weight_variance, weight_second)]
    rows, width = mean.shape
    mean_sum, spread_sum = mean.new_empty(rows), mean.new_empty(rows)
    block = triton_tail_kernels.FORWARD_ROWS
    triton_tail_kernels.relu_tail_kernel[(triton.cdiv(max(rows, 1), block),)](
        mean,
        variance,
        *weights,
        mean_sum,
        spread_sum,
        rows,
        width,
        variance_floor(mean.dtype),
        block,
        triton_tail_kernels.FORWARD_COLUMNS,
        triton_kernels.cf_depth(mean.dtype),
    )
    return mean_sum, spread_sum


def triton_relu_tail_backward(mean, variance, weight_phi, weight_variance, weight_second, row_u, row_k):
    """The Triton vector-Jacobian product: one launch over ``(row block, column block)`` tiles,
    then the tiles' float64 column sums added over the row blocks."""
    mean, variance, row_u, row_k = (t.contiguous() for t in (mean, variance, row_u, row_k))
    weights = [w.contiguous() for w in (weight_phi, weight_variance, weight_second)]
    rows, width = mean.shape
    block_r, block_c = triton_tail_kernels.BACKWARD_ROWS, triton_tail_kernels.BACKWARD_COLUMNS
    row_blocks = triton.cdiv(max(rows, 1), block_r)
    grad_mean, grad_variance = torch.empty_like(mean), torch.empty_like(mean)
    # every entry is written: each tile stores its columns' three sums for its row block
    partial = torch.empty(row_blocks, 3, width, dtype=torch.float64, device=mean.device)
    triton_tail_kernels.relu_tail_backward_kernel[(row_blocks, triton.cdiv(max(width, 1), block_c))](
        mean,
        variance,
        *weights,
        row_u,
        row_k,
        grad_mean,
        grad_variance,
        partial,
        rows,
        width,
        variance_floor(mean.dtype),
        block_r,
        block_c,
        triton_kernels.cf_depth(mean.dtype),
    )
    return grad_mean, grad_variance, partial.sum(0)


# ----------------------------------------------------------------------------- the operators

_define = torch.library.custom_op


@_define("cfbnn::relu_tail", mutates_args=())
def relu_tail(
    mean: Tensor, variance: Tensor, weight_phi: Tensor, weight_variance: Tensor, weight_second: Tensor
) -> Tuple[Tensor, Tensor]:
    _check_tail("relu_tail", mean, variance, weight_phi, weight_variance, weight_second)
    if not HAVE_TRITON:  # pragma: no cover - without Triton the device kernels are the reference ops
        return tuple(t.clone() for t in reference_relu_tail(mean, variance, weight_phi, weight_variance, weight_second))
    return triton_relu_tail(mean, variance, weight_phi, weight_variance, weight_second)


@_define("cfbnn::relu_tail_backward", mutates_args=())
def relu_tail_backward(
    mean: Tensor,
    variance: Tensor,
    weight_phi: Tensor,
    weight_variance: Tensor,
    weight_second: Tensor,
    grad_mean_sum: Tensor,
    grad_spread_sum: Tensor,
) -> Tuple[Tensor, Tensor, Tensor]:
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail("relu_tail_backward", mean, variance, *weights)
    _check_rows("relu_tail_backward", mean, grad_mean_sum, grad_spread_sum)
    if not HAVE_TRITON:  # pragma: no cover
        grads = _differentiable_tail_backward(mean, variance, *weights, grad_mean_sum, grad_spread_sum)
        return grads[0], grads[1], grads[2].double()
    return triton_relu_tail_backward(mean, variance, *weights, grad_mean_sum, grad_spread_sum)


def _check_rows(name: str, mean: Tensor, *row_grads: Tensor) -> None:
    for grad in row_grads:
        if grad.shape != mean.shape[:1] or grad.dtype != mean.dtype:
            raise ValueError(
                f"cfbnn::{name}: the row gradients must be ({mean.shape[0]},) of dtype {mean.dtype}; "
                f"got {tuple(grad.shape)} {grad.dtype}"
            )


@relu_tail.register_kernel("cpu")
def _relu_tail_cpu(mean, variance, weight_phi, weight_variance, weight_second):
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail("relu_tail", mean, variance, *weights)
    if fast.load_kernels() is None:  # no compiler: the reference ops (fresh tensors, as an op must return)
        return tuple(t.clone() for t in reference_relu_tail(mean, variance, *weights))
    contiguous = [t.contiguous() for t in (mean, variance, *weights)]
    return elbo_kernels.normal_tail(kernel_handles.ReLUOp(None), *contiguous)


@relu_tail_backward.register_kernel("cpu")
def _relu_tail_backward_cpu(mean, variance, weight_phi, weight_variance, weight_second, grad_mean_sum, grad_spread_sum):
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail("relu_tail_backward", mean, variance, *weights)
    _check_rows("relu_tail_backward", mean, grad_mean_sum, grad_spread_sum)
    if fast.load_kernels() is None:
        grads = _differentiable_tail_backward(mean, variance, *weights, grad_mean_sum, grad_spread_sum)
        return grads[0], grads[1], grads[2].double()
    contiguous = [t.contiguous() for t in (mean, variance, *weights, grad_mean_sum, grad_spread_sum)]
    return elbo_kernels.normal_tail(kernel_handles.ReLUOp(None), *contiguous)


@relu_tail.register_fake
def _(mean, variance, weight_phi, weight_variance, weight_second):
    return mean.new_empty(mean.shape[:1]), mean.new_empty(mean.shape[:1])


@relu_tail_backward.register_fake
def _(mean, variance, weight_phi, weight_variance, weight_second, grad_mean_sum, grad_spread_sum):
    columns = mean.new_empty((3, mean.shape[1]), dtype=torch.float64)
    return torch.empty_like(mean), torch.empty_like(mean), columns


def _tail_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _tail_backward(ctx, grad_mean_sum, grad_spread_sum):
    mean, variance, *weights = ctx.saved_tensors
    grads = [g if g is not None else mean.new_zeros(mean.shape[:1]) for g in (grad_mean_sum, grad_spread_sum)]
    if torch.is_grad_enabled():  # a graph of the backward is wanted: differentiable ops
        grad_mean, grad_variance, columns = _differentiable_tail_backward(mean, variance, *weights, *grads)
    else:
        grad_mean, grad_variance, columns = relu_tail_backward(mean, variance, *weights, *grads)
    columns = columns.to(mean.dtype)
    return grad_mean, grad_variance, columns[0], columns[1], columns[2]


relu_tail.register_autograd(_tail_backward, setup_context=_tail_setup_context)


def _batched(info, in_dims, *tensors):
    return [
        t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(info.batch_size, *t.shape)
        for t, d in zip(tensors, in_dims)
    ]


def _tail_vmap(info, in_dims, mean, variance, weight_phi, weight_variance, weight_second):
    if in_dims[2:] == (None, None, None):  # shared weights: the batch's rows are rows of one call
        mean, variance = _batched(info, in_dims[:2], mean, variance)
        batch, rows, width = mean.shape
        sums = relu_tail(
            mean.reshape(-1, width), variance.reshape(-1, width), weight_phi, weight_variance, weight_second
        )
        return tuple(s.reshape(batch, rows) for s in sums), (0, 0)
    tensors = _batched(info, in_dims, mean, variance, weight_phi, weight_variance, weight_second)
    weights = [w.unsqueeze(1) for w in tensors[2:]]
    return reference_relu_tail(*tensors[:2], *weights), (0, 0)


def _tail_backward_vmap(info, in_dims, *tensors):
    tensors = _batched(info, in_dims, *tensors)
    weights = [w.unsqueeze(1) for w in tensors[2:5]]
    grad_mean, grad_variance, columns = _differentiable_tail_backward(*tensors[:2], *weights, *tensors[5:])
    return (grad_mean, grad_variance, columns.double()), (0, 0, 0)


relu_tail.register_vmap(_tail_vmap)
relu_tail_backward.register_vmap(_tail_backward_vmap)
