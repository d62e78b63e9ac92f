"""The closed-form ELBO's CPU kernels as torch functions (used by :mod:`cfbnn_cli.bnn.fused`):
the KL of a mean-field matrix and its gradients, the last hidden layer's tail pass with a
one-output Normal expected log-likelihood, the likelihood's rows, and a hidden layer's moments
from its pre-activations' variances (:func:`moments_from_variance`)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

from .kernel_library import DTYPE_SUFFIX, KernelState, data_pointer, kernel_function, load_kernels


def _kl_kernels_apply(*tensors) -> bool:
    """Whether the KL and tail kernels take these tensors (plain contiguous CPU float32/float64
    of one dtype). Called on the hot path: the cheap global tests first."""
    if not KernelState.enabled or torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return False
    dtype = tensors[0].dtype
    if dtype not in DTYPE_SUFFIX:
        return False
    for tensor in tensors:
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return False
    return (KernelState.library if KernelState.tried else load_kernels()) is not None


def diagonal_kl_sums(
    loc: torch.Tensor, log_scale: torch.Tensor, variance_out: Optional[torch.Tensor] = None
) -> Optional[Tuple[float, float, float]]:
    """``(sum exp(2 log_scale), sum loc^2, sum log_scale)`` in one pass (float64 sums), or None
    where the kernels do not apply: what KL(q || N(0, s^2 I)) of a mean-field matrix needs.
    ``variance_out`` (contiguous, like ``log_scale``) receives ``exp(2 log_scale)`` in the same pass."""
    if not _kl_kernels_apply(loc, log_scale):
        return None
    return kl_sums_pass(loc, log_scale, variance_out)


def kl_sums_pass(loc: torch.Tensor, log_scale: torch.Tensor, variance_out: Optional[torch.Tensor] = None):
    """:func:`diagonal_kl_sums` without asking whether the kernels apply (the caller knows: plain
    contiguous CPU tensors of one float dtype, the kernels built)."""
    out = np.empty(3, dtype=np.float64)
    kernel_function("diag_kl_sums", loc.dtype)(
        loc.numel(),
        loc.data_ptr(),
        log_scale.data_ptr(),
        out.ctypes.data,
        data_pointer(variance_out),
        torch.get_num_threads(),
    )
    return float(out[0]), float(out[1]), float(out[2])


def kl_from_sums(variance_sum, loc_square_sum, log_scale_sum, count: int, prior_variance: float):
    """``KL(N(loc, diag Var) || N(0, s^2 I))`` of ``count`` weights from its three sums ``(sum Var,
    sum loc^2, sum log_scale)`` (numbers or tensors)."""
    return (
        0.5 * ((variance_sum + loc_square_sum) / prior_variance - count + count * math.log(prior_variance))
        - log_scale_sum
    )


def kl_gradients(loc: torch.Tensor, log_scale: torch.Tensor, grad, prior_variance):
    """The KL's gradients in torch ops for ``grad = dL/dKL``: ``(grad / s^2 loc, grad / s^2
    exp(2 log_scale) - grad)`` (what :func:`diagonal_kl_gradients` computes in one kernel pass)."""
    scaled = grad / prior_variance
    return scaled * loc, scaled * torch.exp(2.0 * log_scale) - grad


def finish_diagonal_gradients(
    loc: torch.Tensor,
    variance: torch.Tensor,
    grad_loc: torch.Tensor,
    grad_variance: torch.Tensor,
    scale: float,
    kl_scaled: float,
    kl_grad: float,
) -> None:
    """In place, one pass: ``grad_loc += kl_scaled loc`` and ``grad_variance <- variance (scale
    grad_variance + kl_scaled) - kl_grad``, which turns a layer's ``dL/d Var`` (over ``scale``)
    into ``dL/d log_scale`` with its KL's gradient folded in (``kl_grad`` = dL/dKL,
    ``kl_scaled`` = dL/dKL / s^2). All four tensors contiguous, of one dtype, on the CPU."""
    kernel_function("diag_gradient_finish", loc.dtype)(
        loc.numel(),
        loc.data_ptr(),
        variance.data_ptr(),
        float(scale),
        float(kl_scaled),
        float(kl_grad),
        grad_loc.data_ptr(),
        grad_variance.data_ptr(),
        torch.get_num_threads(),
    )


def diagonal_kl_gradients(loc: torch.Tensor, log_scale: torch.Tensor, scaled: float, grad: float):
    """``(scaled * loc, scaled * exp(2 log_scale) - grad)`` in one pass, or None where the kernels
    do not apply: the KL's gradients for ``grad`` = dL/dKL and ``scaled`` = grad / s^2."""
    if not _kl_kernels_apply(loc, log_scale):
        return None
    grad_loc, grad_log_scale = torch.empty_like(loc), torch.empty_like(log_scale)
    kernel_function("diag_kl_backward", loc.dtype)(
        loc.numel(),
        loc.data_ptr(),
        log_scale.data_ptr(),
        float(scaled),
        float(grad),
        grad_loc.data_ptr(),
        grad_log_scale.data_ptr(),
        torch.get_num_threads(),
    )
    return grad_loc, grad_log_scale


def layer_kernels_apply(op, *tensors) -> bool:
    """Whether the layer kernels (:func:`normal_tail`, :func:`moments_from_variance`) run for
    ``op`` on these tensors: plain contiguous CPU float32/float64 tensors of one dtype, an
    activation with those kernels (ReLU, leaky ReLU, ReLU^2), the fast path on."""
    return op is not None and op.tail_kind is not None and _kl_kernels_apply(*tensors)


def normal_tail(
    op,  # a kernel_handles.KernelHandle: its kernels (tail_kind, kernel_parameters)
    mean: torch.Tensor,
    std: torch.Tensor,
    weight_phi: torch.Tensor,
    weight_variance: torch.Tensor,
    weight_second: torch.Tensor,
    row_mean_grad: Optional[torch.Tensor] = None,
    row_spread_grad: Optional[torch.Tensor] = None,
):
    """The activation's moments and one output's integrated Normal terms in one pass over
    ``(rows, H)`` pre-activation moments ``mean``, ``std`` (the kernel ``tail_pass``).

    Forward (no row gradients): ``(sum_c Phi w_phi, sum_c Var w_var + Ups w_second)``, two
    ``(rows,)`` tensors. Backward (``row_mean_grad``, ``row_spread_grad`` given, the loss's
    gradients with respect to those two sums): ``(d mean, d std, column_sums)``, the last
    ``(3, H)`` float64 ``[sum_r u_r Phi_rc, sum_r k_r Var_rc, sum_r k_r Ups_rc]``."""
    rows, width = mean.shape
    threads = torch.get_num_threads()
    eps = op.kernel_parameters(mean.dtype)
    eps = eps[0] if eps else 0.0
    function = kernel_function("tail_pass", mean.dtype)
    inputs = (
        mean.data_ptr(),
        std.data_ptr(),
        eps,
        weight_phi.data_ptr(),
        weight_variance.data_ptr(),
        weight_second.data_ptr(),
    )
    if row_mean_grad is None:  # forward: the two row sums
        mean_sum, spread_sum = mean.new_empty(rows), mean.new_empty(rows)
        function(
            op.tail_kind,
            0,
            rows,
            width,
            *inputs,
            None,
            None,
            mean_sum.data_ptr(),
            spread_sum.data_ptr(),
            None,
            None,
            None,
            threads,
        )
        return mean_sum, spread_sum
    grad_mean, grad_std = torch.empty_like(mean), torch.empty_like(std)
    columns = torch.empty(3, width, dtype=torch.float64)
    gradients = (row_mean_grad.data_ptr(), row_spread_grad.data_ptr())
    outputs = (grad_mean.data_ptr(), grad_std.data_ptr(), columns.data_ptr())
    function(op.tail_kind, 1, rows, width, *inputs, *gradients, None, None, *outputs, threads)
    return grad_mean, grad_std, columns


def augment_pair(x: torch.Tensor):
    """``([x, 1], [x^2, 1])`` in one pass (kernel ``augment_pair``), or ``None`` where the kernels
    do not take ``x`` (not a plain contiguous CPU float32/float64 tensor, torch.func transforms)."""
    if not _kl_kernels_apply(x):
        return None
    augmented = x.new_empty(*x.shape[:-1], x.shape[-1] + 1)
    squared = torch.empty_like(augmented)
    kernel_function("augment_pair", x.dtype)(
        x.numel() // max(x.shape[-1], 1),
        x.shape[-1],
        x.data_ptr(),
        augmented.data_ptr(),
        squared.data_ptr(),
        torch.get_num_threads(),
    )
    return augmented, squared


def normal_rows(
    mean_sum: torch.Tensor,
    spread_sum: torch.Tensor,
    y: torch.Tensor,
    mean_bias: float,
    spread_bias: float,
    precision: float,
    log_term: float,
    residual: Optional[torch.Tensor] = None,
    squares: Optional[torch.Tensor] = None,
):
    """The Normal likelihood's rows after :func:`normal_tail`'s forward pass, one loop (kernel
    ``normal_rows``): ``(residual, squares, ELL, sum ELL)`` with ``residual = y - mean_sum - mean_bias``,
    ``squares = spread_sum + spread_bias + residual^2`` and ``ELL = -precision/2 squares + log_term``
    (eq. (7), one output). ``residual`` and ``squares`` are written into the tensors given, else
    over ``mean_sum`` and ``spread_sum``."""
    residual = mean_sum if residual is None else residual
    squares = spread_sum if squares is None else squares
    ell = torch.empty_like(mean_sum)
    total = kernel_function("normal_rows", mean_sum.dtype)(
        mean_sum.shape[0],
        mean_sum.data_ptr(),
        spread_sum.data_ptr(),
        y.data_ptr(),
        mean_bias,
        spread_bias,
        precision,
        log_term,
        residual.data_ptr(),
        squares.data_ptr(),
        ell.data_ptr(),
    )
    return residual, squares, ell, total


def normal_row_gradients(grad_ell: torch.Tensor, residual: torch.Tensor, squares: torch.Tensor, precision: float):
    """Before :func:`normal_tail`'s backward pass (kernel ``normal_row_gradients``): from ``g =
    dL/d ELL`` the rows' ``u = dL/d mean_sum = precision g residual`` and ``k = dL/d squares =
    -precision/2 g``, and ``(sum u, sum k, sum g (1/2 - precision/2 squares))`` as a float64
    tensor: the output bias's gradients and ``dL/d log precision``."""
    row_u, row_k = torch.empty_like(grad_ell), torch.empty_like(grad_ell)
    sums = torch.empty(3, dtype=torch.float64)
    kernel_function("normal_row_gradients", grad_ell.dtype)(
        grad_ell.shape[0],
        grad_ell.data_ptr(),
        residual.data_ptr(),
        squares.data_ptr(),
        precision,
        row_u.data_ptr(),
        row_k.data_ptr(),
        sums.data_ptr(),
    )
    return row_u, row_k, sums


def normal_output_gradients(
    columns: torch.Tensor,
    weight_phi: torch.Tensor,
    bias: bool,
    sum_u: float,
    sum_k: float,
    grad_loc: torch.Tensor,
    grad_variance: torch.Tensor,
) -> None:
    """After :func:`normal_tail`'s backward pass (kernel ``normal_output_gradients``), into the
    one-output layer's ``(1, H [+ 1])`` gradient buffers: ``d/d loc_c = columns_0c + 2 w_c
    columns_1c``, ``d/d Var W_c = columns_2c`` and the bias column's ``(sum_u, sum_k)``."""
    kernel_function("normal_output_gradients", grad_loc.dtype)(
        columns.shape[1],
        columns.data_ptr(),
        weight_phi.data_ptr(),
        int(bias),
        sum_u,
        sum_k,
        grad_loc.data_ptr(),
        grad_variance.data_ptr(),
    )


def _hidden_pass(op, backward: int, mean: torch.Tensor, variance: torch.Tensor, pointers, width: int) -> None:
    """The kernel ``hidden_pass``: ``(kind, backward, n, mean, variance, eps, phi, ups, var, d phi, d ups,
    d var, d mean, d variance, width, threads)``, the eight output and gradient ``pointers`` in that order."""
    eps = op.kernel_parameters(mean.dtype)
    kernel_function("hidden_pass", mean.dtype)(
        op.tail_kind,
        backward,
        mean.numel(),
        mean.data_ptr(),
        variance.data_ptr(),
        eps[0] if eps else 0.0,
        *pointers,
        width,
        torch.get_num_threads(),
    )


def hidden_pass_forward(op, mean: torch.Tensor, variance: torch.Tensor, augmented: bool = False):
    """``(Phi, Upsilon, Var)`` of contiguous CPU pre-activations of means ``mean`` and variances
    ``variance`` through the kernel ``hidden_pass`` (the square root taken inside). ``augmented``
    (2-D inputs): Phi and Upsilon as ``[Phi, 1]`` and ``[Ups, 1]``, the next layer's inputs with
    its bias column."""
    if augmented:
        rows, width = mean.shape
        phi, ups = mean.new_empty(rows, width + 1), mean.new_empty(rows, width + 1)
    else:
        width, phi, ups = 0, torch.empty_like(mean), torch.empty_like(mean)
    var = torch.empty_like(mean)
    pointers = (phi.data_ptr(), ups.data_ptr(), var.data_ptr(), None, None, None, None, None)
    _hidden_pass(op, 0, mean, variance, pointers, width)
    return phi, ups, var


def hidden_pass_backward(op, mean: torch.Tensor, variance: torch.Tensor, grads):
    """``(d mean, d variance)`` of :func:`hidden_pass_forward` for the gradients ``grads`` of
    ``(Phi, Upsilon, Var)`` (each ``(..., H)`` or ``None``; the Gaussian factors recomputed)."""
    grads = [None if g is None else g.contiguous() for g in grads]
    grad_mean, grad_variance = torch.empty_like(mean), torch.empty_like(variance)
    pointers = (None, None, None, *(data_pointer(g) for g in grads), grad_mean.data_ptr(), grad_variance.data_ptr())
    _hidden_pass(op, 1, mean, variance, pointers, 0)
    return grad_mean, grad_variance


class MomentsFromVariance(torch.autograd.Function):
    """``(Phi, Upsilon, Var)`` of pre-activations given their means and variances (kernel
    ``hidden_pass``): the square root inside the kernel, and the backward pass returns the
    gradient with respect to the variance. Plain CPU tensors only (see :func:`moments_from_variance`)."""

    @staticmethod
    def forward(ctx, mean, variance, op, augmented: bool = False):
        # augmented: called directly by fused's single-node ELBO, never through apply
        ctx.op = op
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mean, variance)
        return hidden_pass_forward(op, mean, variance, augmented)

    @staticmethod
    def backward(ctx, grad_phi, grad_ups, grad_var):
        """The gradients of (Phi, Ups, Var) are ``(..., H)`` (without the bias column, augmented or not)."""
        mean, variance = ctx.saved_tensors
        return (*hidden_pass_backward(ctx.op, mean, variance, (grad_phi, grad_ups, grad_var)), None)


def moments_from_variance(op, mean: torch.Tensor, variance: torch.Tensor):
    """``(Phi, Upsilon, Var)`` for ``z ~ N(mean, variance)`` through one kernel pass each way, or
    ``None`` where the kernel does not apply (then take ``sqrt`` and ``Activation.moments``):
    an activation without it (only ReLU, leaky ReLU and ReLU^2 have it), tensors that are not
    plain contiguous CPU float32/float64 of one shape and dtype, torch.func transforms, the fast
    path off. The argument checks are the caller's."""
    if mean.shape != variance.shape or not layer_kernels_apply(op, mean, variance):
        return None
    return MomentsFromVariance.apply(mean, variance, op)
