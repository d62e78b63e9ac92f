"""The closed-form Normal ELBO's kernel steps as torch operators: ``torch.ops.cfbnn.*``, one
kernel per device -- C++ on the CPU (``csrc/cfbnn_ops.cpp`` around ``csrc/cfbnn_moments.cpp``), Triton
(:mod:`.triton_kernels`, :mod:`.triton_tail_kernels`, :mod:`.triton_kl_kernels`) on CUDA -- so that one autograd node,
:mod:`cfbnn_cli.bnn.fused.operator_elbo`, serves both devices and the dispatcher picks the kernels.

Forward (paper eqs. (4), (7)-(9), (12), one Normal output):

``cfbnn::augment_pair(Tensor x, bool bias) -> (Tensor inputs, Tensor squares)``
    ``([x, 1], [x^2, 1])`` (``(x, x^2)`` without ``bias``) of an ``(N, D)`` input, one pass: what
    the pre-activations' means and variances multiply (eq. (12)).
``cfbnn::outer_layers_pass(Tensor x, Tensor loc, Tensor log_scale, Tensor output_loc, Tensor output_log_scale, bool bias) -> (Tensor inputs, Tensor squares, Tensor variance, Tensor output_variance, Tensor output_loc_square, Tensor kl_sums)``
    one pass over the first layer and the one-output layer of a network: ``augment_pair``'s two
    results, both layers' ``exp(2 log_scale)``, the output layer's ``loc^2`` (the tail pass's
    weights) and both layers' KL sums table (float64 ``(blocks, 3)``, the first layer's rows first:
    :func:`~.elbo_reference.kl_block_sums`), which ``normal_elbo_rows`` finishes into the KL.
``cfbnn::diagonal_kl_pass(Tensor loc, Tensor log_scale, float prior_variance, bool loc_square) -> (Tensor kl, Tensor variance, Tensor loc_square)``
    ``KL(N(loc, diag exp(2 log_scale)) || N(0, prior_variance I))`` (0-d) with ``exp(2 log_scale)``
    and, with ``loc_square``, ``loc^2`` (else an empty tensor) from the same pass.
``cfbnn::normal_ell_rows(Tensor mean_sum, Tensor spread_sum, Tensor y, Tensor loc, Tensor log_scale, Tensor log_precision, bool bias) -> (Tensor residual, Tensor squares, Tensor ell)``
    after ``cfbnn::relu_tail``: per row ``residual = y - mean_sum - b``, ``squares = spread_sum +
    Var b + residual^2`` and ``ELL = log(tau)/2 - log(2 pi)/2 - tau/2 squares`` (eq. (7); ``b``
    the one-output layer's bias column of ``loc`` / ``log_scale``, with ``bias``).
``cfbnn::normal_elbo_rows(mean_sum, spread_sum, y, loc, log_scale, log_precision, Tensor kl_sums, Tensor? kl, float prior_variance, float scale, bool bias) -> (Tensor residual, Tensor squares, Tensor elbo)``
    the same rows and ``elbo = scale sum_r ELL_r - KL`` (eq. (4)), the rows summed in float64; the
    KL that of the KL sums table ``kl_sums`` (finished here: :func:`~.elbo_reference.kl_from_table`)
    plus ``kl`` where given (a deeper network's other layers).

Backward:

``cfbnn::normal_rows_backward(Tensor grad, Tensor residual, Tensor squares, Tensor log_precision, float scale, bool row_grads) -> (Tensor row_u, Tensor row_k, Tensor sums, Tensor grad_log_precision)``
    from ``g_r = scale dL/d ELL_r`` (``grad`` per row with ``row_grads``, else one ``dL/d elbo``):
    ``u = g tau residual`` and ``k = -g tau / 2`` (``cfbnn::relu_tail_backward``'s row gradients)
    and ``sums = (sum u, sum k, dL/d log tau)`` (float64), the last also as ``grad_log_precision``.
``cfbnn::output_layer_gradients(Tensor columns, Tensor sums, Tensor loc, Tensor log_scale, Tensor kl_grad, float kl_sign, float prior_variance, bool bias, Tensor? data_scale=None) -> (Tensor grad_loc, Tensor grad_log_scale)``
    the one-output layer's gradients from ``cfbnn::relu_tail_backward``'s column sums (times
    ``data_scale`` where given: ``relu_tail_with_gradients``' are taken at ``dL/d ELBO = 1``) and
    the rows' ``sums``, its KL's folded in with ``dL/dKL = kl_sign * kl_grad``.
``cfbnn::finish_diagonal_gradients(Tensor(a!) grad_loc, Tensor(b!) grad_variance, Tensor loc, Tensor variance, Tensor kl_grad, float kl_sign, float prior_variance, Tensor? data_scale=None) -> ()``
    in place, one pass: a mean-field layer's ``dL/d loc`` and ``dL/d Var`` of the data term
    become ``dL/d loc`` and ``dL/d log_scale`` with ``dL/dKL = kl_sign * kl_grad`` folded in:
    ``grad_loc += dL/dKL loc / s^2``, ``grad_variance <- 2 Var grad_variance + dL/dKL (Var / s^2 - 1)``,
    the data term's two first multiplied by ``data_scale`` where given.

Forward and backward at once:

``cfbnn::relu_tail_with_gradients(mean, variance, weight_phi, weight_variance, weight_second, Tensor y, Tensor loc, Tensor log_precision, float scale, bool bias, int activation=0, float negative_slope=0.0) -> (mean_sum, spread_sum, grad_mean, grad_variance, columns)``
    ``cfbnn::relu_tail``'s row sums and, from the same moments, ``cfbnn::relu_tail_backward``'s
    results for the row gradients ``normal_rows_backward`` gives at ``dL/d elbo = 1`` (``u = scale
    tau residual``, ``k = -scale tau / 2``): an ELBO's upstream gradient is one number, so its
    backward pass only scales these (``data_scale`` above) instead of evaluating the activation's
    moments again.

The steps are not differentiable themselves: they are called inside the autograd nodes, whose
backward passes call the backward steps. They are registered through :class:`torch.library.Library`
(``custom_op``'s Python layer would add about ten microseconds a call), with fake implementations
for ``torch.compile`` and ``opcheck`` (``tests/moments/test_elbo_ops.py``). Their CPU kernels are
C++ registered with the dispatcher by the kernel library itself (``csrc/cfbnn_ops.cpp``, a few
microseconds a call) when the package is imported; where it did not build, every device without a
kernel of its own runs the reference kernels (:mod:`.elbo_reference`), so a caller never asks which.
"""

from __future__ import annotations

import math
from typing import Callable, Dict

import torch
from torch import Tensor

from . import elbo_reference, tail_ops
from .kl_ops import launch_diagonal_kl
from .ops import HAVE_TRITON, triton, triton_kernels, triton_kl_kernels, triton_tail_kernels

__all__ = ["TRITON_KERNELS", "STEPS"]

_LIB = torch.library.Library("cfbnn", "FRAGMENT")
_ROWS_BLOCK = 1024
KL_BLOCK = elbo_reference.KL_BLOCK  # the blocks of a KL sums table: one program each

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
STEPS = tuple(SCHEMAS)  # the operators' names in the cfbnn namespace


# ----------------------------------------------------------------------------- CPU kernels (C++)


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


# ----------------------------------------------------------------------------- fake implementations


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


# the reference kernels: the torch formulas (the test oracle), any device's kernel without a better one
REFERENCE_KERNELS: Dict[str, Callable] = {
    **elbo_reference.KERNELS,
    "relu_tail_with_gradients": tail_ops.reference_relu_tail_with_gradients,
}
# the CUDA kernels; on the CPU under TRITON_INTERPRET=1 the tests register these for the CPU too
TRITON_KERNELS: Dict[str, Callable] = (
    {
        "augment_pair": _augment_pair_triton,
        "outer_layers_pass": _outer_layers_pass_triton,
        "diagonal_kl_pass": _diagonal_kl_pass_triton,
        "normal_ell_rows": _normal_ell_rows_triton,
        "normal_elbo_rows": _normal_elbo_rows_triton,
        "normal_rows_backward": _normal_rows_backward_triton,
        "output_layer_gradients": _output_layer_gradients_triton,
        "finish_diagonal_gradients": _finish_diagonal_gradients_triton,
        "relu_tail_with_gradients": tail_ops.triton_relu_tail_with_gradients,
    }
    if HAVE_TRITON
    else {}
)
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

for _name, _schema in SCHEMAS.items():
    _LIB.define(_schema)
    # every device without its own kernel (CUDA without Triton; the CPU without the C++ library,
    # which registers the CPU's when the package is imported): the reference kernel
    _LIB.impl(_name, REFERENCE_KERNELS[_name], "CompositeExplicitAutograd")
    if _name in TRITON_KERNELS:
        _LIB.impl(_name, TRITON_KERNELS[_name], "CUDA")
    torch.library.register_fake(f"cfbnn::{_name}", _FAKES[_name], lib=_LIB)
