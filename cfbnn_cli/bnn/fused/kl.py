"""``KL(N(loc, diag exp(2 log_scale)) || N(0, s^2 I))``, the KL terms of eq. (4), straight from
``log_scale`` (no ``log(exp(.))``), one kernel pass each way."""

from __future__ import annotations

import torch

from ...moments import fast as fast_moments
from . import support


class _DiagonalKL(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(loc, log_scale, prior_variance):
        count = loc.numel()
        sums = None if support.transforms_active() else fast_moments.diagonal_kl_sums(loc, log_scale)
        if sums is not None:  # one pass over the matrix (a wide layer's KL was ten passes over its 2M numbers)
            variance_sum, loc_square_sum, log_scale_sum = sums
            second_moment = prior_variance.new_tensor(variance_sum + loc_square_sum)
            if not prior_variance.requires_grad:  # a fixed prior: the rest is arithmetic on numbers
                return prior_variance.new_tensor(
                    fast_moments.kl_from_sums(*sums, count, float(prior_variance))
                ), second_moment
            log_scale_sum = prior_variance.new_tensor(log_scale_sum)
        else:
            second_moment = torch.exp(2.0 * log_scale).sum() + torch.dot(loc.reshape(-1), loc.reshape(-1))
            log_scale_sum = log_scale.sum()
        kl = 0.5 * (second_moment / prior_variance - count + count * torch.log(prior_variance)) - log_scale_sum
        return kl, second_moment

    @staticmethod
    def setup_context(ctx, inputs, output):
        loc, log_scale, prior_variance = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(loc, log_scale, prior_variance, output[1])

    @staticmethod
    @support.first_order_only  # written-out backward: a second order raises
    def backward(ctx, grad, _grad_second_moment):
        if grad is None:  # the KL itself unused (the classic form passes no zeros)
            return None, None, None
        loc, log_scale, prior_variance, second_moment = ctx.saved_tensors
        gradients = None
        if not support.transforms_active() and grad.device.type == "cpu":
            grad_value = float(grad)
            gradients = fast_moments.diagonal_kl_gradients(
                loc, log_scale, grad_value / float(prior_variance), grad_value
            )
        if gradients is not None:
            grad_loc, grad_log_scale = gradients
        else:
            grad_loc, grad_log_scale = fast_moments.kl_gradients(loc, log_scale, grad, prior_variance)
        grad_prior = None
        if ctx.needs_input_grad[2]:
            grad_prior = grad * 0.5 * (loc.numel() / prior_variance - second_moment / prior_variance**2)
        return grad_loc, grad_log_scale, grad_prior


_DiagonalKLClassic = support.classic_twin(_DiagonalKL)


def diagonal_kl(loc: torch.Tensor, log_scale: torch.Tensor, prior_variance) -> torch.Tensor:
    """``KL(N(loc, diag(exp(2 log_scale))) || N(0, prior_variance I))`` summed over the matrix."""
    if not isinstance(prior_variance, torch.Tensor):
        prior_variance = support.constant(float(prior_variance), loc.dtype, loc.device)
    return support.apply(_DiagonalKL, _DiagonalKLClassic, loc, log_scale, prior_variance)[0]
