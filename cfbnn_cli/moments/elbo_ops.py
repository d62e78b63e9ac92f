"""The closed-form Normal ELBO's operators, each declared once here (:mod:`.operators`): schema,
reference kernel (:mod:`.elbo_reference`), fake, Triton launch (CUDA: :mod:`.triton_tail_kernels`,
:mod:`.triton_kl_kernels`), vmap rule and, for the differentiable ones, autograd. Their C++ CPU
kernels are ``csrc/elbo_ops.cpp``. The nodes of ``bnn/fused`` compose them (paper eqs. (4),
(7)-(9), (12), one Normal output):

``cfbnn::diagonal_kl(Tensor loc, Tensor log_scale, float prior_variance) -> Tensor``
    ``KL(N(loc, diag exp(2 log_scale)) || N(0, prior_variance I))``, one pass, float64 sums;
    ``cfbnn::diagonal_kl_backward(loc, log_scale, grad, prior_variance) -> (grad_loc, grad_log_scale)``.
``cfbnn::relu_tail(Tensor mean, Tensor variance, Tensor weight_phi, Tensor weight_variance, Tensor weight_second, SymInt activation=0, float negative_slope=0.) -> (Tensor mean_sum, Tensor spread_sum)``
    the last hidden layer's tail pass: from pre-activation means and variances ``(rows, H)`` the two
    row sums one integrated output needs, ``mean_sum_r = sum_c Phi_rc w_phi_c`` and ``spread_sum_r =
    sum_c Var_rc w_var_c + Upsilon_rc w_second_c`` (``Phi``, ``Upsilon``, ``Var`` of the ReLU family's
    ``activation``, computed and reduced at once, never written); with the output weights' mean ``m``
    and variance ``v``, ``w_phi = m``, ``w_var = m^2``, ``w_second = v`` give the output's mean and
    variance. ``cfbnn::relu_tail_backward(..., grad_mean_sum, grad_spread_sum, ...) -> (grad_mean,
    grad_variance, columns)``, ``columns`` ``(3, H)`` float64: the weights' gradients.
``cfbnn::augment_pair(Tensor x, bool bias) -> (Tensor inputs, Tensor squares)``
    ``([x, 1], [x^2, 1])`` (``(x, x^2)`` without ``bias``) of an ``(N, D)`` input, one pass.
``cfbnn::outer_layers_pass(x, loc, log_scale, output_loc, output_log_scale, bool bias) -> (inputs, squares, variance, output_variance, output_loc_square, kl_sums)``
    one pass over the first layer and the one-output layer: ``augment_pair``'s two results, both
    layers' ``exp(2 log_scale)``, the output layer's ``loc^2`` and both layers' KL sums table
    (float64 ``(blocks, 3)``, :func:`~.elbo_reference.kl_block_sums`), which the rows finish.
``cfbnn::diagonal_kl_pass(Tensor loc, Tensor log_scale, float prior_variance, bool loc_square) -> (kl, variance, loc_square)``
    a layer's KL with ``exp(2 log_scale)`` and, with ``loc_square``, ``loc^2`` from the same pass.
``cfbnn::normal_ell_rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, bool bias) -> (residual, squares, ell)``
    per row ``residual = y - mean_sum - b``, ``squares = spread_sum + Var b + residual^2``, ``ELL =
    log(tau)/2 - log(2 pi)/2 - tau/2 squares`` (eq. (7); ``b`` the output layer's bias column).
``cfbnn::normal_elbo_rows(..., Tensor kl_sums, Tensor? kl, float prior_variance, float scale, bool bias) -> (residual, squares, elbo)``
    the same rows and ``elbo = scale sum_r ELL_r - KL`` (eq. (4)), the rows summed in float64, the KL
    that of the table plus ``kl`` where given.
``cfbnn::normal_rows_backward(grad, residual, squares, log_precision, float scale, bool row_grads) -> (row_u, row_k, sums, grad_log_precision)``
    from ``g_r = scale dL/d ELL_r``: ``u = g tau residual``, ``k = -g tau / 2`` and their sums.
``cfbnn::output_layer_gradients(columns, sums, loc, log_scale, kl_grad, float kl_sign, float prior_variance, bool bias, Tensor? data_scale=None) -> (grad_loc, grad_log_scale)``
    the one-output layer's gradients, its KL's folded in with ``dL/dKL = kl_sign kl_grad``.
``cfbnn::finish_diagonal_gradients(Tensor(a!) grad_loc, Tensor(b!) grad_variance, loc, variance, kl_grad, float kl_sign, float prior_variance, Tensor? data_scale=None) -> ()``
    in place: a layer's ``dL/d loc`` and ``dL/d Var`` become ``dL/d loc`` and ``dL/d log_scale`` with
    the KL's gradient folded in, the data term's first multiplied by ``data_scale`` where given.
``cfbnn::relu_tail_with_gradients(mean, variance, w_phi, w_var, w_second, y, loc, log_precision, float scale, bool bias, int activation=0, float negative_slope=0.0) -> (mean_sum, spread_sum, grad_mean, grad_variance, columns)``
    ``relu_tail``'s sums and, from the same moments, ``relu_tail_backward``'s results for the rows'
    gradients at ``dL/d elbo = 1``: an ELBO's upstream gradient is one number, so its backward pass
    only scales these instead of evaluating the activation's moments again.

The steps (all but the KL and the tail pass) are not differentiable: the nodes call them below
autograd, their backward passes call the backward steps.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

from . import elbo_reference
from .moment_ops import slope_operand
from .operators import LazyModule, Operator, batch_first, check_operands, define, differentiable_by_formula
from .relu_family import check_activation, variance_floor

triton = LazyModule("triton")
triton_kernels = LazyModule(f"{__package__}.triton_kernels")
triton_tail_kernels = LazyModule(f"{__package__}.triton_tail_kernels")
triton_kl_kernels = LazyModule(f"{__package__}.triton_kl_kernels")

_ROWS_BLOCK = 1024
KL_BLOCK = elbo_reference.KL_BLOCK  # the blocks of a KL sums table: one program each

# ----------------------------------------------------------------------------- a matrix's KL


def _check_kl(name: str, loc: Tensor, log_scale: Tensor, prior_variance: float) -> None:
    check_operands(name, loc, log_scale)
    if not prior_variance > 0:
        raise ValueError(f"cfbnn::{name}: `prior_variance` must be > 0; got {prior_variance!r}")


def triton_diagonal_kl(loc: Tensor, log_scale: Tensor, prior_variance: float) -> Tensor:
    """The Triton forward: one launch for the blocks' float64 sums, then their sum in block order."""
    _check_kl("diagonal_kl", loc, log_scale, prior_variance)
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
    _check_kl("diagonal_kl_backward", loc, log_scale, prior_variance)
    loc, log_scale, grad = loc.contiguous(), log_scale.contiguous(), grad.reshape(1).contiguous()
    grad_loc, grad_log_scale = torch.empty_like(loc), torch.empty_like(loc)
    n = loc.numel()
    triton_kl_kernels.diagonal_kl_backward_kernel[triton_kernels.grid(n)](
        loc, log_scale, grad, grad_loc, grad_log_scale, n, float(prior_variance), BLOCK=triton_kernels.BLOCK
    )
    return grad_loc, grad_log_scale


def _kl_reference(loc: Tensor, log_scale: Tensor, prior_variance: float) -> Tensor:
    _check_kl("diagonal_kl", loc, log_scale, prior_variance)
    return elbo_reference.diagonal_kl(loc, log_scale, prior_variance)


def _kl_backward_reference(loc: Tensor, log_scale: Tensor, grad: Tensor, prior_variance: float):
    _check_kl("diagonal_kl_backward", loc, log_scale, prior_variance)
    with torch.no_grad():
        return elbo_reference.kl_gradients(loc, log_scale, grad, prior_variance)


def _kl_setup(ctx, inputs, output):
    loc, log_scale, ctx.prior_variance = inputs
    ctx.save_for_backward(loc, log_scale)


def _kl_backward(ctx, grad):
    loc, log_scale = ctx.saved_tensors
    return (*diagonal_kl_backward(loc, log_scale, grad, ctx.prior_variance), None)


def _kl_vmap(info, in_dims, loc, log_scale, prior_variance):
    # one KL per batch entry, in batched torch ops (the same float64 sums)
    loc, log_scale = batch_first(info, in_dims[:2], loc, log_scale)
    rows = [t.reshape(t.shape[0], -1).double() for t in (loc, log_scale)]
    sums = (torch.exp(2.0 * rows[1]).sum(1), rows[0].square().sum(1), rows[1].sum(1))
    kl = elbo_reference.kl_from_sums(sums[0] + sums[1], sums[2], rows[0].shape[1], prior_variance)
    return kl.to(loc.dtype), 0


def _kl_backward_vmap(info, in_dims, loc, log_scale, grad, prior_variance):
    loc, log_scale, grad = batch_first(info, in_dims[:3], loc, log_scale, grad)
    grad = grad.reshape(grad.shape[0], *([1] * (loc.dim() - 1)))
    return elbo_reference.kl_gradients(loc, log_scale, grad, prior_variance), (0, 0)


diagonal_kl_backward = define(
    Operator(
        "diagonal_kl_backward(Tensor loc, Tensor log_scale, Tensor grad, float prior_variance) -> (Tensor, Tensor)",
        _kl_backward_reference,
        lambda loc, *_: (torch.empty_like(loc), torch.empty_like(loc)),
        cuda=triton_diagonal_kl_backward,
        **differentiable_by_formula(elbo_reference.kl_gradients, 3),
        vmap=_kl_backward_vmap,
    )
)
diagonal_kl = define(
    Operator(
        "diagonal_kl(Tensor loc, Tensor log_scale, float prior_variance) -> Tensor",
        _kl_reference,
        lambda loc, *_: loc.new_empty(()),
        cuda=triton_diagonal_kl,
        setup_context=_kl_setup,
        backward=_kl_backward,
        vmap=_kl_vmap,
    )
)

# ----------------------------------------------------------------------------- the tail pass


def _check_tail(name: str, mean: Tensor, variance: Tensor, *weights: Tensor, activation: int = 0) -> None:
    check_activation(name, activation)
    check_operands(name, mean, variance)
    if mean.dim() != 2:
        raise ValueError(f"cfbnn::{name}: `mean` and `variance` must be (rows, H); got shape {tuple(mean.shape)}")
    for weight in weights:
        if weight.shape != mean.shape[1:] or weight.dtype != mean.dtype:
            raise ValueError(
                f"cfbnn::{name}: each weight must be ({mean.shape[1]},) of dtype {mean.dtype}; "
                f"got {tuple(weight.shape)} {weight.dtype}"
            )


def _check_tail_backward(mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum, activation=0):
    _check_tail("relu_tail_backward", mean, variance, w_phi, w_var, w_second, activation=activation)
    _check_rows("relu_tail_backward", mean, grad_mean_sum, grad_spread_sum)


def _check_rows(name: str, mean: Tensor, *row_grads: Tensor) -> None:
    for grad in row_grads:
        if grad.shape != mean.shape[:1] or grad.dtype != mean.dtype:
            raise ValueError(
                f"cfbnn::{name}: the row gradients must be ({mean.shape[0]},) of dtype {mean.dtype}; "
                f"got {tuple(grad.shape)} {grad.dtype}"
            )


def _tail_operands(mean, variance, weights, activation: int, negative_slope: float):
    """The Triton kernels' ``tail`` tuple (:mod:`.triton_tail_kernels`): the means, variances and
    three weights, contiguous, and the slope operand; with ``(rows, width)`` and the launch's
    constants ``(FLOOR, CF_DEPTH, ACTIVATION)``."""
    mean, variance = mean.contiguous(), variance.contiguous()
    tail = (mean, variance, *(w.contiguous() for w in weights), slope_operand(mean, activation, negative_slope))
    constants = (variance_floor(mean.dtype), triton_kernels.cf_depth(mean.dtype), activation)
    return tail, mean.shape, constants


def triton_relu_tail(
    mean, variance, weight_phi, weight_variance, weight_second, activation: int = 0, negative_slope: float = 0.0
) -> Tuple[Tensor, Tensor]:
    """The Triton forward on ``mean``'s device (CUDA; the CPU in the tests' CUDA twin)."""
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail("relu_tail", mean, variance, *weights, activation=activation)
    tail, (rows, width), (floor, depth, kind) = _tail_operands(mean, variance, weights, activation, negative_slope)
    sums = (mean.new_empty(rows), mean.new_empty(rows))
    block_r, block_c = triton_tail_kernels.FORWARD_ROWS, triton_tail_kernels.FORWARD_COLUMNS
    unread = tail[0]  # the likelihood's operands and the gradients' outputs, which the forward alone skips
    triton_tail_kernels.relu_tail_kernel[(triton.cdiv(max(rows, 1), block_r),)](
        tail, sums, *(unread,) * 6, rows, width, 1.0, floor, block_r, block_c, depth, kind, False, False
    )
    return sums


def triton_relu_tail_backward(
    mean, variance, weight_phi, weight_variance, weight_second, row_u, row_k, activation: int = 0, negative_slope=0.0
):
    """The Triton vector-Jacobian product: one launch over ``(row block, column block)`` tiles,
    then the tiles' float64 column sums added over the row blocks."""
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail_backward(mean, variance, *weights, row_u, row_k, activation)
    tail, (rows, width), (floor, depth, kind) = _tail_operands(mean, variance, weights, activation, negative_slope)
    block_r, block_c = triton_tail_kernels.BACKWARD_ROWS, triton_tail_kernels.BACKWARD_COLUMNS
    row_blocks = triton.cdiv(max(rows, 1), block_r)
    grad_mean, grad_variance = torch.empty_like(tail[0]), torch.empty_like(tail[0])
    # every entry is written: each tile stores its columns' three sums for its row block
    partial = torch.empty(row_blocks, 3, width, dtype=torch.float64, device=mean.device)
    triton_tail_kernels.relu_tail_backward_kernel[(row_blocks, triton.cdiv(max(width, 1), block_c))](
        tail, row_u.contiguous(), row_k.contiguous(), grad_mean, grad_variance, partial,
        rows, width, floor, block_r, block_c, depth, kind,
    )  # fmt: skip
    return grad_mean, grad_variance, partial.sum(0)


def triton_relu_tail_with_gradients(
    mean, variance, w_phi, w_var, w_second, y, loc, log_precision, scale, bias, activation=0, slope=0.0
):
    """The Triton kernel of ``cfbnn::relu_tail_with_gradients``: one launch (a program per block of
    rows), then the row blocks' float64 column sums added."""
    _check_tail("relu_tail_with_gradients", mean, variance, w_phi, w_var, w_second, activation=activation)
    tail, (rows, width), (floor, depth, kind) = _tail_operands(
        mean, variance, (w_phi, w_var, w_second), activation, slope
    )
    block_r, block_c = triton_tail_kernels.FORWARD_ROWS, triton_tail_kernels.FORWARD_COLUMNS
    row_blocks = triton.cdiv(max(rows, 1), block_r)
    sums = (mean.new_empty(rows), mean.new_empty(rows))
    grad_mean, grad_variance = torch.empty_like(tail[0]), torch.empty_like(tail[0])
    partial = torch.empty(row_blocks, 3, width, dtype=torch.float64, device=mean.device)
    triton_tail_kernels.relu_tail_kernel[(row_blocks,)](
        tail, sums, y.contiguous(), loc.contiguous(), log_precision, grad_mean, grad_variance, partial,
        rows, width, float(scale), floor, block_r, block_c, depth, kind, bias, True,
    )  # fmt: skip
    return *sums, grad_mean, grad_variance, partial.sum(0)


def _tail_reference(mean, variance, weight_phi, weight_variance, weight_second, activation=0, negative_slope=0.0):
    weights = (weight_phi, weight_variance, weight_second)
    _check_tail("relu_tail", mean, variance, *weights, activation=activation)
    return tuple(t.clone() for t in elbo_reference.relu_tail(mean, variance, *weights, activation, negative_slope))


def _tail_backward_reference(
    mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum, activation=0, slope=0.0
):
    tensors = (mean, variance, w_phi, w_var, w_second, grad_mean_sum, grad_spread_sum)
    _check_tail_backward(*tensors, activation)
    with torch.no_grad():
        grads = elbo_reference.relu_tail_vjp(*tensors, activation, slope)
    return grads[0], grads[1], grads[2].double()


def _tail_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.activation = inputs[5:]  # (activation, negative_slope)


def _tail_backward(ctx, grad_mean_sum, grad_spread_sum):
    mean, variance, *weights = ctx.saved_tensors
    grads = [g if g is not None else mean.new_zeros(mean.shape[:1]) for g in (grad_mean_sum, grad_spread_sum)]
    grad_mean, grad_variance, columns = relu_tail_backward(mean, variance, *weights, *grads, *ctx.activation)
    columns = columns.to(mean.dtype)
    return grad_mean, grad_variance, columns[0], columns[1], columns[2], None, None


def _tail_vjp(*arguments):
    grad_mean, grad_variance, columns = elbo_reference.relu_tail_vjp(*arguments)
    return grad_mean, grad_variance, columns.double()


def _tail_vmap(
    info, in_dims, mean, variance, weight_phi, weight_variance, weight_second, activation=0, negative_slope=0.0
):
    if in_dims[2:5] == (None, None, None):  # shared weights: the batch's rows are rows of one call
        mean, variance = batch_first(info, in_dims[:2], mean, variance)
        batch, rows, width = mean.shape
        weights = (weight_phi, weight_variance, weight_second)
        sums = relu_tail(mean.reshape(-1, width), variance.reshape(-1, width), *weights, activation, negative_slope)
        return tuple(s.reshape(batch, rows) for s in sums), (0, 0)
    tensors = batch_first(info, in_dims[:5], mean, variance, weight_phi, weight_variance, weight_second)
    weights = [w.unsqueeze(1) for w in tensors[2:]]
    return elbo_reference.relu_tail(*tensors[:2], *weights, activation, negative_slope), (0, 0)


def _tail_backward_vmap(info, in_dims, *arguments):
    tensors = batch_first(info, in_dims[:7], *arguments[:7])
    weights = [w.unsqueeze(1) for w in tensors[2:5]]
    grad_mean, grad_variance, columns = elbo_reference.relu_tail_vjp(
        *tensors[:2], *weights, *tensors[5:], *arguments[7:]
    )
    return (grad_mean, grad_variance, columns.double()), (0, 0, 0)


# the operands both operators' schemas share: the pre-activations' moments, the one-output layer's
# weights and the activation (the C++ and Triton kernels take them in this order)
_TAIL = "Tensor mean, Tensor variance, Tensor weight_phi, Tensor weight_variance, Tensor weight_second"
_ACTIVATION = "SymInt activation=0, float negative_slope=0."

relu_tail_backward = define(
    Operator(
        f"relu_tail_backward({_TAIL}, Tensor grad_mean_sum, Tensor grad_spread_sum, {_ACTIVATION}) -> (Tensor, Tensor, Tensor)",
        _tail_backward_reference,
        lambda mean, *_: (
            torch.empty_like(mean),
            torch.empty_like(mean),
            mean.new_empty((3, mean.shape[1]), dtype=torch.float64),
        ),
        cuda=triton_relu_tail_backward,
        **differentiable_by_formula(_tail_vjp, 7),
        vmap=_tail_backward_vmap,
    )
)
relu_tail = define(
    Operator(
        f"relu_tail({_TAIL}, {_ACTIVATION}) -> (Tensor, Tensor)",
        _tail_reference,
        lambda mean, *_: (mean.new_empty(mean.shape[:1]), mean.new_empty(mean.shape[:1])),
        cuda=triton_relu_tail,
        setup_context=_tail_setup,
        backward=_tail_backward,
        vmap=_tail_vmap,
    )
)

# ----------------------------------------------------------------------------- the ELBO's steps


def _check_in_place(*tensors: Tensor) -> None:
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("cfbnn::finish_diagonal_gradients: the gradients it finishes in place must be contiguous")


# ----------------------------------------------------------------------------- CUDA kernels (Triton)


def _augment_pair_triton(x: Tensor, bias: bool):
    x = x.contiguous()
    rows, columns = x.shape
    inputs = x.new_empty(rows, columns + int(bias))
    squares = torch.empty_like(inputs)
    triton_tail_kernels.augment_pair_kernel[(triton.cdiv(max(inputs.numel(), 1), triton_kernels.BLOCK),)](
        x, inputs, squares, rows, columns, int(bias), triton_kernels.BLOCK
    )
    return inputs, squares


def _outer_layers_pass_triton(x, loc, log_scale, output_loc, output_log_scale, bias: bool):
    x, loc, log_scale = x.contiguous(), loc.contiguous(), log_scale.contiguous()
    output_loc, output_log_scale = output_loc.contiguous(), output_log_scale.contiguous()
    rows, columns = x.shape
    inputs = x.new_empty(rows, columns + int(bias))
    squares = torch.empty_like(inputs)
    variance, output_variance = torch.empty_like(log_scale), torch.empty_like(output_log_scale)
    output_loc_square = torch.empty_like(output_loc)
    blocks, output_blocks = (triton.cdiv(t.numel(), KL_BLOCK) for t in (loc, output_loc))
    kl_sums = torch.empty(blocks + output_blocks, 3, dtype=torch.float64, device=x.device)
    augment_blocks = triton.cdiv(inputs.numel(), KL_BLOCK)
    triton_tail_kernels.outer_layers_kernel[(blocks + output_blocks + augment_blocks,)](
        x,
        inputs,
        squares,
        loc,
        log_scale,
        variance,
        output_loc,
        output_log_scale,
        output_variance,
        output_loc_square,
        kl_sums,
        rows,
        columns,
        loc.numel(),
        output_loc.numel(),
        blocks,
        output_blocks,
        int(bias),
        KL_BLOCK,
    )
    return inputs, squares, variance, output_variance, output_loc_square, kl_sums


def _diagonal_kl_pass_triton(loc: Tensor, log_scale: Tensor, prior_variance: float, loc_square: bool):
    loc, log_scale = loc.contiguous(), log_scale.contiguous()
    kl, variance = loc.new_empty(()), torch.empty_like(log_scale)
    square = torch.empty_like(loc) if loc_square else loc.new_empty(0)
    launch_diagonal_kl(loc, log_scale, prior_variance, kl, variance, square if loc_square else None)
    return kl, variance, square


def _normal_rows_triton(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias, elbo_terms=None):
    """:func:`~.triton_tail_kernels.normal_rows_kernel`: ``(residual, squares, ELL per row)``, or with
    ``elbo_terms = (kl_sums, kl, prior_variance, scale)`` ``(residual, squares, ELBO)``."""
    rows = mean_sum.shape[0]
    residual, squares = torch.empty_like(mean_sum), torch.empty_like(mean_sum)
    per_row = elbo_terms is None
    if per_row:  # one program per block of rows; the KL operands unread
        grid, out = (triton.cdiv(max(rows, 1), _ROWS_BLOCK),), torch.empty_like(mean_sum)
        elbo_terms = (log_precision, None, 1.0, 1.0)
    else:
        grid, out = (1,), mean_sum.new_empty(())
    kl_sums, kl, prior_variance, scale = elbo_terms
    inputs = [t.contiguous() for t in (mean_sum, spread_sum, y, loc, log_scale)]
    inputs += [log_precision, kl_sums.contiguous(), log_precision if kl is None else kl]
    parts = kl_sums.shape[0] if not per_row else 0
    sizes = (rows, loc.shape[-1] - int(bias), parts, float(prior_variance), math.log(prior_variance), float(scale))
    triton_tail_kernels.normal_rows_kernel[grid](
        *inputs, residual, squares, out, *sizes, per_row, kl is not None, bias, _ROWS_BLOCK
    )
    return residual, squares, out


def _normal_ell_rows_triton(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias: bool):
    return _normal_rows_triton(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias)


def _normal_elbo_rows_triton(
    mean_sum, spread_sum, y, loc, log_scale, log_precision, kl_sums, kl, prior_variance, scale, bias
):
    elbo_terms = (kl_sums, kl, prior_variance, scale)
    return _normal_rows_triton(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias, elbo_terms)


def _normal_rows_backward_triton(grad, residual, squares, log_precision, scale: float, row_grads: bool):
    row_u, row_k = torch.empty_like(residual), torch.empty_like(residual)
    sums = torch.empty(3, dtype=torch.float64, device=residual.device)
    grad_log_precision = torch.empty_like(log_precision)
    triton_tail_kernels.normal_rows_backward_kernel[(1,)](
        grad.contiguous(),
        residual.contiguous(),
        squares.contiguous(),
        log_precision,
        row_u,
        row_k,
        sums,
        grad_log_precision,
        residual.shape[0],
        float(scale),
        row_grads,
        _ROWS_BLOCK,
    )
    return row_u, row_k, sums, grad_log_precision


def _output_layer_gradients_triton(
    columns, sums, loc, log_scale, kl_grad, kl_sign: float, prior_variance, bias, data_scale=None
):
    loc, log_scale = loc.contiguous(), log_scale.contiguous()
    width = columns.shape[1]
    grad_loc, grad_log_scale = torch.empty_like(loc), torch.empty_like(loc)
    triton_tail_kernels.output_gradients_kernel[(triton.cdiv(width + 1, triton_kernels.BLOCK),)](
        columns.contiguous(),
        sums,
        loc,
        log_scale,
        kl_grad,
        float(kl_sign),
        kl_grad if data_scale is None else data_scale,
        grad_loc,
        grad_log_scale,
        width,
        float(prior_variance),
        bias,
        data_scale is not None,
        triton_kernels.BLOCK,
        num_warps=8,  # 4 elements a thread: at 8 (4 warps) its float64 arithmetic spills registers on sm_90a
    )
    return grad_loc, grad_log_scale


def _finish_diagonal_gradients_triton(
    grad_loc, grad_variance, loc, variance, kl_grad, kl_sign, prior_variance, data_scale=None
):
    _check_in_place(grad_loc, grad_variance)
    count = loc.numel()
    triton_kl_kernels.diagonal_gradients_kernel[triton_kernels.grid(count)](
        loc.contiguous(),
        variance.contiguous(),
        grad_loc,
        grad_variance,
        grad_variance,  # dL/d log_scale over dL/d Var: element by element, read before written
        kl_grad,
        float(kl_sign),
        kl_grad if data_scale is None else data_scale,
        count,
        float(prior_variance),
        SCALED=data_scale is not None,
        BLOCK=triton_kernels.BLOCK,
    )


def _augment_pair_fake(x, bias):
    shape = (x.shape[0], x.shape[1] + int(bias))
    return x.new_empty(shape), x.new_empty(shape)


def _outer_layers_pass_fake(x, loc, log_scale, output_loc, output_log_scale, bias):
    inputs, squares = _augment_pair_fake(x, bias)
    parts = sum(-(-t.numel() // KL_BLOCK) for t in (loc, output_loc))
    kl_sums = x.new_empty((parts, 3), dtype=torch.float64)
    return (
        inputs,
        squares,
        torch.empty_like(log_scale),
        torch.empty_like(output_log_scale),
        torch.empty_like(output_loc),
        kl_sums,
    )


def _diagonal_kl_pass_fake(loc, log_scale, prior_variance, loc_square):
    return loc.new_empty(()), torch.empty_like(log_scale), (torch.empty_like(loc) if loc_square else loc.new_empty(0))


def _normal_ell_rows_fake(mean_sum, spread_sum, y, loc, log_scale, log_precision, bias):
    return tuple(torch.empty_like(mean_sum) for _ in range(3))


def _normal_elbo_rows_fake(
    mean_sum, spread_sum, y, loc, log_scale, log_precision, kl_sums, kl, prior_variance, scale, bias
):
    return torch.empty_like(mean_sum), torch.empty_like(mean_sum), mean_sum.new_empty(())


def _normal_rows_backward_fake(grad, residual, squares, log_precision, scale, row_grads):
    sums = residual.new_empty(3, dtype=torch.float64)
    return torch.empty_like(residual), torch.empty_like(residual), sums, torch.empty_like(log_precision)


def _output_layer_gradients_fake(
    columns, sums, loc, log_scale, kl_grad, kl_sign, prior_variance, bias, data_scale=None
):
    return torch.empty_like(loc), torch.empty_like(loc)


def _finish_diagonal_gradients_fake(
    grad_loc, grad_variance, loc, variance, kl_grad, kl_sign, prior_variance, data_scale=None
):
    return None


def _relu_tail_with_gradients_fake(mean, variance, weight_phi, weight_variance, weight_second, y, loc, *_):
    rows = mean.new_empty(mean.shape[:1])
    columns = mean.new_empty((3, mean.shape[1]), dtype=torch.float64)
    return rows, torch.empty_like(rows), torch.empty_like(mean), torch.empty_like(mean), columns


def _rows_vmap(info, in_dims, mean_sum, spread_sum, y, loc, log_scale, log_precision, bias):
    """``cfbnn::normal_ell_rows`` per row: the batch's rows are rows of one call (the layer shared)."""
    if any(d is not None for d in in_dims[3:6]):
        raise NotImplementedError("cfbnn::normal_ell_rows: vmap over the output layer is not supported")
    rows = batch_first(info, in_dims[:3], mean_sum, spread_sum, y)
    shape = rows[0].shape
    outputs = normal_ell_rows(*(t.reshape(-1) for t in rows), loc, log_scale, log_precision, bias)
    return tuple(t.reshape(shape) for t in outputs), (0, 0, 0)


def _rows_backward_vmap(info, in_dims, grad, residual, squares, log_precision, scale, row_grads):
    if in_dims[3] is not None:
        raise NotImplementedError("cfbnn::normal_rows_backward: vmap over the precision is not supported")
    tensors = batch_first(info, in_dims[:3], grad, residual, squares)
    return elbo_reference.normal_rows_backward(*tensors, log_precision, scale, row_grads), (0, 0, 0, 0)


def _output_gradients_vmap(
    info, in_dims, columns, sums, loc, log_scale, kl_grad, kl_sign, prior_variance, bias, data_scale=None
):
    if in_dims[2] is not None or in_dims[3] is not None:
        raise NotImplementedError("cfbnn::output_layer_gradients: vmap over the output layer is not supported")
    scalars = [t for t in (kl_grad, data_scale) if t is not None]
    dims = [d for t, d in zip((kl_grad, data_scale), in_dims[4:5] + in_dims[8:9]) if t is not None]
    columns, sums, *scalars = batch_first(info, in_dims[:2] + tuple(dims), columns, sums, *scalars)
    kl_grad, data_scale = scalars[0], (scalars[1] if data_scale is not None else None)
    grads = elbo_reference.output_layer_gradients(
        columns, sums, loc, log_scale, kl_grad, kl_sign, prior_variance, bias, data_scale
    )
    return grads, (0, 0)


def _augment_pair_vmap(info, in_dims, x, bias):
    (x,) = batch_first(info, in_dims[:1], x)
    inputs, squares = augment_pair(x.reshape(-1, x.shape[-1]), bias)
    return (inputs.reshape(*x.shape[:-1], -1), squares.reshape(*x.shape[:-1], -1)), (0, 0)


def _finish_vmap(
    info, in_dims, grad_loc, grad_variance, loc, variance, kl_grad, kl_sign, prior_variance, data_scale=None
):
    if in_dims[0] is None or in_dims[1] is None or in_dims[2] is not None or in_dims[3] is not None:
        raise NotImplementedError("cfbnn::finish_diagonal_gradients: vmap over the gradients only")
    scalars = [t for t in (kl_grad, data_scale) if t is not None]
    dims = [d for t, d in zip((kl_grad, data_scale), in_dims[4:5] + in_dims[7:8]) if t is not None]
    grad_loc, grad_variance = (t.movedim(d, 0) for t, d in zip((grad_loc, grad_variance), in_dims[:2]))
    scalars = batch_first(info, tuple(dims), *scalars)
    kl_grad, data_scale = scalars[0], (scalars[1] if data_scale is not None else None)
    elbo_reference.finish_diagonal_gradients(
        grad_loc, grad_variance, loc, variance, kl_grad, kl_sign, prior_variance, data_scale
    )
    return None, None


SCHEMAS = {
    "augment_pair": "augment_pair(Tensor x, bool bias) -> (Tensor, Tensor)",
    "outer_layers_pass": (
        "outer_layers_pass(Tensor x, Tensor loc, Tensor log_scale, Tensor output_loc, Tensor output_log_scale,"
        " bool bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "diagonal_kl_pass": (
        "diagonal_kl_pass(Tensor loc, Tensor log_scale, float prior_variance, bool loc_square)"
        " -> (Tensor, Tensor, Tensor)"
    ),
    "normal_ell_rows": (
        "normal_ell_rows(Tensor mean_sum, Tensor spread_sum, Tensor y, Tensor loc, Tensor log_scale,"
        " Tensor log_precision, bool bias) -> (Tensor, Tensor, Tensor)"
    ),
    "normal_elbo_rows": (
        "normal_elbo_rows(Tensor mean_sum, Tensor spread_sum, Tensor y, Tensor loc, Tensor log_scale,"
        " Tensor log_precision, Tensor kl_sums, Tensor? kl, float prior_variance, float scale, bool bias)"
        " -> (Tensor, Tensor, Tensor)"
    ),
    "normal_rows_backward": (
        "normal_rows_backward(Tensor grad, Tensor residual, Tensor squares, Tensor log_precision,"
        " float scale, bool row_grads) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "output_layer_gradients": (
        "output_layer_gradients(Tensor columns, Tensor sums, Tensor loc, Tensor log_scale, Tensor kl_grad,"
        " float kl_sign, float prior_variance, bool bias, Tensor? data_scale=None) -> (Tensor, Tensor)"
    ),
    "finish_diagonal_gradients": (
        "finish_diagonal_gradients(Tensor(a!) grad_loc, Tensor(b!) grad_variance, Tensor loc, Tensor variance,"
        " Tensor kl_grad, float kl_sign, float prior_variance, Tensor? data_scale=None) -> ()"
    ),
    "relu_tail_with_gradients": (
        "relu_tail_with_gradients(Tensor mean, Tensor variance, Tensor weight_phi, Tensor weight_variance,"
        " Tensor weight_second, Tensor y, Tensor loc, Tensor log_precision, float scale, bool bias,"
        " int activation=0, float negative_slope=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}
_CUDA: Dict[str, Callable] = {
    "augment_pair": _augment_pair_triton,
    "outer_layers_pass": _outer_layers_pass_triton,
    "diagonal_kl_pass": _diagonal_kl_pass_triton,
    "normal_ell_rows": _normal_ell_rows_triton,
    "normal_elbo_rows": _normal_elbo_rows_triton,
    "normal_rows_backward": _normal_rows_backward_triton,
    "output_layer_gradients": _output_layer_gradients_triton,
    "finish_diagonal_gradients": _finish_diagonal_gradients_triton,
    "relu_tail_with_gradients": triton_relu_tail_with_gradients,
}
_FAKES: Dict[str, Callable] = {
    "augment_pair": _augment_pair_fake,
    "outer_layers_pass": _outer_layers_pass_fake,
    "diagonal_kl_pass": _diagonal_kl_pass_fake,
    "normal_ell_rows": _normal_ell_rows_fake,
    "normal_elbo_rows": _normal_elbo_rows_fake,
    "normal_rows_backward": _normal_rows_backward_fake,
    "output_layer_gradients": _output_layer_gradients_fake,
    "finish_diagonal_gradients": _finish_diagonal_gradients_fake,
    "relu_tail_with_gradients": _relu_tail_with_gradients_fake,
}
_VMAP: Dict[str, Callable] = {
    "augment_pair": _augment_pair_vmap,
    "normal_ell_rows": _rows_vmap,
    "normal_rows_backward": _rows_backward_vmap,
    "output_layer_gradients": _output_gradients_vmap,
    "finish_diagonal_gradients": _finish_vmap,
}
STEPS = tuple(SCHEMAS)  # the steps' names in the cfbnn namespace
for _name, _schema in SCHEMAS.items():
    define(Operator(_schema, elbo_reference.KERNELS[_name], _FAKES[_name], cuda=_CUDA[_name], vmap=_VMAP.get(_name)))
augment_pair = torch.ops.cfbnn.augment_pair.default
normal_ell_rows = torch.ops.cfbnn.normal_ell_rows.default
