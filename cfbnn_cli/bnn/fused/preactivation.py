"""A layer's pre-activation moments ``(gamma, xi)`` with analytic backward passes, the bodies of the
nodes ``cfbnn::diagonal_preactivation`` and ``cfbnn::propagated_preactivation`` (declared in
:mod:`.nodes`): from exact inputs under a diagonal q (paper eq. (12), the bias column without
building ``[h, 1]`` where the inputs are the wider), and from propagated inputs (mean and variance
per unit: the ``deterministic`` estimator's moment propagation); each with the layer's KL from the
same pass where a prior variance is given (``cfbnn::diagonal_kl_pass``; its gradient folded into the
layer's by ``cfbnn::finish_diagonal_gradients``).

Each ``forward(ctx, ...)`` runs with the autograd context (which it fills) or ``None`` (a call that
records no gradient); each ``backward`` returns one gradient per input."""

from __future__ import annotations

import torch

from . import support

_cfbnn = torch.ops.cfbnn


def _variance_and_kl(loc, log_scale, prior_variance):
    """``(exp(2 log_scale), KL or an empty tensor)``: the KL folded into the layer's pass where a
    prior variance is given."""
    if prior_variance is None:
        return log_scale.mul(2.0).exp_(), support.no_kl(loc)
    kl, variance, _ = _cfbnn.diagonal_kl_pass(loc, log_scale, float(prior_variance), False)
    return variance, kl


def diagonal_forward(ctx, h, loc, log_scale, bias: bool, variance_output: bool, prior_variance):
    """``(gamma, xi or xi^2, KL or empty)`` of ``W [h, 1]`` (``bias``) or ``W h`` under a mean-field q
    with means ``loc`` and standard deviations ``exp(log_scale)``."""
    variance, kl = _variance_and_kl(loc, log_scale, prior_variance)
    width = h.shape[-1]
    augmented = bias and width < loc.shape[0]
    if augmented:
        # the inputs narrower than the outputs: [h, 1] built once (one pass, with its square) is
        # cheaper than the bias broadcast into each (N, rows) result, and the products then give
        # the bias column's gradient too
        inputs, squared = _cfbnn.augment_pair(support.flat(h), True)
        inputs, squared = (t.reshape(*h.shape[:-1], width + 1) for t in (inputs, squared))
        gamma = support.affine(inputs, loc, None)
        xi2 = support.affine(squared, variance, None)
    else:
        inputs = h
        loc_h, loc_b = support.columns(loc, width, bias)
        variance_h, variance_b = support.columns(variance, width, bias)
        squared = h * h
        gamma = support.affine(h, loc_h, loc_b)
        xi2 = support.affine(squared, variance_h, variance_b)
    xi = xi2 if variance_output else support.sqrt_floored(xi2)
    if ctx is not None:
        ctx.bias, ctx.variance_output, ctx.augmented = bias, variance_output, augmented
        ctx.prior_variance = prior_variance
        # variance and h^2 are kept from the forward pass: on a wide first layer (D=2048, H=1000)
        # recomputing exp(2 log_scale) is two passes over 2M parameters
        ctx.save_for_backward(inputs, loc, None if variance_output else xi, variance, squared)
    return gamma, xi, kl


def diagonal_backward(ctx, grad_gamma, grad_xi, grad_kl):
    inputs, loc, xi, variance, squared = ctx.saved_tensors  # inputs: [h, 1] when augmented
    shape = (*inputs.shape[:-1], loc.shape[0])
    grad_gamma, grad_xi = (support.materialized(g, shape, inputs) for g in (grad_gamma, grad_xi))
    bias = ctx.bias and not ctx.augmented  # an augmented input carries the bias column itself
    h = inputs[..., :-1] if ctx.augmented else inputs
    width = h.shape[-1]
    # ``ratio`` = 2 dL/d xi^2, which is grad_xi / xi for the standard deviation (d xi / d xi^2 =
    # 1 / (2 xi)); the 2 cancels against d Var / d log_scale = 2 Var. No mask for the clamp's floor:
    # xi >= sqrt(tiny) keeps it finite
    ratio, scale = (grad_xi, 2.0) if ctx.variance_output else (grad_xi / xi, 1.0)
    grad_h = None
    if ctx.wants[0]:  # 2 h (grad_xi2 @ Var) = h (ratio @ Var)
        grad_h = torch.addcmul(grad_gamma @ loc[:, :width], h, ratio @ variance[:, :width], value=scale)
    grad_loc = support.weight_gradient(grad_gamma, inputs, bias)
    if ctx.prior_variance is not None:  # the KL's gradient folded in, one pass for both
        grad_log_scale = support.weight_gradient(ratio, squared, bias, 0.5 * scale)
        grad_loc, grad_log_scale = support.fold_kl_into_gradients(
            loc, variance, grad_loc, grad_log_scale, ctx.prior_variance, grad_kl
        )
    else:
        grad_log_scale = support.weight_gradient(ratio, squared, bias, scale).mul_(variance)
    return grad_h, grad_loc, grad_log_scale, None, None, None


def propagated_forward(
    ctx, phi, variance, second_moment, loc, log_scale, bias: bool, variance_output: bool, prior_variance
):
    """``(gamma, xi or xi^2, KL or empty)`` of ``W [h, 1]`` under a mean-field q when the inputs ``h``
    are uncertain too: independent, of means ``phi`` and variances ``variance``, ``xi^2 = E[h^2]^T
    Var W + Var[h]^T loc^2`` per row; ``second_moment`` is ``E[h^2]`` where the caller has it (the
    moments operators return it as Upsilon, eq. (9)), else ``phi^2 + variance`` is formed here."""
    weight_variance, kl = _variance_and_kl(loc, log_scale, prior_variance)
    width = phi.shape[-1]
    loc_h, loc_b = support.columns(loc, width, bias)
    variance_h, variance_b = support.columns(weight_variance, width, bias)
    second = torch.addcmul(variance, phi, phi) if second_moment is None else second_moment
    gamma = support.affine(phi, loc_h, loc_b)
    loc_square = loc_h * loc_h  # kept for the backward pass
    # Var = E[h^2]^T Var W + Var[h]^T loc^2: the second product accumulated into the first's buffer
    xi2 = support.affine(second, variance_h, variance_b)
    xi2 = xi2 + support.affine(variance, loc_square, None)
    xi = xi2 if variance_output else support.sqrt_floored(xi2)
    if ctx is not None:
        ctx.bias, ctx.variance_output, ctx.prior_variance = bias, variance_output, prior_variance
        ctx.given_second_moment = second_moment is not None
        ctx.save_for_backward(phi, variance, second, loc, weight_variance, None if variance_output else xi, loc_square)
    return gamma, xi, kl


def propagated_backward(ctx, grad_gamma, grad_xi, grad_kl):
    phi, variance, second, loc, weight_variance, xi, loc_square = ctx.saved_tensors
    width = variance.shape[-1]
    shape = (*phi.shape[:-1], loc.shape[0])
    grad_gamma, grad_xi = (support.materialized(g, shape, phi) for g in (grad_gamma, grad_xi))
    loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
    # as in the diagonal case, ratio = 2 grad_xi2 (grad_xi / xi for the standard deviation); the
    # halves go on the small weights (none for the variance form: its 2 and the half cancel)
    if ctx.variance_output:
        ratio, scale = grad_xi, 2.0
    else:
        ratio, scale = grad_xi / xi, 1.0
        variance_h, loc_square = 0.5 * variance_h, 0.5 * loc_square
    # d/d loc = grad_gamma^T phi + 2 loc (grad_xi2^T Var h) = ... + loc (ratio^T Var h)
    grad_loc_h = torch.addcmul(
        support.flat_product(grad_gamma, phi), loc_h, support.flat_product(ratio, variance), value=scale
    )
    grad_loc = support.gradient_with_bias_column(grad_loc_h, support.flat(grad_gamma).sum(0), ctx.bias)
    # d/d log_scale = 2 Var W (grad_xi2^T E[h^2]) = Var W (ratio^T E[h^2])
    if ctx.prior_variance is not None:  # the KL's gradient folded in, one pass for both
        grad_log_scale = support.weight_gradient(ratio, second, ctx.bias, 0.5 * scale)
        grad_loc, grad_log_scale = support.fold_kl_into_gradients(
            loc, weight_variance, grad_loc, grad_log_scale, ctx.prior_variance, grad_kl
        )
    else:
        grad_log_scale = support.weight_gradient(ratio, second, ctx.bias, scale).mul_(weight_variance)
    # the inputs' gradients last: the activation's backward kernel reads them next, still in cache
    grad_phi = grad_gamma @ loc_h
    grad_second = ratio @ variance_h
    grad_variance = ratio @ loc_square
    if not ctx.given_second_moment:  # E[h^2] = Var h + phi^2 was formed here
        grad_variance = grad_variance + grad_second
        grad_phi = torch.addcmul(grad_phi, phi, grad_second, value=2.0)
        grad_second = None
    return grad_phi, grad_variance, grad_second, grad_loc, grad_log_scale, None, None, None
