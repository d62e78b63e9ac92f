"""The closed-form Normal likelihood terms of ReLU-family networks (ReLU, leaky ReLU, ReLU^2; one
Normal output), the bodies of the nodes ``cfbnn::normal_elbo`` and ``cfbnn::normal_ell`` (declared
in :mod:`.nodes`), the same code for the CPU and CUDA: every elementwise step is a ``cfbnn::``
operator (:mod:`cfbnn_cli.moments.elbo_ops`), whose kernel the dispatcher picks, the rest matrix
products.

**The whole ELBO** of a network whose every layer is integrated (one hidden layer under
``analytic``; any depth under ``deterministic``), paper eqs. (4), (7)-(9), (12), (20). Forward: one
pass for the input with its bias column and square, both outer layers' ``exp(2 log_scale)`` (and the
output layer's ``loc^2``) and their KL sums (``cfbnn::outer_layers_pass``), the first layer's
pre-activations (two matrix products); each later hidden layer's inputs' moments from their
variances (``cfbnn::relu_family_moments``) propagated through its weights ``W ~ N(M, S)``: ``gamma' =
[Phi, 1] M^T``, ``xi2' = [Upsilon, 1] S^T + Var (M o M)^T`` (its KL pass writing ``S`` and ``M o M``);
then the tail pass and the rows with the ELBO's sum, the KL finished there
(``cfbnn::normal_elbo_rows``). Where a gradient is wanted the tail pass also takes its backward at
``dL/d elbo = 1`` (``cfbnn::relu_tail_with_gradients``): the upstream gradient of an ELBO is one
number, so the backward pass only scales what the forward one found (``data_scale``), and the
activation's moments are evaluated once a step, not twice. Backward: the rows, the output layer's
gradients, the propagated layers in reverse and the first layer's gradients, each finished with its
KL's folded in (``cfbnn::finish_diagonal_gradients``). On CUDA a one-hidden-layer step is eleven
kernels (four of them matrix products; ``tests/test_kernel_count.py`` counts them).

**The tail** of any deeper network (the earlier layers sampled or propagated by the estimator): the
last hidden layer's activation moments from its pre-activation means and variances, a one-output
layer integrated exactly and the Normal likelihood, the layer's KL folded in where a prior variance
is given. With ``summed`` the caller promises one upstream gradient for every row (it sums the rows
at once, as the ELBO does): the tail pass's backward is then taken ahead, as above.
"""

from __future__ import annotations

from typing import Sequence

import torch

_cfbnn = torch.ops.cfbnn
_linear = torch.nn.functional.linear


def _columns(row: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` entries of a one-output layer's ``(1, width [+ 1])`` row as a 1-D view."""
    return row[0, :width]


def _output_layer_pass(loc, log_scale, width: int, prior_variance: float):
    """The one-output layer's KL pass: ``(KL, (w_phi, w_var, w_second))``, the tail pass's weights
    ``(loc, loc^2, Var W)`` of the first ``width`` columns written by the same pass."""
    kl, variance, loc_square = _cfbnn.diagonal_kl_pass(loc, log_scale, prior_variance, True)
    return kl, (_columns(loc, width), _columns(loc_square, width), _columns(variance, width))


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


def _tail_backward(grad, row_grads: bool, scale: float, saved, kl_grad, kl_sign: float, prior_variance, bias, family):
    """The backward pass the nodes share, from ``grad`` (``dL/d ELL`` per row with ``row_grads``,
    else one ``dL/d elbo`` for every row, times ``scale``): the rows, the tail pass and the
    one-output layer's gradients with ``dL/dKL = kl_sign kl_grad`` folded in. ``saved``: what
    :func:`_tail_pass` kept and the rows' ``(residual, squares)``; where the tail pass's gradients were
    taken ahead (at a unit upstream gradient) ``d gamma`` and ``d xi2`` are returned unscaled, with
    ``data_scale`` the factor to apply (``None`` otherwise). Returns ``(d gamma, d xi2, d loc, d
    log_scale, d log_precision, data_scale)``."""
    first, second, loc, log_scale, log_precision, w_var, w_second, residual, squares = saved
    row_u, row_k, sums, grad_log_precision = _cfbnn.normal_rows_backward(
        grad, residual, squares, log_precision, scale, row_grads
    )
    if w_second is None:  # taken ahead: the tail pass's gradients and column sums at dL/d elbo = 1
        grad_gamma, grad_xi2, columns = first, second, w_var
        data_scale = grad if not row_grads else grad[..., :1].reshape(grad.shape[:-1])  # (summed: one gradient)
    else:
        w_phi = _columns(loc, first.shape[-1])
        grad_gamma, grad_xi2, columns = _cfbnn.relu_tail_backward(
            first, second, w_phi, w_var, w_second, row_u, row_k, *family
        )
        data_scale = None
    grad_loc, grad_log_scale = _cfbnn.output_layer_gradients(
        columns, sums, loc, log_scale, kl_grad, kl_sign, prior_variance, bias, data_scale
    )
    return grad_gamma, grad_xi2, grad_loc, grad_log_scale, grad_log_precision, data_scale


def _scaled(tensor: torch.Tensor, data_scale) -> torch.Tensor:
    return tensor if data_scale is None else tensor * data_scale


# ----------------------------------------------------------------------------- the whole ELBO


def elbo_forward(ctx, x, y, log_precision, parameters: Sequence, biases, prior_variance, scale, family):
    """``scale * sum_n ELL_n - sum_l KL_l`` of a network of one or more hidden layers, every layer
    integrated (see the module doc); ``parameters`` each layer's ``(loc, log_scale)`` in order, the
    output layer's (one row) last, ``biases`` each layer's bias flag, ``family`` ``(activation,
    negative_slope)``."""
    locs, log_scales = parameters[0::2], parameters[1::2]
    prior_variance, scale = float(prior_variance), float(scale)
    inputs, squares_in, variance, output_variance, output_loc_square, kl_sums = _cfbnn.outer_layers_pass(
        x, locs[0], log_scales[0], locs[-1], log_scales[-1], biases[0]
    )
    # linear(a, w) is mm(a, w^T) with the transpose taken in C++: one Python call a product, not two
    gamma, xi2 = _linear(inputs, locs[0]), _linear(squares_in, variance)
    propagated = []  # per later hidden layer: its inputs' pre-activations, moments and weights
    hidden_kl = None  # the KL of the layers between the first and the output layer
    for loc, log_scale, bias in zip(locs[1:-1], log_scales[1:-1], biases[1:-1]):
        # the family's moments from the variances: the square root inside the kernel
        phi, ups, var_h = _cfbnn.relu_family_moments(gamma, xi2, *family, True)
        kl, layer_variance, loc_square = _cfbnn.diagonal_kl_pass(loc, log_scale, prior_variance, True)
        width = phi.shape[1]
        phi_in, ups_in = (torch.nn.functional.pad(t, (0, 1), value=1.0) if bias else t for t in (phi, ups))
        next_gamma = torch.mm(phi_in, loc.t())
        next_xi2 = torch.mm(ups_in, layer_variance.t()).addmm_(var_h, loc_square[:, :width].t())
        propagated.append((gamma, xi2, phi, phi_in, ups_in, var_h, layer_variance, loc_square))
        hidden_kl = kl if hidden_kl is None else hidden_kl + kl
        gamma, xi2 = next_gamma, next_xi2
    width = gamma.shape[1]
    weights = (_columns(locs[-1], width), _columns(output_loc_square, width), _columns(output_variance, width))
    ahead = ctx is not None and any(ctx.wants)  # a gradient will be wanted: the tail pass's backward now
    mean_sum, spread_sum, kept = _tail_pass(
        gamma, xi2, weights, y, locs[-1], log_scales[-1], log_precision, scale, biases[-1], family, ahead
    )
    residual, squares, elbo = _cfbnn.normal_elbo_rows(
        mean_sum, spread_sum, y, locs[-1], log_scales[-1], log_precision, kl_sums, hidden_kl, prior_variance, scale,
        biases[-1],
    )  # fmt: skip
    if ctx is not None:
        flat = [t for layer in propagated for t in layer]
        ctx.save_for_backward(x, inputs, squares_in, variance, *flat, *kept, residual, squares, *locs)
        ctx.layers, ctx.biases, ctx.family = len(propagated), tuple(biases), tuple(family)
        ctx.prior_variance, ctx.scale = prior_variance, scale
    return elbo


def elbo_backward(ctx, grad):
    """The gradients of :func:`elbo_forward`'s tensors: ``x``, ``y``, ``log_precision``, each layer's
    ``loc`` and ``log_scale``."""
    saved = ctx.saved_tensors
    x, inputs, squares_in, first_variance = saved[:4]
    end = 4 + 8 * ctx.layers
    propagated = [saved[start : start + 8] for start in range(4, end, 8)]
    tail, locs = saved[end : end + 9], saved[end + 9 :]
    pv, biases = ctx.prior_variance, ctx.biases
    # with the tail pass's backward taken ahead every data-term gradient below is at dL/d elbo = 1
    # (the chain is linear in it): the steps that finish each layer's gradients scale by data_scale
    grad_gamma, grad_xi2, grad_output_loc, grad_output_log_scale, grad_log_precision, data_scale = _tail_backward(
        grad, False, ctx.scale, tail, grad, -1.0, pv, biases[-1], ctx.family
    )
    grads = [grad_output_loc, grad_output_log_scale]
    for index in range(len(propagated) - 1, -1, -1):
        gamma, xi2, phi, phi_in, ups_in, var_h, variance, loc_square = propagated[index]
        loc, width = locs[index + 1], phi.shape[1]
        grad_loc = torch.mm(grad_gamma.t(), phi_in)
        # d xi2'/d M = 2 M Var: on the weights, not the bias column (its inputs have no variance)
        grad_loc[:, :width].addcmul_(loc[:, :width], torch.mm(grad_xi2.t(), var_h), value=2.0)
        grad_variance = torch.mm(grad_xi2.t(), ups_in)  # dL/d S, made dL/d log_scale below
        _cfbnn.finish_diagonal_gradients(grad_loc, grad_variance, loc, variance, grad, -1.0, pv, data_scale)
        grads = [grad_loc, grad_variance, *grads]
        grad_phi = torch.mm(grad_gamma, loc[:, :width])
        grad_ups = torch.mm(grad_xi2, variance[:, :width])
        grad_var = torch.mm(grad_xi2, loc_square[:, :width])
        grad_gamma, grad_xi2 = _cfbnn.relu_family_moments_backward(
            gamma, xi2, phi, grad_phi, grad_ups, grad_var, *ctx.family, True
        )
    grad_first_loc = torch.mm(grad_gamma.t(), inputs)
    grad_first_log_scale = torch.mm(grad_xi2.t(), squares_in)  # dL/d Var, finished in place below
    _cfbnn.finish_diagonal_gradients(
        grad_first_loc, grad_first_log_scale, locs[0], first_variance, grad, -1.0, pv, data_scale
    )
    grad_x = None
    if ctx.wants[0]:  # x's own gradient: d gamma / dx = M, d xi2 / dx = 2 x S (the bias column's aside)
        width = x.shape[-1]
        grad_x = torch.addcmul(grad_gamma @ locs[0][:, :width], x, grad_xi2 @ first_variance[:, :width], value=2.0)
        grad_x = _scaled(grad_x, data_scale)
    return (grad_x, None, grad_log_precision if ctx.wants[2] else None, grad_first_loc, grad_first_log_scale, *grads)


# ----------------------------------------------------------------------------- the tail


def ell_forward(ctx, gamma, xi2, loc, log_scale, y, log_precision, bias, prior_variance, activation, slope, summed):
    """``(ELL per row, KL or empty)`` from the last hidden layer's pre-activation means and variances
    ``(rows, H)`` (see the module doc)."""
    folded = prior_variance is not None
    family = (activation, slope)
    width = gamma.shape[1]
    kl, weights = _output_layer_pass(loc, log_scale, width, float(prior_variance) if folded else 1.0)
    ahead = summed and ctx is not None and any(ctx.wants[:6])
    mean_sum, spread_sum, kept = _tail_pass(
        gamma, xi2, weights, y, loc, log_scale, log_precision, 1.0, bias, family, ahead
    )
    residual, squares, ell = _cfbnn.normal_ell_rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias)
    if ctx is not None:
        ctx.save_for_backward(*kept, residual, squares)
        ctx.bias, ctx.prior_variance, ctx.family = bias, prior_variance, family
    return ell, kl if folded else kl.new_empty(0)


def ell_backward(ctx, grad_ell, grad_kl):
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
    )
    if data_scale is not None:  # taken ahead at a unit gradient: scaled by the rows' one gradient
        grad_gamma, grad_xi2 = grad_gamma * data_scale, grad_xi2 * data_scale
    grad_log_precision = grad_log_precision if ctx.wants[5] else None
    return grad_gamma, grad_xi2, grad_loc, grad_log_scale, None, grad_log_precision, None, None, None, None, None
