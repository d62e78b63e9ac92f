"""The closed form's hot path as autograd functions with analytic backward passes.

Written as ordinary torch code, one closed-form ELBO step of a mean-field layer is some
130 small operations forward and backward (each exp, square, cat, sum and their
autograd nodes), and on a CPU their overhead, not the arithmetic, is most of the
step. Here the same mathematics is a few functions whose backward passes are written
out, reusing what the forward computed:

* :func:`diagonal_preactivation` -- ``(gamma, xi)`` of ``W [h, 1]`` under a diagonal q,
  paper eq. (12), the bias column handled without building ``[h, 1]``;
* :func:`propagated_preactivation` -- the same when ``h`` is itself uncertain (mean and
  variance per unit, the ``deterministic`` estimator's moment propagation);
* :func:`diagonal_kl` -- ``KL(N(loc, diag exp(2 log_scale)) || N(0, s^2 I))``, the KL terms
  of eq. (4), straight from ``log_scale`` (no ``log(exp(.))``);
* :func:`normal_ell_given_hidden` -- the output layer integrated exactly and the Normal
  likelihood, eqs. (7)-(8), per data point, from the hidden units' ``Phi`` and ``Var``;
* :func:`normal_ell_given_preactivation` -- the same for one output straight from the last
  hidden layer's pre-activation means and *variances*, eqs. (7)-(9) in one C++ pass each way
  (``tail_pass`` in moments/csrc/cfbnn_moments.cpp): ``Phi``, ``Upsilon`` and ``Var`` of the
  ``(N, H)`` block never reach memory, and with :func:`diagonal_preactivation_variance` /
  :func:`propagated_preactivation_variance` neither the square root nor its derivative
  is a pass of its own.

* :func:`closed_form_normal_elbo` -- the whole ELBO of a network whose every layer is a
  diagonal Gaussian integrated in closed form (``deterministic``; ``analytic`` with one hidden
  layer), one Normal output, as ONE autograd node: the functions above run in a row on
  :class:`_Tape` contexts and their backward passes in reverse, so autograd's bookkeeping
  (a node per function, per scalar operation of the ELBO's sum, zeros for unused outputs)
  is paid once. :meth:`BayesianNetwork.elbo` takes it where it applies.

While an ELBO is evaluated, the layer's KL comes out of the same function
(:func:`diagonal_preactivation_and_kl`, :func:`propagated_preactivation_and_kl`,
:func:`normal_ell_given_preactivation_and_kl`). One kernel pass gives the KL's sums and
``exp(2 log_scale)``. Backward, one pass finishes the layer's gradient with the KL's
gradient folded in, so autograd has no second pair of parameter-sized gradients to add.

On a CPU each pass over an ``(N, H)`` block that has left the core's cache costs about what
its bytes take to move (~40 us per 400 kB array here), and every small torch operation
5-10 us of Python and dispatch: the functions count both. Outside torch.func transforms they
run as classic ``forward(ctx, ...)`` functions (no signature binding per call) and write
gradients in place; inside, out of place (:func:`_transforms_active`).

They compute what :mod:`.functional` computes (``tests/bnn/test_fused.py`` checks values
and gradients against it and against the reference torch moments, float64 and float32,
and ``torch.autograd.gradcheck``), and all but the kernel tail support ``torch.func.vmap``
/ ``grad`` (``generate_vmap_rule``), which the gradient-variance measurement uses.
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Tuple

import torch

from ..moments import fast as fast_moments
from ..moments.gaussian import check_mean_std, validating_args

_LOG_MAX_DOUBLE = math.log(sys.float_info.max)
_LOG_2PI = math.log(2.0 * math.pi)
_LOG_MAX_DOUBLE = math.log(sys.float_info.max)


def _transforms_active() -> bool:
    """Inside torch.func transforms (vmap/grad) the kernels run on wrapped tensors: there the
    functions below take out-of-place ops only (an in-place op on an unbatched result with a
    batched operand is an error) and never write through ``out=``."""
    return torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``(rows, last)``, every leading dimension folded into the rows (a 2-D tensor as
    is: ``reshape`` is a dispatch of its own, a few of them per layer and step)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def _affine(inputs: torch.Tensor, weight: torch.Tensor, bias_column) -> torch.Tensor:
    """``inputs @ weight^T (+ bias_column)`` over any leading dimensions, the bias added by
    the matrix product itself (``addmm``: no separate pass over the result)."""
    flat = _flat(inputs)
    out = flat @ weight.mT if bias_column is None else torch.addmm(bias_column, flat, weight.mT)
    return out if inputs.dim() == 2 else out.reshape(*inputs.shape[:-1], weight.shape[0])


def _sqrt_floored(variance: torch.Tensor) -> torch.Tensor:
    """The standard deviation, kept off exact zero, where sqrt's slope is infinite (in place
    on the fresh ``variance``: it is never seen by anyone else)."""
    tiny = torch.finfo(variance.dtype).tiny
    if _transforms_active():
        return variance.clamp(min=tiny).sqrt()
    return variance.clamp_(min=tiny).sqrt_()


def _columns(matrix: torch.Tensor, width: int, bias: bool):
    """``(matrix[:, :width], matrix[:, width] or None)``: the weights on ``h`` and on the bias's 1.

    The bias column is made contiguous (a copy of ``rows`` numbers): broadcast from its strided
    view, adding it to an (N, rows) result takes torch's slow path (4-6x the contiguous add)."""
    return matrix[:, :width], (matrix[:, width].contiguous() if bias else None)


def _gradient_with_bias_column(main: torch.Tensor, bias_part, bias: bool) -> torch.Tensor:
    """``[main, bias_part]`` as one ``(rows, width + 1)`` gradient (just ``main`` without a bias)."""
    return torch.cat([main, bias_part.unsqueeze(-1)], -1) if bias else main


def _flat_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``sum_n left_n^T right_n`` over every leading dimension: ``(A, B)`` from ``(..., A)``, ``(..., B)``."""
    return _flat(left).mT @ _flat(right)


def _weight_gradient(left: torch.Tensor, right: torch.Tensor, bias: bool, scale: float = 1.0) -> torch.Tensor:
    """``[sum_n left_n^T right_n, sum_n left_n]``: a layer's ``(rows, width [+ 1])`` weight gradient
    from the output-side factor ``left`` and the inputs ``right``, the bias column's input being 1.

    Outside torch.func both parts are written into one buffer (``out=``): on a wide layer the
    concatenation is a copy of the whole gradient (2 ms at 1000 x 2049)."""
    flat_left, flat_right = _flat(left), _flat(right)
    if _transforms_active():  # batched gradients cannot be written into a plain buffer
        main = flat_left.mT @ flat_right
        gradient = _gradient_with_bias_column(main, flat_left.sum(0), True) if bias else main
        return gradient if scale == 1.0 else scale * gradient
    width = flat_right.shape[-1]
    out = flat_left.new_empty((flat_left.shape[-1], width + bias))
    # the scale rides on the product (alpha): no pass over the result for it
    torch.addmm(out[:, :width], flat_left.mT, flat_right, beta=0.0, alpha=scale, out=out[:, :width])
    if bias:
        torch.sum(flat_left, 0, out=out[:, width])
        if scale != 1.0:
            out[:, width].mul_(scale)
    return out


def _kl_from_sums(sums, count: int, prior_variance: float) -> float:
    """``KL(N(loc, diag Var) || N(0, s^2 I))`` from ``(sum Var, sum loc^2, sum log_scale)``."""
    variance_sum, loc_square_sum, log_scale_sum = sums
    return (
        0.5 * ((variance_sum + loc_square_sum) / prior_variance - count + count * math.log(prior_variance))
        - log_scale_sum
    )


def _folded_kl_forward(loc: torch.Tensor, log_scale: torch.Tensor, prior_variance: Optional[float]):
    """``(exp(2 log_scale), KL)`` from one kernel pass (the KL of the layer folded into its
    pre-activation function), or ``None`` where that does not apply (no prior given, torch.func
    transforms, the kernels unavailable for these tensors)."""
    if prior_variance is None or _transforms_active():
        return None
    variance = torch.empty_like(log_scale)
    sums = fast_moments.diagonal_kl_sums(loc, log_scale, variance)
    if sums is None:
        return None
    return variance, loc.new_tensor(_kl_from_sums(sums, loc.numel(), prior_variance))


def _folded_kl_backward(loc, variance, grad_loc, grad_variance, scale: float, prior_variance: float, grad_kl):
    """The layer's gradients finished in place with its KL's folded in: ``grad_variance`` (``dL/d
    Var / scale``) becomes ``dL/d log_scale`` (one kernel pass over the matrix, no second pair of
    gradient buffers for autograd to add)."""
    kl_grad = 0.0 if grad_kl is None else float(grad_kl)
    fast_moments.finish_diagonal_gradients(
        loc, variance, grad_loc, grad_variance, scale, kl_grad / prior_variance, kl_grad
    )
    return grad_loc, grad_variance


def _gradient_pair(first, second, zeros):
    """``(first, second)`` with a missing one as ``zeros()`` (an output nobody used): the classic
    functions do not materialize missing gradients (:func:`_classic_twin`)."""
    return (zeros() if first is None else first), (zeros() if second is None else second)


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """Stands in for an output that was not computed (an unfolded KL)."""
    return like.new_empty(0)


class _DiagonalPreactivation(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(h, loc, log_scale, bias: bool, variance_output: bool, prior_variance: Optional[float] = None):
        folded = _folded_kl_forward(loc, log_scale, prior_variance)
        if folded is not None:
            variance, kl = folded
        else:
            variance = log_scale.mul(2.0).exp_() if not _transforms_active() else torch.exp(2.0 * log_scale)
            kl = _placeholder(loc)
        width = h.shape[-1]
        if bias and width < loc.shape[0] and not _transforms_active():
            # the inputs narrower than the outputs: [h, 1] built once is cheaper than the bias
            # broadcast into each (N, rows) result, and the products then give the bias column's
            # gradient too (no sums, no slices)
            pair = fast_moments.augment_pair(h)  # [h, 1] and [h^2, 1] in one pass where the kernels run
            if pair is None:
                augmented = torch.nn.functional.pad(h, (0, 1), value=1.0)
                squared = augmented * augmented
            else:
                augmented, squared = pair
            gamma = _affine(augmented, loc, None)
            xi2 = _affine(squared, variance, None)
        else:
            augmented = _placeholder(h)
            loc_h, loc_b = _columns(loc, width, bias)
            variance_h, variance_b = _columns(variance, width, bias)
            squared = h * h
            gamma = _affine(h, loc_h, loc_b)
            xi2 = _affine(squared, variance_h, variance_b)
        return gamma, (xi2 if variance_output else _sqrt_floored(xi2)), variance, squared, kl, augmented

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
    def backward(ctx, grad_gamma, grad_xi, _grad_variance, _grad_squared, grad_kl=None, _grad_augmented=None):
        inputs, loc, xi, variance, squared = ctx.saved_tensors  # inputs: [h, 1] when augmented
        grad_gamma, grad_xi = _gradient_pair(
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
        grad_loc = _weight_gradient(grad_gamma, inputs, bias)
        if ctx.prior_variance is not None:  # the KL's gradient folded in, one pass for both
            grad_log_scale = _weight_gradient(ratio, squared, bias)
            grad_loc, grad_log_scale = _folded_kl_backward(
                loc, variance, grad_loc, grad_log_scale, scale, ctx.prior_variance, grad_kl
            )
            return grad_h, grad_loc, grad_log_scale, None, None, None
        grad_log_scale = _weight_gradient(ratio, squared, bias, scale)
        grad_log_scale = grad_log_scale * variance if _transforms_active() else grad_log_scale.mul_(variance)
        return grad_h, grad_loc, grad_log_scale, None, None, None


_CONSTANTS = {}


def _constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor of ``value``, made once per (value, dtype, device): a fixed prior's variance
    is the same number every step (a few of them; never written to)."""
    key = (value, dtype, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        tensor = _CONSTANTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return tensor


def _classic_twin(function):
    """``function`` (an autograd.Function written with ``setup_context``, as torch.func needs) in
    the classic ``forward(ctx, ...)`` form, which autograd applies without binding a signature
    (~30 us per call on a CPU): the form used outside torch.func transforms."""

    class Classic(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = function.forward(*inputs)
            function.setup_context(ctx, inputs, output)
            # no zeros made for the outputs that get no gradient (the non-differentiable ones
            # above all): each was an allocation and a pass; the backward passes take ``None``
            ctx.set_materialize_grads(False)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return function.backward(ctx, *grads)

    Classic.__name__ = Classic.__qualname__ = function.__name__ + "Classic"
    return Classic


def _apply(function, classic, *inputs):
    """``classic.apply`` outside torch.func transforms, ``function.apply`` inside."""
    return (function if _transforms_active() else classic).apply(*inputs)


def _flat_sum(tensor: torch.Tensor) -> torch.Tensor:
    return _flat(tensor).sum(0)


_DiagonalPreactivationClassic = _classic_twin(_DiagonalPreactivation)


def diagonal_preactivation(
    h: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor, bias: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gamma, xi)`` of the pre-activations of ``[h, 1]`` (``bias``) or ``h`` under a
    mean-field q with means ``loc`` and standard deviations ``exp(log_scale)`` (eq. (12))."""
    return _apply(_DiagonalPreactivation, _DiagonalPreactivationClassic, h, loc, log_scale, bias, False)[:2]


def diagonal_preactivation_variance(
    h: torch.Tensor, loc: torch.Tensor, log_scale: torch.Tensor, bias: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`diagonal_preactivation` with the variance ``xi^2`` in place of ``xi`` (for
    :func:`normal_ell_given_preactivation`, which takes the square root in its own pass)."""
    return _apply(_DiagonalPreactivation, _DiagonalPreactivationClassic, h, loc, log_scale, bias, True)[:2]


def _with_folded_kl(outputs):
    """``(gamma, xi, KL or None)`` from the pre-activation functions' outputs (the KL is the fifth)."""
    kl = outputs[4]
    return outputs[0], outputs[1], (kl if kl.numel() == 1 else None)


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
    return _with_folded_kl(
        _apply(
            _DiagonalPreactivation,
            _DiagonalPreactivationClassic,
            h,
            loc,
            log_scale,
            bias,
            variance_output,
            float(prior_variance),
        )
    )


class _PropagatedPreactivation(torch.autograd.Function):
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
        augmented: bool = False,
    ):
        folded = _folded_kl_forward(loc, log_scale, prior_variance)
        weight_variance, kl = folded if folded is not None else (torch.exp(2.0 * log_scale), _placeholder(loc))
        # augmented: phi and second_moment are [phi, 1] and [E h^2, 1] from the moments kernel. Only
        # the single-node ELBO passes them (its backward returns the (..., H) moments' gradients,
        # which autograd would refuse for (..., H + 1) inputs)
        if augmented:
            width = variance.shape[-1]
            loc_square = loc[:, :width] * loc[:, :width]
            gamma = torch.mm(phi, loc.mT)  # the bias in the product: no pass to add it, none to sum it
            xi2 = torch.mm(second_moment, weight_variance.mT)
            xi2.addmm_(variance, loc_square.mT)
            return (
                gamma,
                (xi2 if variance_output else _sqrt_floored(xi2)),
                weight_variance,
                phi.new_empty(0),
                kl,
                loc_square,
            )
        width = phi.shape[-1]
        loc_h, loc_b = _columns(loc, width, bias)
        variance_h, variance_b = _columns(weight_variance, width, bias)
        formed = None
        if second_moment is None:  # E[h^2] = Var h + phi^2
            second_moment = formed = torch.addcmul(variance, phi, phi)
        gamma = _affine(phi, loc_h, loc_b)
        # Var = E[h^2]^T Var W + Var[h]^T loc^2: two products summed into one buffer
        xi2 = _affine(second_moment, variance_h, variance_b)
        loc_square = loc_h * loc_h  # kept for the backward pass
        if _transforms_active():
            xi2 = xi2 + _affine(variance, loc_square, None)
        else:  # the second product accumulated into the first's buffer (no third (N, H) array)
            flat = _flat(xi2)
            flat.addmm_(_flat(variance), loc_square.mT)
        # E[h^2] is an output only when formed here (an input returned as is cannot be saved)
        formed = formed if formed is not None else phi.new_empty(0)
        return gamma, (xi2 if variance_output else _sqrt_floored(xi2)), weight_variance, formed, kl, loc_square

    @staticmethod
    def setup_context(ctx, inputs, output):
        phi, variance, second_moment, loc, log_scale, bias, variance_output, *prior = inputs
        _, xi, weight_variance, formed, kl, loc_square = output
        second = second_moment if second_moment is not None else formed
        ctx.bias, ctx.variance_output = bias, variance_output
        ctx.augmented = len(prior) > 1 and prior[1]
        ctx.prior_variance = prior[0] if prior and kl.numel() == 1 else None
        ctx.given_second_moment = second_moment is not None
        ctx.mark_non_differentiable(weight_variance, formed, loc_square)
        ctx.save_for_backward(phi, variance, second, loc, weight_variance, None if variance_output else xi, loc_square)

    @staticmethod
    def backward(ctx, grad_gamma, grad_xi, _grad_weight_variance, _grad_second, grad_kl=None, _grad_loc_square=None):
        phi, variance, second, loc, weight_variance, xi, loc_square = ctx.saved_tensors
        width = variance.shape[-1]
        grad_gamma, grad_xi = _gradient_pair(grad_gamma, grad_xi, lambda: phi.new_zeros(*phi.shape[:-1], loc.shape[0]))
        loc_h, variance_h = loc[:, :width], weight_variance[:, :width]
        # as in the diagonal case, ratio = 2 grad_xi2 (grad_xi / xi for the standard deviation);
        # the halves go on the small weights (none for the variance form: its 2 and the half cancel)
        if ctx.variance_output:
            ratio, scale = grad_xi, 2.0
        else:
            ratio, scale = grad_xi / xi, 1.0
            variance_h, loc_square = 0.5 * variance_h, 0.5 * loc_square
        # d/d loc = grad_gamma^T phi + 2 loc (grad_xi2^T Var h) = ... + loc (ratio^T Var h)
        if ctx.augmented:  # [phi, 1] gives the bias column's gradient from the product itself
            grad_loc = torch.mm(grad_gamma.mT, phi)
            grad_loc[:, :width].addcmul_(loc_h, torch.mm(ratio.mT, variance), value=scale)
        elif _transforms_active():
            grad_loc_h = torch.addcmul(
                _flat_product(grad_gamma, phi), loc_h, _flat_product(ratio, variance), value=scale
            )
            grad_loc = _gradient_with_bias_column(grad_loc_h, _flat_sum(grad_gamma), ctx.bias)
        else:  # built in one buffer: no (rows, width) temporaries, no concatenation for the bias column
            flat_gamma = _flat(grad_gamma)
            grad_loc = torch.empty_like(loc)
            grad_loc_h = grad_loc[:, :width]
            torch.mm(_flat(ratio).mT, _flat(variance), out=grad_loc_h)
            grad_loc_h.mul_(loc_h).addmm_(flat_gamma.mT, _flat(phi), beta=scale)
            if ctx.bias:
                torch.sum(flat_gamma, 0, out=grad_loc[:, width])
        # d/d log_scale = 2 Var W (grad_xi2^T E[h^2]) = Var W (ratio^T E[h^2])
        # ([E h^2, 1] augmented: the bias column's from the product)
        bias_column = ctx.bias and not ctx.augmented
        if ctx.prior_variance is not None:  # the KL's gradient folded in, one pass for both
            grad_log_scale = _weight_gradient(ratio, second, bias_column)
            grad_loc, grad_log_scale = _folded_kl_backward(
                loc, weight_variance, grad_loc, grad_log_scale, scale, ctx.prior_variance, grad_kl
            )
        else:
            grad_log_scale = _weight_gradient(ratio, second, bias_column, scale)
            grad_log_scale = (
                grad_log_scale * weight_variance if _transforms_active() else grad_log_scale.mul_(weight_variance)
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


_PropagatedPreactivationClassic = _classic_twin(_PropagatedPreactivation)


def propagated_preactivation(
    phi: torch.Tensor,
    variance: torch.Tensor,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    bias: bool = True,
    second_moment: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gamma, xi)`` of ``W [h, 1]`` under a mean-field q when the inputs ``h`` are uncertain
    too: independent, of means ``phi`` and variances ``variance`` (the deterministic estimator's
    diagonal propagation), ``xi^2 = E[h^2]^T Var W + Var[h]^T loc^2`` per row.

    ``second_moment`` is ``E[h^2]`` when the caller has it (the activation kernels return it as
    Upsilon, eq. (9)): it then carries its own gradient, and ``phi^2 + variance`` is not formed."""
    return _apply(
        _PropagatedPreactivation,
        _PropagatedPreactivationClassic,
        phi,
        variance,
        second_moment,
        loc,
        log_scale,
        bias,
        False,
    )[:2]


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
    return _with_folded_kl(
        _apply(
            _PropagatedPreactivation,
            _PropagatedPreactivationClassic,
            phi,
            variance,
            second_moment,
            loc,
            log_scale,
            bias,
            variance_output,
            float(prior_variance),
        )
    )


def propagated_preactivation_variance(
    phi: torch.Tensor,
    variance: torch.Tensor,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    bias: bool = True,
    second_moment: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`propagated_preactivation` with the variance ``xi^2`` in place of ``xi``."""
    return _apply(
        _PropagatedPreactivation,
        _PropagatedPreactivationClassic,
        phi,
        variance,
        second_moment,
        loc,
        log_scale,
        bias,
        True,
    )[:2]


class _DiagonalKL(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(loc, log_scale, prior_variance):
        count = loc.numel()
        sums = None if _transforms_active() else fast_moments.diagonal_kl_sums(loc, log_scale)
        if sums is not None:  # one pass over the matrix (a wide layer's KL was ten passes over its 2M numbers)
            variance_sum, loc_square_sum, log_scale_sum = sums
            second_moment = prior_variance.new_tensor(variance_sum + loc_square_sum)
            if not prior_variance.requires_grad:  # a fixed prior: the rest is arithmetic on numbers
                return prior_variance.new_tensor(_kl_from_sums(sums, count, float(prior_variance))), second_moment
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
    def backward(ctx, grad, _grad_second_moment):
        if grad is None:  # the KL itself unused (the classic form passes no zeros)
            return None, None, None
        loc, log_scale, prior_variance, second_moment = ctx.saved_tensors
        gradients = None
        if not _transforms_active() and grad.device.type == "cpu":
            grad_value = float(grad)
            gradients = fast_moments.diagonal_kl_gradients(
                loc, log_scale, grad_value / float(prior_variance), grad_value
            )
        if gradients is not None:
            grad_loc, grad_log_scale = gradients
        else:
            scaled = grad / prior_variance
            grad_loc = scaled * loc
            grad_log_scale = scaled * torch.exp(2.0 * log_scale) - grad
        grad_prior = None
        if ctx.needs_input_grad[2]:
            grad_prior = grad * 0.5 * (loc.numel() / prior_variance - second_moment / prior_variance**2)
        return grad_loc, grad_log_scale, grad_prior


_DiagonalKLClassic = _classic_twin(_DiagonalKL)


def diagonal_kl(loc: torch.Tensor, log_scale: torch.Tensor, prior_variance) -> torch.Tensor:
    """``KL(N(loc, diag(exp(2 log_scale))) || N(0, prior_variance I))`` summed over the matrix."""
    if not isinstance(prior_variance, torch.Tensor):
        prior_variance = _constant(float(prior_variance), loc.dtype, loc.device)
    return _apply(_DiagonalKL, _DiagonalKLClassic, loc, log_scale, prior_variance)[0]


class _NormalELLGivenHidden(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(phi, variance, second_moment, loc, log_scale, y, log_precision, bias: bool):
        width = phi.shape[-1]
        weight_variance = torch.exp(2.0 * log_scale)
        loc_h, loc_b = _columns(loc, width, bias)
        variance_h = weight_variance[:, :width]
        mean = _affine(phi, loc_h, loc_b)
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
        ell = -0.5 * precision * squares + 0.5 * outputs * (log_precision - _LOG_2PI)
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
        grad_loc = _gradient_with_bias_column(
            _flat_product(grad_mean, phi) + 2.0 * loc_h * weighted_variance, flat_mean.sum(0), ctx.bias
        )
        grad_weight_variance = _gradient_with_bias_column(
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


_NormalELLGivenHiddenClassic = _classic_twin(_NormalELLGivenHidden)


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
    return _apply(
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


class _NormalELLGivenPreactivation(torch.autograd.Function):
    """The last hidden layer's activation moments, the output layer integrated exactly and the
    Normal likelihood, for one output, through the kernel ``tail_pass`` (moments/fast.py):
    ``Phi``, ``Upsilon`` and ``Var`` of the (N, H) block are never written to memory, and the
    backward pass returns ``d/d gamma``, ``d/d xi`` and the output layer's column sums from one
    more pass. Plain CPU tensors only (no torch.func transforms): see :func:`normal_ell_given_preactivation`."""

    @staticmethod
    def forward(ctx, gamma, xi2, loc, log_scale, y, log_precision, bias: bool, op, prior_variance=None):
        width = gamma.shape[-1]
        flat_gamma, flat_xi = _flat(gamma), _flat(xi2)
        folded = _folded_kl_forward(loc, log_scale, prior_variance)
        weight_variance, kl = folded if folded is not None else (torch.exp(2.0 * log_scale), _placeholder(loc))
        weight_phi = loc[0, :width].contiguous()
        weight_loc2 = weight_phi * weight_phi
        weight_second = weight_variance[0, :width].contiguous()
        mean, spread = fast_moments.normal_tail(op, flat_gamma, flat_xi, weight_phi, weight_loc2, weight_second)
        # the precision and the bias as numbers, the rows in one kernel loop (seven small tensor
        # operations were most of this function's time)
        log_beta = float(log_precision)
        # as torch.exp would: +inf past the float64 range (an L-BFGS line search probes such steps,
        # and must see the -inf ELL the reference path gives, not an OverflowError)
        precision = math.exp(log_beta) if log_beta < _LOG_MAX_DOUBLE else math.inf
        mean_bias, spread_bias = (float(loc[0, width]), float(weight_variance[0, width])) if bias else (0.0, 0.0)
        residual, squares, ell, ell_sum = fast_moments.normal_rows(
            mean, spread, y, mean_bias, spread_bias, precision, 0.5 * (log_beta - _LOG_2PI)
        )
        ctx.bias, ctx.op, ctx.shape, ctx.precision = bias, op, gamma.shape, precision
        ctx.prior_variance = prior_variance if folded is not None else None
        ctx.ell_sum = ell_sum  # for the single-node ELBO (no pass over ELL to sum it)
        ctx.save_for_backward(
            flat_gamma, flat_xi, loc, weight_variance, weight_phi, weight_loc2, weight_second, residual, squares
        )
        return ell.reshape(gamma.shape[:-1]), kl

    @staticmethod
    def backward(ctx, grad_ell, grad_kl):
        (flat_gamma, flat_xi, loc, weight_variance, weight_phi, weight_loc2, weight_second, residual, squares) = (
            ctx.saved_tensors
        )
        precision = ctx.precision
        grad_ell = grad_ell.reshape(-1).contiguous()
        row_mean_grad, row_spread_grad, sum_u, sum_k, log_beta_grad = fast_moments.normal_row_gradients(
            grad_ell, residual, squares, precision
        )
        grad_gamma, grad_xi, columns = fast_moments.normal_tail(
            ctx.op, flat_gamma, flat_xi, weight_phi, weight_loc2, weight_second, row_mean_grad, row_spread_grad
        )
        # d/d loc_c = sum_n u_n Phi_nc + 2 loc_c sum_n k_n Var_nc; d/d Var W_c = sum_n k_n Ups_nc;
        # the bias column's input is 1
        grad_loc, grad_variance = torch.empty_like(loc), torch.empty_like(weight_variance)
        fast_moments.normal_output_gradients(columns, weight_phi, ctx.bias, sum_u, sum_k, grad_loc, grad_variance)
        if ctx.prior_variance is not None:  # the output layer's KL folded in
            grad_loc, grad_log_scale = _folded_kl_backward(
                loc, weight_variance, grad_loc, grad_variance, 2.0, ctx.prior_variance, grad_kl
            )
        else:
            grad_log_scale = grad_variance.mul_(weight_variance).mul_(2.0)
        grad_log_precision = None
        if ctx.needs_input_grad[5]:  # sum_n g_n (-beta/2 squares_n + 1/2)
            grad_log_precision = torch.scalar_tensor(log_beta_grad, dtype=loc.dtype)
        return (
            grad_gamma.reshape(ctx.shape),
            grad_xi.reshape(ctx.shape),
            grad_loc,
            grad_log_scale,
            None,
            grad_log_precision,
            None,
            None,
            None,
        )


def activation_kernels(activation):
    """The activation's kernel object (``None`` for one without kernels); whether they take
    given tensors is :func:`~cfbnn_cli.moments.fast.layer_kernels_apply`'s question."""
    return activation.cpu_kernels if hasattr(activation, "cpu_kernels") else None


def layer_kernel_op(activation, *tensors):
    """The activation's kernels when the layer kernels (the fused tail, the hidden layers'
    moments from variances) take these tensors, else ``None``: an activation without them
    (identity and the piecewise-polynomial engine), tensors that are not plain contiguous CPU
    float32/float64 of one dtype, torch.func transforms or the fast path switched off."""
    if _transforms_active():
        return None
    op = activation_kernels(activation)
    return op if fast_moments.layer_kernels_apply(op, *tensors) else None


def normal_tail_op(activation, loc: torch.Tensor, *tensors):
    """:func:`layer_kernel_op` for :func:`normal_ell_given_preactivation` on a one-output layer
    ``loc`` (``None`` for more than one output: then take the other route)."""
    return layer_kernel_op(activation, loc, *tensors) if loc.shape[0] == 1 else None


def normal_ell_given_preactivation(
    gamma: torch.Tensor,
    xi2: torch.Tensor,
    op,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    y: torch.Tensor,
    log_precision: torch.Tensor,
    bias: bool = True,
) -> torch.Tensor:
    """``E_q[log N(y_n | W [g(a), 1], 1/beta)]`` per data point for last-hidden-layer
    pre-activations ``a ~ N(gamma, xi2)`` (independent units; ``xi2`` the variance) and a
    diagonal q over a one-output layer ``W`` (``loc``/``log_scale`` ``(1, H[+1])``):
    eqs. (7)-(9) in one fused kernel pass forward and one backward. What
    :func:`normal_ell_given_hidden` of ``activation.moments(gamma, sqrt(xi2))`` computes.
    ``op`` is :func:`normal_tail_op`'s answer (not ``None``)."""
    return normal_ell_given_preactivation_and_kl(gamma, xi2, op, loc, log_scale, y, log_precision, bias)[0]


def normal_ell_given_preactivation_and_kl(
    gamma: torch.Tensor,
    xi2: torch.Tensor,
    op,
    loc: torch.Tensor,
    log_scale: torch.Tensor,
    y: torch.Tensor,
    log_precision: torch.Tensor,
    bias: bool = True,
    prior_variance: Optional[float] = None,
):
    """``(ELL per point, KL)``: :func:`normal_ell_given_preactivation` with the output layer's
    ``KL(q || N(0, prior_variance I))`` from the same function (its gradient folded into the
    layer's); ``KL`` is ``None`` when no prior is given or the kernels do not take the layer."""
    check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the argument checks activation.moments makes (if on)
    gamma, xi2 = torch.broadcast_tensors(gamma, xi2)
    y = torch.broadcast_to(y, gamma.shape[:-1] + (1,)).contiguous()  # one target per row of gamma
    ell, kl = _NormalELLGivenPreactivation.apply(
        gamma.contiguous(),
        xi2.contiguous(),
        loc,
        log_scale,
        y,
        log_precision,
        bias,
        op,
        None if prior_variance is None else float(prior_variance),
    )
    return ell, (kl if kl.numel() == 1 else None)


class _Tape:
    """Stands in for autograd's ``ctx`` where the functions above run inside another function
    (:class:`_ClosedFormNormalELBO`): what their forward and backward passes use of it."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value: bool):
        pass


def _record(function, tape: _Tape, *inputs):
    """``function``'s forward pass (a ``setup_context`` function) with its context on ``tape``."""
    outputs = function.forward(*inputs)
    function.setup_context(tape, inputs, outputs)
    return outputs


class _ClosedFormNormalELBO(torch.autograd.Function):
    """``scale * sum_n ELL_n - sum_l KL_l`` of a network of diagonal Gaussian layers, every one
    integrated in closed form (one output, Normal likelihood, a fixed prior) as ONE autograd node.

    The forward pass runs the functions above in a row, each layer's KL folded in
    (:class:`_DiagonalPreactivation` for the first layer, then per later hidden layer the
    activation kernel ``hidden_pass`` and :class:`_PropagatedPreactivation`, then
    :class:`_NormalELLGivenPreactivation`), keeping their contexts on :class:`_Tape` objects;
    the backward pass calls their backward passes in reverse. The arithmetic is theirs, to the
    last operation: what this saves is autograd's bookkeeping, per node and per scalar operation
    of the ELBO's sum (~4 % of the step of a D-200-200-1 network on a 2-core CPU, measured side
    by side), and it lets the hidden-layer kernel hand on ``[Phi, 1]`` and ``[Ups, 1]``."""

    @staticmethod
    def forward(ctx, x, y, log_precision, op, biases, prior_variance: float, scale: float, *parameters):
        locs, log_scales = parameters[0::2], parameters[1::2]
        tapes = [_Tape((False, True, True))]
        gamma, xi2, _, _, kl, _ = _record(
            _DiagonalPreactivation, tapes[0], x, locs[0], log_scales[0], biases[0], True, prior_variance
        )
        kls = [kl]
        for loc, log_scale, bias in zip(locs[1:-1], log_scales[1:-1], biases[1:-1]):
            if validating_args():  # the checks activation.moments makes (off while training)
                check_mean_std(gamma, xi2, names=("gamma", "xi2"))
            moments_tape = _Tape((True, True, False))
            # with a bias, the kernel writes [Phi, 1] and [Ups, 1]: the layer's products carry its bias
            phi, second_moment, variance = fast_moments.MomentsFromVariance.forward(moments_tape, gamma, xi2, op, bias)
            layer_tape = _Tape((True, True, True, True, True))
            gamma, xi2, _, _, kl, _ = _record(
                _PropagatedPreactivation,
                layer_tape,
                phi,
                variance,
                second_moment,
                loc,
                log_scale,
                bias,
                True,
                prior_variance,
                bias,
            )
            tapes += [moments_tape, layer_tape]
            kls.append(kl)
        if validating_args():
            check_mean_std(gamma, xi2, names=("gamma", "xi2"))
        tail_tape = _Tape((True, True, True, True, False, ctx.needs_input_grad[2]))
        ell, kl = _NormalELLGivenPreactivation.forward(
            tail_tape, gamma, xi2, locs[-1], log_scales[-1], y, log_precision, biases[-1], op, prior_variance
        )
        tapes.append(tail_tape)
        kls.append(kl)
        if any(term.numel() != 1 for term in kls):  # the callers check that the kernels take every layer
            raise RuntimeError("a layer's KL was not folded into its function; use BayesianNetwork._elbo")
        # the tapes' tensors saved through ctx: autograd frees them after the backward pass (unless
        # retain_graph) and checks they were not modified in place, as for any function's
        ctx.save_for_backward(*[tensor for tape in tapes for tensor in tape.saved_tensors])
        ctx.counts = [len(tape.saved_tensors) for tape in tapes]
        for tape in tapes:
            tape.saved_tensors = ()
        ctx.tapes, ctx.scale, ctx.rows = tapes, scale, ell.shape
        total_kl = sum(float(term) for term in kls)
        return torch.scalar_tensor(scale * tail_tape.ell_sum - total_kl, dtype=x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        tapes, scale, saved, start = ctx.tapes, ctx.scale, ctx.saved_tensors, 0
        for tape, count in zip(tapes, ctx.counts):
            tape.saved_tensors, start = saved[start : start + count], start + count
        grad_kl = -float(grad)  # every KL enters with weight -1
        grad_ell = torch.full(ctx.rows, scale * float(grad), dtype=grad.dtype)
        tail = _NormalELLGivenPreactivation.backward(tapes[-1], grad_ell, grad_kl)
        grad_gamma, grad_xi, layer_grads, grad_log_precision = tail[0], tail[1], [tail[2:4]], tail[5]
        for index in range(len(tapes) - 2, 0, -2):  # the later hidden layers, last first
            layer = _PropagatedPreactivation.backward(tapes[index], grad_gamma, grad_xi, None, None, grad_kl, None)
            grad_phi, grad_variance, grad_second, grad_loc, grad_log_scale = layer[:5]
            layer_grads.append((grad_loc, grad_log_scale))
            grad_gamma, grad_xi, _ = fast_moments.MomentsFromVariance.backward(
                tapes[index - 1], grad_phi, grad_second, grad_variance
            )
        first = _DiagonalPreactivation.backward(tapes[0], grad_gamma, grad_xi, None, None, grad_kl, None)
        layer_grads.append(first[1:3])
        parameter_grads = [g for pair in reversed(layer_grads) for g in pair]
        for tape in tapes:  # nothing kept past the pass
            tape.saved_tensors = ()
        return (None, None, grad_log_precision, None, None, None, None, *parameter_grads)


def closed_form_normal_elbo(
    x: torch.Tensor,
    y: torch.Tensor,
    log_precision: torch.Tensor,
    op,
    parameters,
    biases,
    prior_variance: float,
    scale: float,
) -> torch.Tensor:
    """``scale * sum_n E_q[log N(y_n | f(x_n), 1/beta)] - sum_l KL(q_l || N(0, prior_variance I))``
    for a network whose every layer is a diagonal Gaussian integrated in closed form -- the first
    exactly (eq. (12)), later hidden layers by diagonal moment propagation, the one-output layer
    exactly (eqs. (7)-(9)) -- as one autograd node (:class:`_ClosedFormNormalELBO`): the value and
    gradients of the same functions called one by one, less the graph's overhead.

    ``parameters``: ``loc, log_scale`` of each layer in turn, first to output; ``biases``: whether
    each layer has a bias column; ``x`` ``(N, D)``, ``y`` ``(N, 1)``; ``op`` the activation's
    :func:`layer_kernel_op` for all of these tensors (not ``None``), which also says the KL
    kernels take them."""
    return _ClosedFormNormalELBO.apply(
        x,
        y.contiguous(),
        log_precision,
        op,
        tuple(bool(b) for b in biases),
        float(prior_variance),
        float(scale),
        *parameters,
    )
