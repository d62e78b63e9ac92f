"""The closed-form ELBO of a deeper ReLU-family network (ReLU, leaky ReLU, ReLU^2; two or more
hidden layers of diagonal Gaussian weights, every layer integrated: ``deterministic``) as ONE
autograd node on the ``cfbnn::`` operators, the same code for the CPU and CUDA.

Each hidden layer after the first takes its inputs' moments (paper eqs. (12), (20); the ReLU
family's ``Phi``, ``Upsilon`` and ``Var`` from the pre-activations' means and variances) and
propagates them through its weights ``W ~ N(M, S)`` (mean field, bias column last):

    gamma' = [Phi, 1] M^T,    xi2' = [Upsilon, 1] S^T + Var (M o M)^T

(``Var(w^T h) = sum_j S_j E[h_j^2] + M_j^2 Var h_j`` for independent ``w`` and ``h``); the first
layer is :class:`~.operator_elbo.NormalELBO`'s (``[x, 1] M^T`` and ``[x^2, 1] S^T``) and the last
hidden layer and the output layer its tail pass. Every elementwise step is an operator
(``cfbnn::outer_layers_pass``, ``cfbnn::diagonal_kl_pass``, the moments operators, ``cfbnn::relu_tail`` (with its gradients ahead where a gradient is wanted),
``cfbnn::normal_elbo_rows`` and their backward passes, ``cfbnn::finish_diagonal_gradients``),
the rest matrix products, so the dispatcher picks C++ on the CPU and Triton on CUDA, and the
backward pass runs them in reverse without autograd's per-operation bookkeeping.

Tested against the reference torch path in float64 (tests/bnn/test_operator_deep_elbo.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .operator_elbo import RELU, _first_layer, _first_layer_gradients, _tail_and_rows, _tail_backward
from .support import below_autograd, first_order_only

_cfbnn = torch.ops.cfbnn


def _with_ones(values: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[values, 1]``: the next layer's inputs with its bias column."""
    return F.pad(values, (0, 1), value=1.0) if bias else values


class DeepNormalELBO(torch.autograd.Function):
    """``scale * sum_n ELL_n - sum_l KL_l`` of a network of two or more hidden layers, every layer
    integrated (see the module doc), as one node. ``parameters``: each layer's ``(loc,
    log_scale)`` in order, the output layer's (one row) last; ``biases`` each layer's bias flag."""

    @staticmethod
    @below_autograd
    def forward(ctx, x, y, log_precision, biases, prior_variance, scale, family, *parameters):
        locs, log_scales = parameters[0::2], parameters[1::2]
        inputs, squares_in, variance, gamma, xi2, output_rows, kl_sums = _first_layer(
            x, locs[0], log_scales[0], biases[0], locs[-1], log_scales[-1]
        )
        propagated = []  # per later hidden layer: its inputs' pre-activations, moments and weights
        hidden_kl = None  # the KL of the layers between the first and the output layer
        for loc, log_scale, bias in zip(locs[1:-1], log_scales[1:-1], biases[1:-1]):
            # the family's moments from the variances: the square root inside the kernel
            phi, ups, var_h = _cfbnn.relu_family_moments(gamma, xi2, *family, True)
            kl, layer_variance, loc_square = _cfbnn.diagonal_kl_pass(loc, log_scale, prior_variance, True)
            width = phi.shape[1]
            phi_in, ups_in = _with_ones(phi, bias), _with_ones(ups, bias)
            next_gamma = torch.mm(phi_in, loc.t())
            next_xi2 = torch.mm(ups_in, layer_variance.t()).addmm_(var_h, loc_square[:, :width].t())
            propagated.append((gamma, xi2, phi, phi_in, ups_in, var_h, layer_variance, loc_square))
            hidden_kl = kl if hidden_kl is None else hidden_kl + kl
            gamma, xi2 = next_gamma, next_xi2
        elbo, tail = _tail_and_rows(
            gamma,
            xi2,
            output_rows,
            locs[-1],
            log_scales[-1],
            y,
            log_precision,
            (kl_sums, hidden_kl),
            prior_variance,
            scale,
            biases[-1],
            family,
            any(ctx.needs_input_grad[2:]),  # then the tail pass's backward ahead, at dL/d elbo = 1
        )
        ctx.save_for_backward(inputs, squares_in, variance, *(t for layer in propagated for t in layer), *tail, *locs)
        ctx.layers = len(propagated)
        ctx.biases, ctx.prior_variance, ctx.scale, ctx.family = biases, float(prior_variance), float(scale), family
        return elbo

    @staticmethod
    @first_order_only  # its kernels build no graph: a second order raises
    @below_autograd
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        inputs, squares_in, first_variance = saved[:3]
        end = 3 + 8 * ctx.layers
        propagated = [saved[start : start + 8] for start in range(3, end, 8)]
        tail, locs = saved[end : end + 9], saved[end + 9 :]
        pv = ctx.prior_variance
        # with the tail pass's backward taken ahead, every data-term gradient below is at dL/d elbo = 1
        # (the chain is linear in it): the steps that finish each layer's gradients scale by ``data_scale``
        grad_gamma, grad_xi2, grad_output_loc, grad_output_log_scale, grad_log_precision, data_scale = _tail_backward(
            grad, False, ctx.scale, tail, grad, -1.0, pv, ctx.biases[-1], ctx.family
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
        grads = [
            *_first_layer_gradients(
                grad_gamma, grad_xi2, inputs, squares_in, locs[0], first_variance, grad, pv, data_scale
            ),
            *grads,
        ]
        return (None, None, grad_log_precision if ctx.needs_input_grad[2] else None, None, None, None, None, *grads)


def deep_normal_elbo(x, y, log_precision, layers, prior_variance: float, scale: float, family=RELU) -> torch.Tensor:
    """The ELBO of :class:`DeepNormalELBO`: ``x`` ``(N, D)``, ``y`` ``(N,)``, ``layers`` the
    network's :class:`~cfbnn_cli.bnn.layers.GaussianMatrix` layers (diagonal q; three or more, the
    output layer of one row), ``family`` the activation's (:func:`~cfbnn_cli.moments.activations.family_of`)."""
    parameters = [tensor for layer in layers for tensor in (layer.loc, layer.log_scale)]
    biases = tuple(bool(layer.bias) for layer in layers)
    return DeepNormalELBO.apply(x, y, log_precision, biases, float(prior_variance), float(scale), family, *parameters)
