"""The closed-form Normal likelihood terms of ReLU-family networks (ReLU, leaky ReLU, ReLU^2) as
autograd nodes on the ``cfbnn::``
operators, one implementation for the CPU and CUDA (paper eqs. (4), (7)-(9), (12), (20); one
Normal output): :class:`NormalELBO`, the whole ELBO of a one-hidden-layer network as one node,
and :class:`NormalELL`, the last hidden layer and the output layer of any deeper one (the
earlier layers sampled or propagated by the estimator).

Every step is an operator (:mod:`cfbnn_cli.moments.elbo_ops`, ``cfbnn::relu_tail``) or a matrix
product, and the dispatcher picks each step's kernel by device: C++ on the CPU, Triton on CUDA.
The forward pass is: one pass for the input with its bias column and its square, both layers'
``exp(2 log_scale)`` (and the output layer's ``loc^2``) and both layers' KL sums
(``cfbnn::outer_layers_pass``), the pre-activations' means and variances (2 matrix products), the
tail pass and the likelihood's rows with the ELBO's sum, the KL finished there
(``cfbnn::normal_elbo_rows``). Where a gradient is wanted the tail pass also takes its backward
pass at ``dL/d elbo = 1`` (``cfbnn::relu_tail_with_gradients``): the upstream gradient of an ELBO
is one number, so the backward pass only scales what the forward one found, and the
activation's moments are evaluated once a step, not twice. The backward pass: the rows
(``cfbnn::normal_rows_backward``), the output layer's gradients (``cfbnn::output_layer_gradients``),
two matrix products and one pass that finishes the hidden layer's gradients with its KL's folded
in (``cfbnn::finish_diagonal_gradients``), both scaling by that number. On CUDA that is eleven
kernels (four of them matrix products; tests/test_kernel_count.py counts them), where the same
mathematics written as ordinary torch code launches some 130; on the CPU, as many calls into the
C++ kernels.

Used by :meth:`cfbnn_cli.bnn.estimators.Estimator.elbo` where :func:`operators_apply`; the
values and gradients are tested against the reference torch path on the CPU kernels, on the
Triton kernels under ``TRITON_INTERPRET=1`` (tests/bnn/test_operator_elbo.py) and on a GPU.
"""

from __future__ import annotations

import torch

from ...moments import kernel_library, ops
from ...moments.activations import family_of
from ...moments.gaussian import check_mean_std
from ...moments.relu_family import RELU as _RELU_KIND
from .support import below_autograd, first_order_only

_cfbnn = torch.ops.cfbnn
_linear = torch.nn.functional.linear


RELU = (_RELU_KIND, 0.0)  # a family: (the family operators' activation, its negative slope)


def operators_apply(activation, *tensors: torch.Tensor) -> bool:
    """Whether :func:`normal_elbo` / :func:`normal_ell` (the nodes of this module) take these tensors:
    a ReLU-family network (:func:`~cfbnn_cli.moments.activations.family_of`), one float dtype on one device, outside torch.func
    transforms (the nodes have no batching rule; the estimator's layer-by-layer route serves
    ``vmap``). On the CPU that is all: the dispatcher runs the C++ kernels, or the reference kernels
    where the library did not build (the reference path chosen with
    :func:`cfbnn_cli.moments.fast_path` takes the layer-by-layer route instead). On CUDA, outside
    ``torch.compile``, where the operators take their Triton kernels
    (:func:`cfbnn_cli.moments.ops.device_kernels_apply`)."""
    first = tensors[0]
    if family_of(activation) is None or first.dtype not in (torch.float32, torch.float64):
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    if any(t.device != first.device or t.dtype != first.dtype for t in tensors):
        return False
    if first.device.type == "cpu" and not ops.triton_device(first.device):
        return kernel_library.fast_path_enabled()
    return not torch.compiler.is_compiling() and ops.device_kernels_apply(first)


def _output_layer_pass(loc, log_scale, width: int, prior_variance: float):
    """The one-output layer's KL pass: ``(KL, (w_phi, w_var, w_second))``, the tail pass's weights
    ``(loc, loc^2, Var W)`` of the first ``width`` columns written by the same pass."""
    kl, variance, loc_square = _cfbnn.diagonal_kl_pass(loc, log_scale, prior_variance, True)
    return kl, (_columns(loc, width), _columns(loc_square, width), _columns(variance, width))


def _columns(row: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` entries of a one-output layer's ``(1, width [+ 1])`` row as a 1-D view: one
    indexing call (where ``reshape(-1)[:width]`` is two; this runs a few times a step)."""
    return row[0, :width]


def _tail_backward(
    grad, row_grads: bool, scale: float, saved, kl_grad, kl_sign: float, prior_variance: float, bias, family, unit=None
):
    """The backward pass the nodes share, from ``grad`` (``dL/d ELL`` per row with ``row_grads``,
    else one ``dL/d elbo`` for every row, times ``scale``): the rows, the tail pass and the
    one-output layer's gradients with ``dL/dKL = kl_sign kl_grad`` folded in. ``saved``: what
    :func:`_tail_and_rows` saved, ``(gamma, xi2, loc, log_scale, log_precision, w_var, w_second,
    residual, squares)``, or where it took the tail pass's gradients ahead ``(d gamma, d xi2, loc,
    log_scale, log_precision, columns, None, residual, squares)`` at a unit upstream gradient, which
    is ``unit`` (a one-element tensor: every row's, the ELBO's by default). Returns ``(d gamma, d xi2,
    d loc, d log_scale, d log_precision, data_scale)``: ``d gamma`` and ``d xi2`` are to be multiplied
    by ``data_scale`` where it is not ``None``."""
    first, second, loc, log_scale, log_precision, w_var, w_second, residual, squares = saved
    row_u, row_k, sums, grad_log_precision = _cfbnn.normal_rows_backward(
        grad, residual, squares, log_precision, scale, row_grads
    )
    if w_second is None:  # taken ahead: the tail pass's gradients and column sums at dL/d elbo = 1
        grad_gamma, grad_xi2, columns, data_scale = first, second, w_var, grad if unit is None else unit
    else:
        w_phi = _columns(loc, first.shape[1])
        grad_gamma, grad_xi2, columns = _cfbnn.relu_tail_backward(
            first, second, w_phi, w_var, w_second, row_u, row_k, *family
        )
        data_scale = None
    grad_loc, grad_log_scale = _cfbnn.output_layer_gradients(
        columns, sums, loc, log_scale, kl_grad, kl_sign, prior_variance, bias, data_scale
    )
    return grad_gamma, grad_xi2, grad_loc, grad_log_scale, grad_log_precision, data_scale


def _first_layer(x, loc, log_scale, bias: bool, output_loc, output_log_scale):
    """A first layer's forward pass beside the one-output layer's:
    ``(inputs, squares_in, variance, gamma, xi2, output_rows, kl_sums)`` with ``[x, 1]`` and
    ``[x^2, 1]``, both layers' ``exp(2 log_scale)``, the output layer's ``loc^2`` (``output_rows =
    (Var, loc^2)`` of that layer) and both layers' KL sums table in one pass
    (``cfbnn::outer_layers_pass``: the KL is finished by the rows), and the pre-activations' means
    and variances as two matrix products."""
    inputs, squares_in, variance, output_variance, output_loc_square, kl_sums = _cfbnn.outer_layers_pass(
        x, loc, log_scale, output_loc, output_log_scale, bias
    )
    # linear(a, w) is mm(a, w^T) with the transpose taken in C++: one Python call a product, not two
    gamma, xi2 = _linear(inputs, loc), _linear(squares_in, variance)
    return inputs, squares_in, variance, gamma, xi2, (output_variance, output_loc_square), kl_sums


def _first_layer_gradients(
    grad_gamma, grad_xi2, inputs, squares_in, loc, variance, kl_grad, prior_variance, data_scale=None
):
    """``(d loc, d log_scale)`` of :func:`_first_layer` (``dL/dKL = -kl_grad`` folded in; ``d gamma``
    and ``d xi2`` times ``data_scale`` where given)."""
    grad_loc = torch.mm(grad_gamma.t(), inputs)
    grad_log_scale = torch.mm(grad_xi2.t(), squares_in)  # dL/d Var, finished in place below
    _cfbnn.finish_diagonal_gradients(grad_loc, grad_log_scale, loc, variance, kl_grad, -1.0, prior_variance, data_scale)
    return grad_loc, grad_log_scale


def _tail_pass(gamma, xi2, weights, y, loc, log_scale, log_precision, scale: float, bias, family, ahead: bool):
    """The tail pass's row sums and what :func:`_tail_backward` keeps of it: ``(mean_sum, spread_sum,
    kept)``; with ``ahead``, from ``cfbnn::relu_tail_with_gradients`` (its backward for the rows of
    ``scale sum_r ELL_r`` at a unit upstream gradient), else from ``cfbnn::relu_tail``."""
    if ahead:
        mean_sum, spread_sum, grad_gamma, grad_xi2, columns = _cfbnn.relu_tail_with_gradients(
            gamma, xi2, *weights, y, loc, log_precision, scale, bias, *family
        )
        return mean_sum, spread_sum, (grad_gamma, grad_xi2, loc, log_scale, log_precision, columns, None)
    mean_sum, spread_sum = _cfbnn.relu_tail(gamma, xi2, *weights, *family)
    return mean_sum, spread_sum, (gamma, xi2, loc, log_scale, log_precision, *weights[1:])


def _tail_and_rows(
    gamma,
    xi2,
    output_rows,
    loc,
    log_scale,
    y,
    log_precision,
    kl_terms,
    prior_variance,
    scale,
    bias,
    family,
    ahead=False,
):
    """The ELBO from the last hidden layer's pre-activations, the one-output layer's ``(Var, loc^2)``
    (``output_rows``, from :func:`_first_layer`) and ``kl_terms = (kl_sums, kl or None)``, the KL
    (``cfbnn::normal_elbo_rows``): the tail pass and the rows with the ELBO's sum; ``(elbo, saved)``,
    ``saved`` what :func:`_tail_backward` takes. With ``ahead`` (a gradient will be wanted) the tail
    pass also takes its backward at ``dL/d elbo = 1`` (``cfbnn::relu_tail_with_gradients``), from the
    moments it has just computed, so that the backward pass only scales."""
    width = gamma.shape[1]
    weights = tuple(_columns(row, width) for row in (loc, output_rows[1], output_rows[0]))
    mean_sum, spread_sum, kept = _tail_pass(
        gamma, xi2, weights, y, loc, log_scale, log_precision, scale, bias, family, ahead
    )
    residual, squares, elbo = _cfbnn.normal_elbo_rows(
        mean_sum, spread_sum, y, loc, log_scale, log_precision, *kl_terms, prior_variance, scale, bias
    )
    return elbo, (*kept, residual, squares)


class NormalELBO(torch.autograd.Function):
    """``scale * sum_n ELL_n - KL(hidden) - KL(output)`` (see the module doc) as one node."""

    @staticmethod
    @below_autograd
    def forward(
        ctx,
        x,
        y,
        log_precision,
        hidden_loc,
        hidden_log_scale,
        output_loc,
        output_log_scale,
        biases,
        prior_variance,
        scale,
        family=RELU,
    ):
        hidden_bias, output_bias = biases
        inputs, squares_in, hidden_variance, gamma, xi2, output_rows, kl_sums = _first_layer(
            x, hidden_loc, hidden_log_scale, hidden_bias, output_loc, output_log_scale
        )
        elbo, tail = _tail_and_rows(
            gamma,
            xi2,
            output_rows,
            output_loc,
            output_log_scale,
            y,
            log_precision,
            (kl_sums, None),
            prior_variance,
            scale,
            output_bias,
            family,
            any(ctx.needs_input_grad[2:7]),
        )
        ctx.save_for_backward(inputs, squares_in, hidden_loc, hidden_variance, *tail)
        ctx.output_bias, ctx.prior_variance, ctx.scale = output_bias, float(prior_variance), float(scale)
        ctx.family = family
        return elbo

    @staticmethod
    @first_order_only  # its kernels build no graph: a second order raises
    @below_autograd
    def backward(ctx, grad):
        inputs, squares_in, hidden_loc, hidden_variance, *tail = ctx.saved_tensors
        grad_gamma, grad_xi2, grad_output_loc, grad_output_log_scale, grad_log_precision, data_scale = _tail_backward(
            grad, False, ctx.scale, tail, grad, -1.0, ctx.prior_variance, ctx.output_bias, ctx.family
        )
        grad_hidden_loc, grad_hidden_log_scale = _first_layer_gradients(
            grad_gamma, grad_xi2, inputs, squares_in, hidden_loc, hidden_variance, grad, ctx.prior_variance, data_scale
        )
        return (
            None,
            None,
            grad_log_precision if ctx.needs_input_grad[2] else None,
            grad_hidden_loc,
            grad_hidden_log_scale,
            grad_output_loc,
            grad_output_log_scale,
            None,
            None,
            None,
            None,
        )


def normal_elbo(x, y, log_precision, hidden, output, prior_variance: float, scale: float, family=RELU) -> torch.Tensor:
    """The ELBO of :class:`NormalELBO`: ``x`` ``(N, D)``, ``y`` ``(N,)``, ``hidden`` and ``output``
    the two :class:`~cfbnn_cli.bnn.layers.GaussianMatrix` layers (diagonal q; the output layer of
    one row), ``family`` the activation's (:func:`~cfbnn_cli.moments.activations.family_of`)."""
    return NormalELBO.apply(
        x,
        y,
        log_precision,
        hidden.loc,
        hidden.log_scale,
        output.loc,
        output.log_scale,
        (bool(hidden.bias), bool(output.bias)),
        float(prior_variance),
        float(scale),
        family,
    )


class NormalELL(torch.autograd.Function):
    """``(ELL per row, KL)``: the last hidden layer's activation moments from its pre-activation means
    and variances ``(rows, H)``, a one-output layer integrated exactly and the Normal likelihood
    (eqs. (7)-(9)), the layer's KL folded in where a prior variance is given: forward, the KL pass
    (writing ``Var W`` and ``loc^2``), ``cfbnn::relu_tail`` and the rows; backward, the rows, the
    tail pass and the layer's gradients. With ``summed`` the caller promises one upstream gradient
    for every row (it sums the rows at once, as the ELBO does): where a gradient is wanted the
    forward pass then takes the tail pass's backward ahead (``cfbnn::relu_tail_with_gradients``),
    which the backward pass only scales."""

    @staticmethod
    @below_autograd
    def forward(ctx, gamma, xi2, loc, log_scale, y, log_precision, bias, prior_variance, family=RELU, summed=False):
        folded = prior_variance is not None
        width = gamma.shape[1]
        kl, weights = _output_layer_pass(loc, log_scale, width, prior_variance if folded else 1.0)
        ahead = summed and any(ctx.needs_input_grad[:6])
        mean_sum, spread_sum, kept = _tail_pass(
            gamma, xi2, weights, y, loc, log_scale, log_precision, 1.0, bias, family, ahead
        )
        residual, squares, ell = _cfbnn.normal_ell_rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias)
        ctx.save_for_backward(*kept, residual, squares)
        ctx.bias, ctx.prior_variance, ctx.family = bias, prior_variance, family
        if not folded:
            ctx.mark_non_differentiable(kl)
        return ell, kl

    @staticmethod
    @first_order_only  # its kernels build no graph: a second order raises
    @below_autograd
    def backward(ctx, grad_ell, grad_kl):
        saved = ctx.saved_tensors
        grad_ell = torch.zeros_like(saved[-1]) if grad_ell is None else grad_ell
        kl_on = ctx.prior_variance is not None and grad_kl is not None
        grad_gamma, grad_xi2, grad_loc, grad_log_scale, grad_log_precision, data_scale = _tail_backward(
            grad_ell,
            True,
            1.0,
            saved,
            grad_kl if kl_on else grad_ell,  # (not read where kl_sign is 0)
            1.0 if kl_on else 0.0,
            ctx.prior_variance if kl_on else 1.0,
            ctx.bias,
            ctx.family,
            grad_ell[:1],  # (summed: every row's gradient)
        )
        if data_scale is not None:  # taken ahead at a unit gradient: scaled by the rows' one gradient
            grad_gamma, grad_xi2 = torch._foreach_mul((grad_gamma, grad_xi2), data_scale.reshape(()))
        return (
            grad_gamma,
            grad_xi2,
            grad_loc,
            grad_log_scale,
            None,
            grad_log_precision if ctx.needs_input_grad[5] else None,
            None,
            None,
            None,
            None,
        )


def normal_ell(
    gamma, xi2, loc, log_scale, y, log_precision, bias: bool = True, prior_variance=None, family=RELU, summed=False
):
    """``(ELL per point, KL or None)`` of :class:`NormalELL` for pre-activation means and variances
    ``(..., N, H)`` and targets ``(..., N, 1)``, ``family`` the activation's (:func:`~cfbnn_cli.moments.activations.family_of`).
    ``summed``: the caller sums the points at once and differentiates only that sum (the ELBO);
    with no leading dimensions the node then takes the tail pass's backward ahead."""
    check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the argument checks activation.moments makes (if on)
    gamma, xi2 = torch.broadcast_tensors(gamma, xi2)
    lead, width = gamma.shape[:-1], gamma.shape[-1]
    targets = torch.broadcast_to(y, lead + (1,)).reshape(-1)
    rows = (gamma.reshape(-1, width), xi2.reshape(-1, width))
    folded_prior = None if prior_variance is None else float(prior_variance)
    summed = bool(summed) and len(lead) == 1  # one upstream gradient for every row
    ell, kl = NormalELL.apply(*rows, loc, log_scale, targets, log_precision, bool(bias), folded_prior, family, summed)
    return ell.reshape(lead), (kl if prior_variance is not None else None)
