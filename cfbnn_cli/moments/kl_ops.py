"""The KL of a mean-field weight matrix as torch operators (the KL terms of paper eq. (4)):

``cfbnn::diagonal_kl(Tensor loc, Tensor log_scale, float prior_variance) -> Tensor``
    ``KL(N(loc, diag exp(2 log_scale)) || N(0, prior_variance I))``, one pass over the matrix with
    float64 sums, straight from ``log_scale`` (no ``log(exp(.))``), and
``cfbnn::diagonal_kl_backward(loc, log_scale, grad, prior_variance) -> (grad_loc, grad_log_scale)``
    its gradients, one pass.

Kernels: C++ on the CPU (``csrc/cfbnn_ops.cpp``), Triton on CUDA, the reference torch formula
(:mod:`.elbo_reference`) elsewhere; autograd through the backward operator (differentiable torch
ops where a graph of the backward is wanted), and a batching rule for ``torch.func.vmap``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from . import elbo_reference
from .operator_registration import check_operands
from .ops import HAVE_TRITON, triton_kernels, triton_kl_kernels

__all__ = [
    "diagonal_kl",
    "diagonal_kl_backward",
    "launch_diagonal_kl",
    "triton_diagonal_kl",
    "triton_diagonal_kl_backward",
]


def _check_kl(name: str, loc: Tensor, log_scale: Tensor, prior_variance: float) -> None:
    check_operands(name, loc, log_scale)
    if not prior_variance > 0:
        raise ValueError(f"cfbnn::{name}: `prior_variance` must be > 0; got {prior_variance!r}")


def triton_diagonal_kl(loc: Tensor, log_scale: Tensor, prior_variance: float) -> Tensor:
    """The Triton forward: one launch for the blocks' float64 sums, then their sum in block order."""
    loc, log_scale = loc.contiguous(), log_scale.contiguous()
    kl = loc.new_empty(())
    launch_diagonal_kl(loc, log_scale, prior_variance, kl)
    return kl


def launch_diagonal_kl(
    loc: Tensor, log_scale: Tensor, prior_variance: float, out: Tensor, variance=None, loc_square=None
) -> None:
    """The KL of contiguous ``loc``, ``log_scale`` into the one-element ``out`` (two launches: the
    blocks' float64 sums, then their sum and the formula); ``variance`` and ``loc_square`` (like
    ``loc``), if given, receive ``exp(2 log_scale)`` and ``loc^2`` in the first pass."""
    n = loc.numel()
    blocks = triton_kernels.grid(n)[0]
    partial = torch.empty(blocks * 3, dtype=torch.float64, device=loc.device)
    triton_kl_kernels.diagonal_kl_sums_kernel[(blocks,)](
        loc,
        log_scale,
        partial,
        log_scale if variance is None else variance,
        loc if loc_square is None else loc_square,
        n,
        variance is not None,
        loc_square is not None,
        BLOCK=triton_kernels.BLOCK,
    )
    triton_kl_kernels.diagonal_kl_finish_kernel[(1,)](
        partial, out, blocks, float(n), float(prior_variance), math.log(prior_variance), BLOCK=256
    )


def triton_diagonal_kl_backward(loc: Tensor, log_scale: Tensor, grad: Tensor, prior_variance: float):
    """The Triton gradients of :func:`triton_diagonal_kl` for ``grad = dL/dKL`` (a 0-d tensor)."""
    loc, log_scale, grad = loc.contiguous(), log_scale.contiguous(), grad.reshape(1).contiguous()
    grad_loc, grad_log_scale = torch.empty_like(loc), torch.empty_like(loc)
    n = loc.numel()
    triton_kl_kernels.diagonal_kl_backward_kernel[triton_kernels.grid(n)](
        loc, log_scale, grad, grad_loc, grad_log_scale, n, float(prior_variance), BLOCK=triton_kernels.BLOCK
    )
    return grad_loc, grad_log_scale


@torch.library.custom_op("cfbnn::diagonal_kl", mutates_args=())
def diagonal_kl(loc: Tensor, log_scale: Tensor, prior_variance: float) -> Tensor:
    # the default kernel (every device without its own: the C++ library registers the CPU's)
    _check_kl("diagonal_kl", loc, log_scale, prior_variance)
    return elbo_reference.diagonal_kl(loc, log_scale, prior_variance)


@torch.library.custom_op("cfbnn::diagonal_kl_backward", mutates_args=())
def diagonal_kl_backward(loc: Tensor, log_scale: Tensor, grad: Tensor, prior_variance: float) -> Tuple[Tensor, Tensor]:
    _check_kl("diagonal_kl_backward", loc, log_scale, prior_variance)
    return elbo_reference.kl_gradients(loc, log_scale, grad, prior_variance)


if HAVE_TRITON:

    @diagonal_kl.register_kernel("cuda")
    def _diagonal_kl_cuda(loc: Tensor, log_scale: Tensor, prior_variance: float) -> Tensor:
        _check_kl("diagonal_kl", loc, log_scale, prior_variance)
        return triton_diagonal_kl(loc, log_scale, prior_variance)

    @diagonal_kl_backward.register_kernel("cuda")
    def _diagonal_kl_backward_cuda(loc, log_scale, grad, prior_variance) -> Tuple[Tensor, Tensor]:
        _check_kl("diagonal_kl_backward", loc, log_scale, prior_variance)
        return triton_diagonal_kl_backward(loc, log_scale, grad, prior_variance)


@diagonal_kl.register_fake
def _(loc, log_scale, prior_variance):
    return loc.new_empty(())


@diagonal_kl_backward.register_fake
def _(loc, log_scale, grad, prior_variance):
    return torch.empty_like(loc), torch.empty_like(loc)


def _kl_setup_context(ctx, inputs, output):
    loc, log_scale, prior_variance = inputs
    ctx.prior_variance = prior_variance
    ctx.save_for_backward(loc, log_scale)


def _kl_backward(ctx, grad):
    loc, log_scale = ctx.saved_tensors
    if torch.is_grad_enabled():  # a graph of the backward is wanted: differentiable ops
        return (*elbo_reference.kl_gradients(loc, log_scale, grad, ctx.prior_variance), None)
    return (*diagonal_kl_backward(loc, log_scale, grad, ctx.prior_variance), None)


diagonal_kl.register_autograd(_kl_backward, setup_context=_kl_setup_context)


def _batch_first(info, in_dims, *tensors):
    return [
        t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(info.batch_size, *t.shape)
        for t, d in zip(tensors, in_dims)
    ]


def _kl_vmap(info, in_dims, loc, log_scale, prior_variance):
    # one KL per batch entry, in batched torch ops (the same float64 sums)
    loc, log_scale = _batch_first(info, in_dims[:2], loc, log_scale)
    rows = [t.reshape(t.shape[0], -1).double() for t in (loc, log_scale)]
    sums = (torch.exp(2.0 * rows[1]).sum(1), rows[0].square().sum(1), rows[1].sum(1))
    kl = elbo_reference.kl_from_sums(sums[0] + sums[1], sums[2], rows[0].shape[1], prior_variance)
    return kl.to(loc.dtype), 0


def _kl_backward_vmap(info, in_dims, loc, log_scale, grad, prior_variance):
    loc, log_scale, grad = _batch_first(info, in_dims[:3], loc, log_scale, grad)
    grad = grad.reshape(grad.shape[0], *([1] * (loc.dim() - 1)))
    return elbo_reference.kl_gradients(loc, log_scale, grad, prior_variance), (0, 0)


diagonal_kl.register_vmap(_kl_vmap)
diagonal_kl_backward.register_vmap(_kl_backward_vmap)
