"""The reference kernels of the closed-form ELBO's operators (:mod:`.elbo_ops`): the torch formulas
that run where neither the C++ library nor Triton does (a CPU without a compiler, any other
device), and the oracle the C++ and Triton kernels are tested against
(``tests/moments/test_elbo_ops.py``). Same arguments and results as the operators; sums in
float64, as the kernels add them. The backward steps also take a leading batch dimension (their
vmap rules call them with one).

A KL sums table (:func:`kl_block_sums`) holds a layer's KL as float64 rows, one per block of
:data:`KL_BLOCK` elements, that add up to what the KL needs: ``(sum (Var + loc^2), sum log_scale,
count)``; several layers' rows (one prior) add up to the sum of their KLs (:func:`kl_from_table`).
The device kernels write the blocks' rows in parallel, and the step that reads the KL finishes it.

Paper eq. (4) (the ELBO and its KL terms), eq. (7) (the Normal likelihood's rows), eq. (12) (the
first layer's inputs and their squares).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from .relu_family import family_moments_vjp

LOG_2PI = math.log(2.0 * math.pi)
KL_BLOCK = 1024  # the elements of a layer whose KL sums make one row of a KL sums table


def augment_pair(x: Tensor, bias: bool):
    """``([x, 1], [x^2, 1])`` (``(x, x^2)`` without ``bias``)."""
    inputs = torch.nn.functional.pad(x, (0, 1), value=1.0) if bias else x.clone()
    return inputs, inputs * inputs


def kl_from_sums(second_moment: Tensor, log_scale_sum: Tensor, count: int, prior_variance) -> Tensor:
    """``KL(N(loc, diag Var) || N(0, s^2 I))`` from ``sum (Var + loc^2)`` and ``sum log_scale``;
    ``prior_variance`` a number, or a tensor the KL is differentiable in (an empirical-Bayes prior)."""
    if isinstance(prior_variance, Tensor):
        log_prior = torch.log(prior_variance)
    else:
        log_prior = math.log(prior_variance)
    return 0.5 * (second_moment / prior_variance - count + count * log_prior) - log_scale_sum


def diagonal_kl(loc: Tensor, log_scale: Tensor, prior_variance) -> Tensor:
    """``KL(N(loc, diag exp(2 log_scale)) || N(0, prior_variance I))`` summed over the matrix (0-d),
    straight from ``log_scale``; differentiable, in ``prior_variance`` too where it is a tensor."""
    return diagonal_kl_pass(loc, log_scale, prior_variance, False)[0]


def kl_gradients(loc: Tensor, log_scale: Tensor, grad, prior_variance: float):
    """The KL's gradients for ``grad = dL/dKL``: ``(grad / s^2 loc, grad / s^2 exp(2 log_scale) -
    grad)``; differentiable, and batched where ``grad`` broadcasts against ``loc``."""
    scaled = grad / prior_variance
    return scaled * loc, scaled * torch.exp(2.0 * log_scale) - grad


def kl_block_sums(loc: Tensor, log_scale: Tensor) -> Tensor:
    """A layer's rows of a KL sums table (float64 ``(blocks, 3)``): per block of :data:`KL_BLOCK`
    elements (in memory order, the last one partial) ``(sum (Var + loc^2), sum log_scale, count)``."""
    count = loc.numel()
    pad = -count % KL_BLOCK
    blocks = [torch.nn.functional.pad(t.reshape(-1).double(), (0, pad)).reshape(-1, KL_BLOCK) for t in (loc, log_scale)]
    inside = torch.nn.functional.pad(torch.ones(count, dtype=torch.float64, device=loc.device), (0, pad))
    inside = inside.reshape(-1, KL_BLOCK)
    second = ((torch.exp(2.0 * blocks[1]) + blocks[0].square()) * inside).sum(1)
    return torch.stack([second, blocks[1].sum(1), inside.sum(1)], 1)


def kl_from_table(kl_sums: Tensor, prior_variance: float) -> Tensor:
    """The KL (float64, 0-d) of the layers whose rows make the KL sums table ``kl_sums``
    (:func:`kl_block_sums`; one prior for all)."""
    second, log_scale_sum, count = kl_sums.sum(0).unbind()
    return kl_from_sums(second, log_scale_sum, count, prior_variance)


def outer_layers_pass(x: Tensor, loc: Tensor, log_scale: Tensor, output_loc: Tensor, output_log_scale: Tensor, bias):
    """``([x, 1], [x^2, 1], exp(2 log_scale), exp(2 output_log_scale), output_loc^2, kl_sums)``: what
    the first layer and the one-output layer give the ELBO before the matrix products, the KL
    sums table both layers' rows (the first layer's first)."""
    inputs, squares = augment_pair(x, bias)
    kl_sums = torch.cat([kl_block_sums(loc, log_scale), kl_block_sums(output_loc, output_log_scale)])
    variances = (torch.exp(2.0 * log_scale), torch.exp(2.0 * output_log_scale))
    return inputs, squares, *variances, output_loc * output_loc, kl_sums


def diagonal_kl_pass(loc: Tensor, log_scale: Tensor, prior_variance: float, loc_square: bool):
    """``(KL, exp(2 log_scale), loc^2 or an empty tensor)``."""
    variance = torch.exp(2.0 * log_scale)
    second_moment = variance.sum(dtype=torch.float64) + loc.square().sum(dtype=torch.float64)
    kl = kl_from_sums(second_moment, log_scale.sum(dtype=torch.float64), loc.numel(), prior_variance)
    return kl.to(loc.dtype), variance, (loc * loc if loc_square else loc.new_empty(0))


def residuals(mean_sum, y, loc, bias: bool):
    """``y - mean_sum - b`` per row, ``b`` the one-output layer's bias (the last column of ``loc``,
    with ``bias``)."""
    mean = mean_sum + loc.reshape(-1)[-1] if bias else mean_sum
    return y.reshape(mean_sum.shape) - mean


def _rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias: bool):
    """``(residual, squares, ELL)`` per row (eq. (7)), the one-output layer's bias column included."""
    spread = spread_sum + torch.exp(2.0 * log_scale.reshape(-1)[-1]) if bias else spread_sum
    residual = residuals(mean_sum, y, loc, bias)
    squares = spread + residual * residual
    log_beta = log_precision.reshape(())
    ell = squares * (-0.5 * torch.exp(log_beta)) + 0.5 * (log_beta - LOG_2PI)
    return residual, squares, ell


def normal_ell_rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias: bool):
    return _rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias)


def normal_elbo_rows(
    mean_sum, spread_sum, y, loc, log_scale, log_precision, kl_sums, kl, prior_variance: float, scale: float, bias
):
    """The rows and ``scale sum_r ELL_r - KL`` (eq. (4)), the KL that of the KL sums table
    ``kl_sums`` (:func:`kl_from_table`) plus ``kl`` where given."""
    residual, squares, ell = _rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias)
    total_kl = kl_from_table(kl_sums, prior_variance)
    if kl is not None:
        total_kl = total_kl + kl.double().reshape(())
    elbo = scale * ell.sum(dtype=torch.float64) - total_kl
    return residual, squares, elbo.to(mean_sum.dtype).reshape(())


def normal_rows_backward(grad, residual, squares, log_precision, scale: float, row_grads: bool):
    """``(u, k, sums, d log_precision)``: ``u = g beta residual``, ``k = -g beta / 2`` per row and
    ``sums = (sum u, sum k, sum g (1/2 - beta/2 squares))`` (float64); the rows are the last dimension
    (``grad`` one number per leading index where not ``row_grads``)."""
    per_row = grad * scale if row_grads else (grad.reshape(*grad.shape, 1) * scale).expand_as(residual)
    beta = torch.exp(log_precision.reshape(()))
    row_u = residual * per_row * beta
    row_k = per_row * (-0.5 * beta)
    log_term = per_row.double() * (0.5 - 0.5 * beta.double() * squares.double())
    sums = torch.stack([row_u.sum(-1, dtype=torch.float64), row_k.sum(-1, dtype=torch.float64), log_term.sum(-1)], -1)
    grad_log_precision = sums[..., 2].to(log_precision.dtype)
    return row_u, row_k, sums, grad_log_precision.reshape(grad_log_precision.shape + log_precision.shape)


def _finish(grad_loc, grad_variance, loc, variance, kl_grad, kl_sign: float, prior_variance: float):
    """``dL/d Var`` of the data term into ``dL/d log_scale`` (``d Var / d log_scale = 2 Var``), the
    KL's gradient folded in with ``dL/dKL = kl_sign kl_grad``: returns the finished pair."""
    if kl_sign != 0.0:  # (one number, or one per leading index: [..., None, None])
        kl = kl_sign * kl_grad.reshape(kl_grad.shape[: grad_loc.dim() - loc.dim()])[..., None, None]
    else:
        kl = torch.zeros((), dtype=loc.dtype, device=loc.device)
    scaled = kl / prior_variance
    return grad_loc + scaled * loc, variance * (2.0 * grad_variance + scaled) - kl


def output_layer_gradients(
    columns, sums, loc, log_scale, kl_grad, kl_sign: float, prior_variance: float, bias: bool, data_scale=None
):
    """The one-output layer's ``(d loc, d log_scale)`` from the tail pass's column sums (float64 ``(3,
    H)``: ``sum u Phi``, ``sum k Var``, ``sum k Upsilon``; times ``data_scale`` where given) and the
    rows' ``sums`` (both with a leading batch dimension where a vmap rule gives one)."""
    width, lead = columns.shape[-1], columns.shape[:-2]
    if data_scale is not None:
        columns = columns * data_scale.double().reshape(lead + (1, 1))
    w_phi = loc.reshape(-1)[:width].double()
    grad_loc = columns[..., 0, :] + 2.0 * w_phi * columns[..., 1, :]
    grad_variance = columns[..., 2, :]
    if bias:
        grad_loc = torch.cat([grad_loc, sums[..., :1]], -1)
        grad_variance = torch.cat([grad_variance, sums[..., 1:2]], -1)
    grad_loc = grad_loc.to(loc.dtype).reshape(lead + loc.shape)
    grad_variance = grad_variance.to(loc.dtype).reshape(lead + loc.shape)
    return _finish(grad_loc, grad_variance, loc, torch.exp(2.0 * log_scale), kl_grad, kl_sign, prior_variance)


def finish_diagonal_gradients(
    grad_loc, grad_variance, loc, variance, kl_grad, kl_sign: float, prior_variance: float, data_scale=None
):
    """In place: ``grad_loc += dL/dKL loc / s^2``, ``grad_variance <- 2 Var grad_variance + dL/dKL
    (Var / s^2 - 1)``, the data term's ``grad_loc`` and ``grad_variance`` first multiplied by
    ``data_scale`` where given."""
    if not (grad_loc.is_contiguous() and grad_variance.is_contiguous()):  # as the kernels refuse them
        raise ValueError("cfbnn::finish_diagonal_gradients: the gradients it finishes in place must be contiguous")
    data = (grad_loc, grad_variance)
    if data_scale is not None:
        data = tuple(t * data_scale.reshape(data_scale.shape[: t.dim() - loc.dim()] + (1,) * loc.dim()) for t in data)
    finished_loc, finished_variance = _finish(*data, loc, variance, kl_grad, kl_sign, prior_variance)
    grad_loc.copy_(finished_loc)
    grad_variance.copy_(finished_variance)


# ----------------------------------------------------------------------------- the tail pass


def _family_moments(mean, variance, activation: int, negative_slope: float):
    """``(Phi, Upsilon, Var)`` of ``activation`` from the pre-activations' variances through the
    family's operator, differentiable to any order."""
    return torch.ops.cfbnn.relu_family_moments(mean, variance, activation, float(negative_slope), True)


def relu_tail(mean, variance, weight_phi, weight_variance, weight_second, activation: int = 0, negative_slope=0.0):
    """``cfbnn::relu_tail``'s two row sums from the activation's moments (any leading batch
    dimensions; differentiable to any order)."""
    phi, ups, var = _family_moments(mean, variance, activation, negative_slope)
    return (phi * weight_phi).sum(-1), (var * weight_variance + ups * weight_second).sum(-1)


def relu_tail_vjp(
    mean, variance, weight_phi, weight_variance, weight_second, row_u, row_k, activation: int = 0, negative_slope=0.0
) -> Tuple[Tensor, Tensor, Tensor]:
    """``cfbnn::relu_tail_backward``'s vector-Jacobian product in differentiable ops (the weights may
    carry a batch dimension before the rows'): ``(d mean, d variance, columns)``, ``columns`` the
    weights' gradients ``(sum_r u_r Phi_rc, sum_r k_r Var_rc, sum_r k_r Upsilon_rc)``."""
    u, k = row_u.unsqueeze(-1), row_k.unsqueeze(-1)
    grads = (u * weight_phi, k * weight_second, k * weight_variance)
    phi, ups, var = _family_moments(mean, variance, activation, negative_slope)
    grad_mean, grad_variance = family_moments_vjp(mean, variance, phi, *grads, activation, negative_slope, True)
    rows = mean.dim() - 2  # the rows' dimension, batch dimensions kept
    columns = torch.stack([(u * phi).sum(rows), (k * var).sum(rows), (k * ups).sum(rows)], -2)
    return grad_mean, grad_variance, columns


def unit_row_gradients(mean_sum, y, loc, log_precision, scale: float, bias: bool):
    """The Normal likelihood's row gradients at ``dL/d ELBO = 1`` (``cfbnn::normal_rows_backward``'s
    ``u = scale tau residual``, ``k = -scale tau / 2``), the residual as ``cfbnn::normal_elbo_rows``
    takes it: ``y - mean_sum - b``, ``b`` the one-output layer's bias column of ``loc``."""
    residual = residuals(mean_sum, y, loc, bias)
    unit = scale * torch.exp(log_precision.reshape(()))
    return unit * residual, (-0.5 * unit).expand_as(residual)


def relu_tail_with_gradients(
    mean, variance, w_phi, w_var, w_second, y, loc, log_precision, scale, bias, activation=0, slope=0.0
):
    """``cfbnn::relu_tail_with_gradients``: :func:`relu_tail`'s row sums and the vector-Jacobian
    product for the rows' gradients at ``dL/d ELBO = 1``."""
    weights = (w_phi, w_var, w_second)
    with torch.no_grad():
        mean_sum, spread_sum = relu_tail(mean, variance, *weights, activation, slope)
        row_u, row_k = unit_row_gradients(mean_sum, y, loc, log_precision, scale, bias)
        grads = relu_tail_vjp(mean, variance, *weights, row_u, row_k, activation, slope)
    return mean_sum, spread_sum, grads[0], grads[1], grads[2].double()


KERNELS = {
    "augment_pair": augment_pair,
    "outer_layers_pass": outer_layers_pass,
    "diagonal_kl_pass": diagonal_kl_pass,
    "normal_ell_rows": normal_ell_rows,
    "normal_elbo_rows": normal_elbo_rows,
    "normal_rows_backward": normal_rows_backward,
    "output_layer_gradients": output_layer_gradients,
    "finish_diagonal_gradients": finish_diagonal_gradients,
    "relu_tail_with_gradients": relu_tail_with_gradients,
}
