"""ReLU's moments in torch ops (paper eq. (20) in the cancellation-free small-tail form): the
reference kernel of ``cfbnn::relu_family_moments`` and ``cfbnn::relu_mean`` for ReLU
(:mod:`.relu_family`), the oracle of their C++ and Triton kernels; and the small tail the family's
other members' formulas are written with."""

from __future__ import annotations

import math

import torch

from .gaussian import INV_SQRT_2, T_MAX, block_size, positive_part_moments


def small_tail(mean, std, order):
    """Moments of the Normal mass on the far side of 0 from the mean.

    Returns ``S_k = E[w^k 1{w>0}]`` for ``w ~ N(-|mean|, std^2)``: for ``mean >= 0``
    these are ``(-1)^k E[z^k 1{z<0}]``, for ``mean < 0`` they are ``E[z^k 1{z>0}]``.

    ``-|mean|`` is written with the branch the callers select (``mean >= 0``): at ``mean = 0``
    autograd then takes that branch's derivative, the true one (the moments are smooth there),
    where ``abs``'s would be 0 and leave, say, ReLU's ``dPhi/dmean`` at 1 instead of 1/2.
    """
    return positive_part_moments(order, torch.where(mean >= 0, -mean, mean), std)


_LOG_INV_SQRT_2PI = -0.5 * math.log(2.0 * math.pi)


def positive_part(mean):
    """``max(mean, 0)`` with the callers' branch (``mean >= 0``): at ``mean = 0`` its derivative is
    1, the branch whose small tail completes ``Phi`` (``clamp(min=0)``'s is 0 there, which left
    autograd's ``dPhi/dmean`` at -1/2 instead of 1/2)."""
    return torch.where(mean >= 0, mean, 0.0)


def relu_forward_block(mean: torch.Tensor, std: torch.Tensor):
    """(Phi, Upsilon, Var, Phi_N(t), Phi_N(-t), phi(t)) of relu for one block, in float64.

    With ``x = |mean|/std`` and the small tail ``s_k = E[w^k 1{w>0}] / std^k``,
    ``w ~ N(-|mean|, std^2)``: ``s_0 = Phi_N(-x)``, ``s_1 = phi(x) - x s_0``,
    ``s_2 = s_0 - x s_1``. Then (``mean >= 0``) ``Phi = mean + std s_1``,
    ``Var = std^2 (1 - s_2 - 2 x s_1 - s_1^2)`` (the bracket is >= 0.34), and
    (``mean < 0``) ``Phi = std s_1``, ``Var = std^2 (s_2 - s_1^2)`` (s_1^2 <= 0.32 s_2).

    The recursion for ``s_1, s_2`` loses about ``x^4/2`` ulps: harmless in float64
    for a float32 result (1e-10 at x = 40, beyond which everything underflows).
    Float64 arithmetic also keeps ``x`` and ``x^2/2`` exact enough: in float32 their
    rounding alone costs ``x^2 * 6e-8`` relative error in ``exp(-x^2/2)``.
    The last three outputs are what the backward pass needs (saved, not recomputed).
    The ops are fused and in place because this is the throughput path.
    """
    mean, std, x, s0, pdf, s1 = relu_small_tail(mean, std)
    s2 = torch.addcmul(s0, x, s1, value=-1.0)
    s1_sq = s1 * s1
    # the branch as a 0/1 factor: blending arithmetically is ~4x faster than torch.where on CPU
    upper = (mean >= 0).to(mean.dtype)
    phi = torch.addcmul(positive_part(mean), std, s1)
    # upper bracket 1 - s2 - 2 x s1 - s1^2, lower bracket s2 - s1^2: lower + upper * (1 - 2 s2 - 2 x s1)
    lower_bracket = s2 - s1_sq
    difference = torch.addcmul(s2.mul_(-2.0).add_(1.0), x, s1, value=-2.0)
    variance = (std * std).mul_(lower_bracket.addcmul_(upper, difference)).clamp_min_(0.0)
    upsilon = torch.addcmul(variance, phi, phi)
    # cdf = Phi_N(t): 1 - s0 above 0, s0 below; cdf_neg = 1 - cdf
    cdf = torch.addcmul(s0, upper, torch.rsub(s0, 1.0).sub_(s0))
    cdf_neg = torch.rsub(cdf, 1.0)
    # std == 0: the density factor is 0 (a point mass), except at mean == 0 where phi(0)
    # is the one-sided derivative of Phi = std phi(0).
    return phi, upsilon, variance, cdf, cdf_neg, pdf


def blockwise(block, mean, std):
    """``block(mean, std)`` (a tuple of float64 tensors shaped like the broadcast inputs), cast
    back to the inputs' dtype and run in :func:`~cfbnn_cli.moments.gaussian.block_size` pieces
    (the float64 temporaries of one piece stay in cache), the pieces concatenated (out of place: the
    formula is also differentiated under ``torch.func``)."""
    mean, std = torch.broadcast_tensors(mean, std)
    shape, dtype = mean.shape, mean.dtype
    chunk = block_size(mean)
    if mean.numel() <= chunk:
        return tuple(value.to(dtype) for value in block(mean, std))
    flat_mean, flat_std = mean.reshape(-1), std.reshape(-1)
    pieces = [
        block(flat_mean[start : start + chunk], flat_std[start : start + chunk])
        for start in range(0, flat_mean.numel(), chunk)
    ]
    return tuple(torch.cat([piece[k] for piece in pieces]).to(dtype).reshape(shape) for k in range(len(pieces[0])))


def relu_forward(mean, std):
    return blockwise(relu_forward_block, mean, std)


def relu_small_tail(mean, std):
    """``(mean, std, x, s_0, phi(x), s_1)`` in float64 for :func:`relu_forward_block` and
    :func:`relu_mean_block`: ``x = |mean|/std``, ``s_0 = Phi_N(-x)``, ``s_1 = phi(x) - x s_0``."""
    mean = mean.double()
    std = std.double()
    # out of place where torch.func has no in-place batching rule (clamp_, addcmul_); |mean| with
    # the callers' branch (mean >= 0), as in small_tail: autograd through it is then right at mean = 0
    magnitude = torch.where(mean >= 0, mean, -mean)
    x = magnitude.div_(std.clamp(min=torch.finfo(torch.float64).tiny)).clamp(max=T_MAX)
    s0 = torch.special.erfc(x * INV_SQRT_2).mul_(0.5)
    pdf = x.square().mul_(-0.5).add_(_LOG_INV_SQRT_2PI).exp_()
    return mean, std, x, s0, pdf, torch.addcmul(pdf, x, s0, value=-1.0)


def relu_mean_block(mean: torch.Tensor, std: torch.Tensor):
    """``(Phi,)`` of relu alone, in float64: ``Phi = max(mean, 0) + std s_1`` with the small
    tail ``s_1`` of :func:`relu_forward_block` (same arithmetic, 7 elementwise ops instead of 20)."""
    mean, std, _, _, _, s1 = relu_small_tail(mean, std)
    return (s1.mul_(std).add_(positive_part(mean)),)
