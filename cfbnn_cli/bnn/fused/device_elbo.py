"""The closed-form Normal likelihood terms off the CPU on the ``cfbnn::`` operators' Triton kernels
(paper eqs. (4), (7)-(9), (12), (20); one Normal output): :class:`DeviceNormalELBO`, the whole
ELBO of a one-hidden-layer ReLU network as one autograd node of about twenty kernels, and
:class:`DeviceNormalELL`, the last hidden layer and the output layer of any deeper one (the
earlier layers sampled or propagated by the estimator).

Written as ordinary torch code the step launches some 130 CUDA kernels, and on a GPU launching
them, not the arithmetic, is the cost. Here the forward pass is: the input with its bias column
and its square (1 kernel), each layer's KL with ``exp(2 log_scale)`` in the same pass
(:func:`cfbnn_cli.moments.ops.launch_diagonal_kl`, 2 each), the pre-activations' means and
variances (2 matrix products), the tail pass ``cfbnn::relu_tail`` (1) and the likelihood's rows
with the ELBO's sum (1); the backward pass: the rows (1), the tail pass (2), two matrix
products and one kernel per layer that finishes its gradients with its KL's folded in. What
the CPU route does with its C++ kernels (:mod:`.single_node`), on any device with Triton.

Used by :meth:`cfbnn_cli.bnn.estimators.Estimator.elbo` where :func:`device_elbo_applies`; its
values and gradients are tested against the reference torch path (tests/bnn/test_device_elbo.py,
the Triton kernels under ``TRITON_INTERPRET=1``; tests/test_cuda.py on a GPU).
"""

from __future__ import annotations

import torch

from ...moments import ops
from ...moments.activations import ReLU
from ...moments.gaussian import check_mean_std
from .support import transforms_active

if ops.HAVE_TRITON:
    import triton

    from ...moments import tail_ops, triton_kernels, triton_tail_kernels

_ROWS_BLOCK = 1024


def device_elbo_applies(activation, *tensors: torch.Tensor) -> bool:
    """Whether :func:`device_normal_elbo` / :func:`device_normal_ell` run here: a ReLU network,
    tensors of one float dtype on one device that Triton compiles for (not the CPU, whose C++
    route is faster), the operators switched on (:func:`cfbnn_cli.moments.ops.set_device_kernels`),
    outside torch.func transforms and torch.compile, and the kernels' first run on that device
    and dtype succeeded."""
    first = tensors[0]
    return (
        type(activation) is ReLU  # (a subclass may change the function)
        and ops.device_kernels_apply(first)
        and not transforms_active()
        and all(t.device == first.device and t.dtype == first.dtype for t in tensors)
        and ops.first_use_check("the closed-form ELBO's Triton kernels", first.device, first.dtype, _self_check)
    )


def _self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Both nodes forward and backward on a tiny problem (compiling their kernels)."""
    g = torch.Generator().manual_seed(0)

    def tensor(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype=dtype, device=device)

    hidden = [tensor(5, 3).requires_grad_(), tensor(5, 3, shift=-2.0).requires_grad_()]
    output = [tensor(1, 6).requires_grad_(), tensor(1, 6, shift=-2.0).requires_grad_()]
    log_precision = tensor(1, shift=0.5).reshape(()).requires_grad_()
    x, y = tensor(4, 2), tensor(4)
    elbo = DeviceNormalELBO.apply(x, y, log_precision, *hidden, *output, (True, True), 1.0, 2.0)
    gamma, xi2 = tensor(4, 5).requires_grad_(), tensor(4, 5, scale=0.1, shift=1.0).requires_grad_()
    ell, kl = DeviceNormalELL.apply(gamma, xi2, *output, y, log_precision, True, 1.0)
    values = torch.autograd.grad(elbo + ell.sum() - kl, [*hidden, *output, log_precision, gamma, xi2])
    if not all(bool(torch.isfinite(v).all()) for v in (elbo, ell, kl, *values)):
        raise FloatingPointError("non-finite values on a well-conditioned problem")


def _output_layer_pass(loc, log_scale, width: int, prior_variance: float, kl_out):
    """The one-output layer's KL pass (its KL into ``kl_out``) writing the tail pass's weights:
    ``(w_phi, w_var, w_second) = (loc, loc^2, Var W)`` of the first ``width`` columns."""
    variance, loc_square = torch.empty_like(log_scale), torch.empty_like(loc)
    ops.launch_diagonal_kl(loc, log_scale, prior_variance, kl_out, variance, loc_square)
    return loc.reshape(-1)[:width], loc_square.reshape(-1)[:width], variance.reshape(-1)[:width]


def _tail_backward(grad, row_grads: bool, scale: float, saved, kl_grad, kl_sign: float, prior_variance: float, bias):
    """The backward pass both nodes share, from ``grad`` (``dL/d ELL`` per row with
    ``row_grads``, else one ``dL/d elbo`` for every row, times ``scale``): the rows, the tail pass
    and the one-output layer's gradients with ``dL/dKL = kl_sign kl_grad`` folded in. ``saved``:
    ``(gamma, xi2, loc, log_scale, log_precision, w_var, w_second, residual, squares)``.
    Returns ``(d gamma, d xi2, d loc, d log_scale, d log_precision)``."""
    gamma, xi2, loc, log_scale, log_precision, w_var, w_second, residual, squares = saved
    rows, width = gamma.shape
    row_u, row_k = torch.empty_like(residual), torch.empty_like(residual)
    sums = torch.empty(3, dtype=torch.float64, device=residual.device)
    grad_log_precision = torch.empty_like(log_precision)
    triton_tail_kernels.normal_rows_backward_kernel[(1,)](
        grad,
        residual,
        squares,
        log_precision,
        row_u,
        row_k,
        sums,
        grad_log_precision,
        rows,
        scale,
        row_grads,
        _ROWS_BLOCK,
    )
    w_phi = loc.reshape(-1)[:width]
    grad_gamma, grad_xi2, columns = tail_ops.triton_relu_tail_backward(gamma, xi2, w_phi, w_var, w_second, row_u, row_k)
    grad_loc, grad_log_scale = torch.empty_like(loc), torch.empty_like(loc)
    triton_tail_kernels.output_gradients_kernel[(triton.cdiv(width + 1, triton_kernels.BLOCK),)](
        columns,
        sums,
        loc,
        log_scale,
        sums if kl_grad is None else kl_grad,  # (a pointer never read where kl_sign is 0)
        kl_sign,
        grad_loc,
        grad_log_scale,
        width,
        prior_variance,
        bias,
        triton_kernels.BLOCK,
    )
    return grad_gamma, grad_xi2, grad_loc, grad_log_scale, grad_log_precision


class DeviceNormalELBO(torch.autograd.Function):
    """``scale * sum_n ELL_n - KL(hidden) - KL(output)`` (see the module doc) as one node."""

    @staticmethod
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
    ):
        hidden_bias, output_bias = biases
        hidden_loc, hidden_log_scale = hidden_loc.contiguous(), hidden_log_scale.contiguous()
        output_loc, output_log_scale = output_loc.contiguous(), output_log_scale.contiguous()
        x = x.contiguous()
        rows, columns = x.shape
        inputs = x.new_empty(rows, columns + int(hidden_bias))
        squares_in = torch.empty_like(inputs)  # [x, 1] and [x^2, 1]: the bias column's 1 stays 1
        triton_tail_kernels.augment_pair_kernel[(triton.cdiv(max(inputs.numel(), 1), triton_kernels.BLOCK),)](
            x, inputs, squares_in, rows, columns, int(hidden_bias), triton_kernels.BLOCK
        )
        hidden_variance = torch.empty_like(hidden_log_scale)
        kl = hidden_loc.new_empty(2)
        ops.launch_diagonal_kl(hidden_loc, hidden_log_scale, prior_variance, kl[:1], hidden_variance)
        width = hidden_loc.shape[0]
        w_phi, w_var, w_second = _output_layer_pass(output_loc, output_log_scale, width, prior_variance, kl[1:])
        gamma = torch.mm(inputs, hidden_loc.t())
        xi2 = torch.mm(squares_in, hidden_variance.t())
        mean_sum, spread_sum = tail_ops.triton_relu_tail(gamma, xi2, w_phi, w_var, w_second)
        residual, squares = torch.empty_like(mean_sum), torch.empty_like(mean_sum)
        elbo = mean_sum.new_empty(())
        triton_tail_kernels.normal_elbo_rows_kernel[(1,)](
            mean_sum,
            spread_sum,
            y.contiguous(),
            output_loc,
            output_log_scale,
            log_precision,
            kl,
            residual,
            squares,
            elbo,
            rows,
            width,
            float(scale),
            output_bias,
            _ROWS_BLOCK,
        )
        ctx.save_for_backward(
            inputs, squares_in, log_precision, hidden_loc, hidden_variance, output_loc, output_log_scale,
            gamma, xi2, w_var, w_second, residual, squares,
        )  # fmt: skip
        ctx.output_bias, ctx.prior_variance, ctx.scale = output_bias, float(prior_variance), float(scale)
        return elbo

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels build no graph: a second order raises
    def backward(ctx, grad):
        (
            inputs, squares_in, log_precision, hidden_loc, hidden_variance, output_loc, output_log_scale,
            gamma, xi2, w_var, w_second, residual, squares,
        ) = ctx.saved_tensors  # fmt: skip
        grad = grad.contiguous()
        tail = (gamma, xi2, output_loc, output_log_scale, log_precision, w_var, w_second, residual, squares)
        grad_gamma, grad_xi2, grad_output_loc, grad_output_log_scale, grad_log_precision = _tail_backward(
            grad, False, ctx.scale, tail, grad, -1.0, ctx.prior_variance, ctx.output_bias
        )
        grad_hidden_loc = torch.mm(grad_gamma.t(), inputs)
        grad_hidden_variance = torch.mm(grad_xi2.t(), squares_in)
        grad_hidden_log_scale = torch.empty_like(grad_hidden_variance)
        count = hidden_loc.numel()
        triton_kernels.diagonal_gradients_kernel[triton_kernels.grid(count)](
            hidden_loc,
            hidden_variance,
            grad_hidden_loc,
            grad_hidden_variance,
            grad_hidden_log_scale,
            grad,
            -1.0,
            count,
            ctx.prior_variance,
            BLOCK=triton_kernels.BLOCK,
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
        )


def device_normal_elbo(x, y, log_precision, hidden, output, prior_variance: float, scale: float) -> torch.Tensor:
    """The ELBO of :class:`DeviceNormalELBO`: ``x`` ``(N, D)``, ``y`` ``(N,)``, ``hidden`` and
    ``output`` the two :class:`~cfbnn_cli.bnn.layers.GaussianMatrix` layers (diagonal q; the
    output layer of one row)."""
    return DeviceNormalELBO.apply(
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
    )


class DeviceNormalELL(torch.autograd.Function):
    """``(ELL per row, KL)``: the last hidden layer's ReLU moments from its pre-activation means
    and variances ``(rows, H)``, a one-output layer integrated exactly and the Normal likelihood
    (eqs. (7)-(9)), the layer's KL folded in where a prior variance is given -- the device twin of
    :class:`.normal_ell.NormalELLGivenPreactivation`: forward, the KL pass (writing ``Var W`` and
    ``loc^2``), ``cfbnn::relu_tail`` and the rows; backward, the rows, the tail pass and one kernel
    for the layer's gradients."""

    @staticmethod
    def forward(ctx, gamma, xi2, loc, log_scale, y, log_precision, bias, prior_variance):
        loc, log_scale = loc.contiguous(), log_scale.contiguous()
        kl = loc.new_empty(())
        folded = prior_variance is not None
        rows, width = gamma.shape
        w_phi, w_var, w_second = _output_layer_pass(loc, log_scale, width, prior_variance if folded else 1.0, kl)
        mean_sum, spread_sum = tail_ops.triton_relu_tail(gamma, xi2, w_phi, w_var, w_second)
        residual, squares, ell = (torch.empty_like(mean_sum) for _ in range(3))
        triton_tail_kernels.normal_ell_rows_kernel[(triton.cdiv(max(rows, 1), _ROWS_BLOCK),)](
            mean_sum,
            spread_sum,
            y,
            loc,
            log_scale,
            log_precision,
            residual,
            squares,
            ell,
            rows,
            width,
            bias,
            _ROWS_BLOCK,
        )
        ctx.save_for_backward(gamma, xi2, loc, log_scale, log_precision, w_var, w_second, residual, squares)
        ctx.bias, ctx.prior_variance = bias, prior_variance
        if not folded:
            ctx.mark_non_differentiable(kl)
        return ell, kl

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels build no graph: a second order raises
    def backward(ctx, grad_ell, grad_kl):
        saved = ctx.saved_tensors
        grad_ell = torch.zeros_like(saved[-1]) if grad_ell is None else grad_ell.contiguous()
        kl_on = ctx.prior_variance is not None and grad_kl is not None
        grad_gamma, grad_xi2, grad_loc, grad_log_scale, grad_log_precision = _tail_backward(
            grad_ell,
            True,
            1.0,
            saved,
            grad_kl.contiguous() if kl_on else None,
            1.0 if kl_on else 0.0,
            ctx.prior_variance if kl_on else 1.0,
            ctx.bias,
        )
        return (
            grad_gamma,
            grad_xi2,
            grad_loc,
            grad_log_scale,
            None,
            grad_log_precision if ctx.needs_input_grad[5] else None,
            None,
            None,
        )


def device_normal_ell(gamma, xi2, loc, log_scale, y, log_precision, bias: bool = True, prior_variance=None):
    """``(ELL per point, KL or None)`` of :class:`DeviceNormalELL` for pre-activation means and
    variances ``(..., N, H)`` and targets ``(..., N, 1)``: what
    :func:`.normal_ell.normal_ell_given_preactivation_and_kl` computes on the CPU."""
    check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the argument checks activation.moments makes (if on)
    gamma, xi2 = torch.broadcast_tensors(gamma, xi2)
    lead, width = gamma.shape[:-1], gamma.shape[-1]
    targets = torch.broadcast_to(y, lead + (1,)).reshape(-1).contiguous()
    ell, kl = DeviceNormalELL.apply(
        gamma.reshape(-1, width).contiguous(),
        xi2.reshape(-1, width).contiguous(),
        loc,
        log_scale,
        targets,
        log_precision,
        bool(bias),
        None if prior_variance is None else float(prior_variance),
    )
    return ell.reshape(lead), (kl if prior_variance is not None else None)
