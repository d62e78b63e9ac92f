"""A layer's pre-activation moments ``(gamma, xi)`` as autograd functions with analytic backward
passes: from exact inputs under a diagonal q (paper eq. (12), the bias column without building
``[h, 1]``), and from propagated inputs (mean and variance per unit: the ``deterministic``
estimator's moment propagation); each optionally with the layer's KL from the same pass."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...moments import ops
from . import support


class DiagonalPreactivation(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(h, loc, log_scale, bias: bool, variance_output: bool, prior_variance: Optional[float] = None):
        folded = support.folded_kl_forward(loc, log_scale, prior_variance)
        if folded is not None:
            variance, kl = folded
        else:
            variance = log_scale.mul(2.0).exp_() if not support.transforms_active() else torch.exp(2.0 * log_scale)
            kl = support.placeholder(loc)
        width = h.shape[-1]
        if bias and width < loc.shape[0] and not support.transforms_active():
            # the inputs narrower than the outputs: [h, 1] built once is cheaper than the bias
            # broadcast into each (N, rows) result, and the products then give the bias column's
            # gradient too (no sums, no slices)
            if ops.operator_route(h):  # [h, 1] and [h^2, 1] in one pass
                augmented, squared = torch.ops.cfbnn.augment_pair(h.reshape(-1, width), True)
                augmented, squared = (t.reshape(*h.shape[:-1], width + 1) for t in (augmented, squared))
            else:
                augmented = torch.nn.functional.pad(h, (0, 1), value=1.0)
                squared = augmented * augmented
            gamma = support.affine(augmented, loc, None)
            xi2 = support.affine(squared, variance, None)
        else:
            augmented = support.placeholder(h)
            loc_h, loc_b = support.columns(loc, width, bias)
            variance_h, variance_b = support.columns(variance, width, bias)
            squared = h * h
            gamma = support.affine(h, loc_h, loc_b)
            xi2 = support.affine(squared, variance_h, variance_b)
        return gamma, (xi2 if variance_output else support.sqrt_floored(xi2)), variance, squared, kl, augmented

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, loc, log_scale, bias, variance_output, *prior = inputs
        _, xi, variance, squared, kl, augmented = output
        ctx.bias, ctx.variance_output = bias, variance_output
        ctx.augmented = augmented.numel() > 0  # then ``h`` below is [h, 1] and ``squared`` [h^2, 1]
        ctx.prior_variance = prior[0] if prior and kl.numel() == 1 else None  # None: no KL folded in
        ctx.mark_non_differentiable(variance, squared, augmented)
        # variance and h^2 are kept from the forward pass: on a wide first layer (D=2048,
        # H=1000) recomputing exp(2 log_scale) is two passes over 2M parameters
        ctx.save_for_backward(
            augmented if ctx.augmented else h, loc, None if variance_output else xi, variance, squared
        )

    @staticmethod
    @support.first_order_only  # written-out backward: a second order raises
    def backward(ctx, grad_gamma, grad_xi, _grad_variance, _grad_squared, grad_kl=None, _grad_augmented=None):
        inputs, loc, xi, variance, squared = ctx.saved_tensors  # inputs: [h, 1] when augmented
        grad_gamma, grad_xi = support.gradient_pair(
            grad_gamma, grad_xi, lambda: inputs.new_zeros(*inputs.shape[:-1], loc.shape[0])
        )
        bias = ctx.bias and not ctx.augmented  # an augmented input carries the bias column itself
        h = inputs[..., :-1] if ctx.augmented else inputs
        width = h.shape[-1]
        # ``ratio`` = 2 dL/d xi^2, which is grad_xi / xi for the standard deviation (d xi / d xi^2
        # = 1 / (2 xi)); the 2 cancels against d Var / d log_scale = 2 Var. No mask for the clamp's
        # floor: xi >= sqrt(tiny) keeps it finite, and a variance under float's tiny needs every
        # scale below ~1e-19 (the bias column alone keeps it above its own)
        if ctx.variance_output:  # grad_xi is dL/d xi^2: its 2 rides on the products
            ratio, scale = grad_xi, 2.0
        else:
            ratio, scale = grad_xi / xi, 1.0
        grad_h = None
        if ctx.needs_input_grad[0]:  # 2 h (grad_xi2 @ Var) = h (ratio @ Var)
            grad_h = torch.addcmul(grad_gamma @ loc[:, :width], h, ratio @ variance[:, :width], value=scale)
        grad_loc = support.weight_gradient(grad_gamma, inputs, bias)
        if ctx.prior_variance is not None:  # the KL's gradient folded in, one pass for both
            grad_log_scale = support.weight_gradient(ratio, squared, bias, 0.5 * scale)
            grad_loc, grad_log_scale = support.folded_kl_backward(
                loc, variance, grad_loc, grad_log_scale, ctx.prior_variance, grad_kl
            )
            return grad_h, grad_loc, grad_log_scale, None, None, None
        grad_log_scale = support.weight_gradient(ratio, squared, bias, scale)
        grad_log_scale = grad_log_scale * variance if support.transforms_active() else grad_log_scale.mul_(variance)
        return grad_h, grad_loc, grad_log_scale, None, None, None


_DiagonalPreactivationClassic = support.classic_twin(DiagonalPreactivation)


def diagonal_preactivation(
    h: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor, bias: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gamma, xi)`` of the pre-activations of ``[h, 1]`` (``bias``) or ``h`` under a
    mean-field q with means ``loc`` and standard deviations ``exp(log_scale)`` (eq. (12))."""
    return support.apply(DiagonalPreactivation, _DiagonalPreactivationClassic, h, loc, log_scale, bias, False)[:2]


def diagonal_preactivation_variance(
    h: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor, bias: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`diagonal_preactivation` with the variance ``xi^2`` in place of ``xi`` (for
    :func:`normal_ell_given_preactivation`, which takes the square root in its own pass)."""
    return support.apply(DiagonalPreactivation, _DiagonalPreactivationClassic, h, loc, log_scale, bias, True)[:2]


def diagonal_preactivation_and_kl(
    h: torch.Tensor,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    bias: bool,
    variance_output: bool,
    prior_variance: float,
):
    """``(gamma, xi or xi^2, KL)``: :func:`diagonal_preactivation` (``variance_output``: its
    variance form) with the layer's ``KL(q || N(0, prior_variance I))`` from the same function,
    its gradient folded into the layer's in one pass over the matrix. ``KL`` is ``None`` where
    that does not apply (torch.func transforms, tensors the kernels do not take): then take
    :func:`diagonal_kl` as usual."""
    return support.with_folded_kl(
        support.apply(
            DiagonalPreactivation,
            _DiagonalPreactivationClassic,
            h,
            loc,
            log_scale,
            bias,
            variance_output,
            float(prior_variance),
        )
    )


class PropagatedPreactivation(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        phi,
        variance,
        second_moment,
        loc,
        log_scale,
        bias: bool,
        variance_output: bool,
        prior_variance: Optional[float] = None,
    ):
        folded = support.folded_kl_forward(loc, log_scale, prior_variance)
        weight_variance, kl = folded if folded is not None else (torch.exp(2.0 * log_scale), support.placeholder(loc))
        width = phi.shape[-1]
        loc_h, loc_b = support.columns(loc, width, bias)
        variance_h, variance_b = support.columns(weight_variance, width, bias)
        formed = None
        if second_moment is None:  # E[h^2] = Var h + phi^2
            second_moment = formed = torch.addcmul(variance, phi, phi)
        gamma = support.affine(phi, loc_h, loc_b)
        # Var = E[h^2]^T Var W + Var[h]^T loc^2: two products summed into one buffer
        xi2 = support.affine(second_moment, variance_h, variance_b)
        loc_square = loc_h * loc_h  # kept for the backward pass
        if support.transforms_active():
            xi2 = xi2 + support.affine(variance, loc_square, None)
        else:  # the second product accumulated into the first's buffer (no third (N, H) array)
            flat = support.flat(xi2)
            flat.addmm_(support.flat(variance), loc_square.mT)
        # E[h^2] is an output only when formed here (an input returned as is cannot be saved)
        formed = formed if formed is not None else phi.new_empty(0)
        return gamma, (xi2 if variance_output else support.sqrt_floored(xi2)), weight_variance, formed, kl, loc_square

    @staticmethod
    def setup_context(ctx, inputs, output):
        phi, variance, second_moment, loc, log_scale, bias, variance_output, *prior = inputs
        _, xi, weight_variance, formed, kl, loc_square = output
        second = second_moment if second_moment is not None else formed
        ctx.bias, ctx.variance_output = bias, variance_output
        ctx.prior_variance = prior[0] if prior and kl.numel() == 1 else None
        ctx.given_second_moment = second_moment is not None
        ctx.mark_non_differentiable(weight_variance, formed, loc_square)
        ctx.save_for_backward(phi, variance, second, loc, weight_variance, None if variance_output else xi, loc_square)

    @staticmethod
    @support.first_order_only  # written-out backward: a second order raises
    def backward(ctx, grad_gamma, grad_xi, _grad_weight_variance, _grad_second, grad_kl=None, _grad_loc_square=None):
        phi, variance, second, loc, weight_variance, xi, loc_square = ctx.saved_tensors
        width = variance.shape[-1]
        grad_gamma, grad_xi = support.gradient_pair(
            grad_gamma, grad_xi, lambda: phi.new_zeros(*phi.shape[:-1], loc.shape[0])
        )
        loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
        # as in the diagonal case, ratio = 2 grad_xi2 (grad_xi / xi for the standard deviation);
        # the halves go on the small weights (none for the variance form: its 2 and the half cancel)
        if ctx.variance_output:
            ratio, scale = grad_xi, 2.0
        else:
            ratio, scale = grad_xi / xi, 1.0
            variance_h, loc_square = 0.5 * variance_h, 0.5 * loc_square
        # d/d loc = grad_gamma^T phi + 2 loc (grad_xi2^T Var h) = ... + loc (ratio^T Var h)
        if support.transforms_active():
            grad_loc_h = torch.addcmul(
                support.flat_product(grad_gamma, phi), loc_h, support.flat_product(ratio, variance), value=scale
            )
            grad_loc = support.gradient_with_bias_column(grad_loc_h, support.flat_sum(grad_gamma), ctx.bias)
        else:  # built in one buffer: no (rows, width) temporaries, no concatenation for the bias column
            flat_gamma = support.flat(grad_gamma)
            grad_loc = torch.empty_like(loc)
            grad_loc_h = grad_loc[:, :width]
            torch.mm(support.flat(ratio).mT, support.flat(variance), out=grad_loc_h)
            grad_loc_h.mul_(loc_h).addmm_(flat_gamma.mT, support.flat(phi), beta=scale)
            if ctx.bias:
                torch.sum(flat_gamma, 0, out=grad_loc[:, width])
        # d/d log_scale = 2 Var W (grad_xi2^T E[h^2]) = Var W (ratio^T E[h^2])
        bias_column = ctx.bias
        if ctx.prior_variance is not None:  # the KL's gradient folded in, one pass for both
            grad_log_scale = support.weight_gradient(ratio, second, bias_column, 0.5 * scale)
            grad_loc, grad_log_scale = support.folded_kl_backward(
                loc, weight_variance, grad_loc, grad_log_scale, ctx.prior_variance, grad_kl
            )
        else:
            grad_log_scale = support.weight_gradient(ratio, second, bias_column, scale)
            grad_log_scale = (
                grad_log_scale * weight_variance
                if support.transforms_active()
                else grad_log_scale.mul_(weight_variance)
            )
        # the inputs' gradients last: the activation's backward kernel reads them next, still in cache
        grad_phi = grad_gamma @ loc_h
        grad_second = ratio @ variance_h
        grad_variance = ratio @ loc_square
        if not ctx.given_second_moment:  # E[h^2] = Var h + phi^2 was formed here
            grad_variance = grad_variance + grad_second
            grad_phi = torch.addcmul(grad_phi, phi, grad_second, value=2.0)
            grad_second = None
        return grad_phi, grad_variance, grad_second, grad_loc, grad_log_scale, None, None, None, None


_PropagatedPreactivationClassic = support.classic_twin(PropagatedPreactivation)


def _propagated(*arguments):
    """:class:`PropagatedPreactivation` (its classic twin outside torch.func transforms)."""
    return support.apply(PropagatedPreactivation, _PropagatedPreactivationClassic, *arguments)


def propagated_preactivation(phi, variance, loc, log_scale, bias: bool = True, second_moment=None):
    """``(gamma, xi)`` of ``W [h, 1]`` under a mean-field q when the inputs ``h`` are uncertain
    too: independent, of means ``phi`` and variances ``variance`` (the deterministic estimator's
    diagonal propagation), ``xi^2 = E[h^2]^T Var W + Var[h]^T loc^2`` per row.

    ``second_moment`` is ``E[h^2]`` when the caller has it (the activation kernels return it as
    Upsilon, eq. (9)): it then carries its own gradient, and ``phi^2 + variance`` is not formed."""
    return _propagated(phi, variance, second_moment, loc, log_scale, bias, False)[:2]


def propagated_preactivation_and_kl(
    phi: torch.Tensor,
    variance: torch.Tensor,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    bias: bool,
    second_moment: Optional[torch.Tensor],
    variance_output: bool,
    prior_variance: float,
):
    """``(gamma, xi or xi^2, KL)``: :func:`propagated_preactivation` with the layer's KL folded
    in, as :func:`diagonal_preactivation_and_kl` (``KL`` ``None`` where that does not apply)."""
    return support.with_folded_kl(
        _propagated(phi, variance, second_moment, loc, log_scale, bias, variance_output, float(prior_variance))
    )


def propagated_preactivation_variance(phi, variance, loc, log_scale, bias: bool = True, second_moment=None):
    """:func:`propagated_preactivation` with the variance ``xi^2`` in place of ``xi``."""
    return _propagated(phi, variance, second_moment, loc, log_scale, bias, True)[:2]
