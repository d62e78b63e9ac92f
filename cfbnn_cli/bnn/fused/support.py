"""What the fused functions share: flat views, affine products with a bias column, weight
gradients, the KL folded into a layer's pass, classic (non-functorch) twins of autograd
functions."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ...moments import ops

LOG_2PI = math.log(2.0 * math.pi)


def transforms_active() -> bool:
    """Inside torch.func transforms (vmap/grad) the kernels run on wrapped tensors: there the
    functions below take out-of-place ops only (an in-place op on an unbatched result with a
    batched operand is an error) and never write through ``out=``."""
    return torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()


def below_autograd(method):
    """A fused node's ``forward`` or ``backward`` with its operator calls dispatched below autograd.

    The node is the autograd record of everything it calls, so its ``cfbnn::`` operators need none
    of their own: without this, each call still enters the operator's autograd kernel (Python, for
    the operators registered there) only to find grad mode off, about 5 µs of a 10 µs call on the
    CPU, some tens of µs a step. Not under ``torch.compile``, which traces the node's body as it is."""

    @functools.wraps(method)
    def below(ctx, *arguments):
        if torch.compiler.is_compiling():
            return method(ctx, *arguments)
        with torch._C._AutoDispatchBelowAutograd():
            return method(ctx, *arguments)

    return below


def first_order_only(backward):
    """A fused node's ``backward`` (a staticmethod's function): first derivatives only.

    The backward passes are written out from what the forward pass saved, which carries no graph
    (and on the fast path they are kernels), so the gradients they return cannot be
    differentiated again correctly. ``torch.autograd.function.once_differentiable`` would return
    them without a graph when the incoming gradient needs none (the loss's own, say): a second
    derivative taken through a sum with other terms (a gradient penalty, a Hessian-vector
    product) would then leave this node's part out, silently. Here asking for a graph of the
    gradients (``create_graph=True``) raises instead. Under torch.func transforms (whose ``grad``
    always asks for that graph; the gradient-variance draws) the backward runs as usual."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled() and not transforms_active():  # (a plain backward runs without grad mode)
            raise RuntimeError(
                f"cfbnn: {backward.__qualname__.split('.')[0]}, a node of the closed-form ELBO, has first "
                "derivatives only: create_graph=True (second derivatives, gradient penalties, "
                "Hessian-vector products) is not supported; differentiate the gradients numerically "
                "(finite differences of torch.autograd.grad) where a second order is needed"
            )
        return backward(ctx, *grads)

    return checked


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``(rows, last)``, every leading dimension folded into the rows (a 2-D tensor as
    is: ``reshape`` is a dispatch of its own, a few of them per layer and step)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def affine(inputs: torch.Tensor, weight: torch.Tensor, bias_column) -> torch.Tensor:
    """``inputs @ weight^T (+ bias_column)`` over any leading dimensions, the bias added by
    the matrix product itself (``addmm``: no separate pass over the result)."""
    rows = flat(inputs)
    out = rows @ weight.mT if bias_column is None else torch.addmm(bias_column, rows, weight.mT)
    return out if inputs.dim() == 2 else out.reshape(*inputs.shape[:-1], weight.shape[0])


def sqrt_floored(variance: torch.Tensor) -> torch.Tensor:
    """The standard deviation, kept off exact zero, where sqrt's slope is infinite (in place
    on the fresh ``variance``: it is never seen by anyone else)."""
    tiny = torch.finfo(variance.dtype).tiny
    if transforms_active():
        return variance.clamp(min=tiny).sqrt()
    return variance.clamp_(min=tiny).sqrt_()


def columns(matrix: torch.Tensor, width: int, bias: bool):
    """``(matrix[:, :width], matrix[:, width] or None)``: the weights on ``h`` and on the bias's 1.

    The bias column is made contiguous (a copy of ``rows`` numbers): broadcast from its strided
    view, adding it to an (N, rows) result takes torch's slow path (4-6x the contiguous add)."""
    return matrix[:, :width], (matrix[:, width].contiguous() if bias else None)


def gradient_with_bias_column(main: torch.Tensor, bias_part, bias: bool) -> torch.Tensor:
    """``[main, bias_part]`` as one ``(rows, width + 1)`` gradient (just ``main`` without a bias)."""
    return torch.cat([main, bias_part.unsqueeze(-1)], -1) if bias else main


def flat_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``sum_n left_n^T right_n`` over every leading dimension: ``(A, B)`` from ``(..., A)``, ``(..., B)``."""
    return flat(left).mT @ flat(right)


def weight_gradient(left: torch.Tensor, right: torch.Tensor, bias: bool, scale: float = 1.0) -> torch.Tensor:
    """``[sum_n left_n^T right_n, sum_n left_n]``: a layer's ``(rows, width [+ 1])`` weight gradient
    from the output-side factor ``left`` and the inputs ``right``, the bias column's input being 1.

    Outside torch.func both parts are written into one buffer (``out=``): on a wide layer the
    concatenation is a copy of the whole gradient (2 ms at 1000 x 2049)."""
    flat_left, flat_right = flat(left), flat(right)
    if transforms_active():  # batched gradients cannot be written into a plain buffer
        main = flat_left.mT @ flat_right
        gradient = gradient_with_bias_column(main, flat_left.sum(0), True) if bias else main
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


def folded_kl_forward(loc: torch.Tensor, log_scale: torch.Tensor, prior_variance: Optional[float]):
    """``(exp(2 log_scale), KL)`` from one pass (``cfbnn::diagonal_kl_pass``: the KL of the layer
    folded into its pre-activation function), or ``None`` where that does not apply (no prior
    given, or torch.func transforms: the layer's KL is then computed on its own)."""
    if prior_variance is None or transforms_active() or not ops.operator_route(loc):
        return None
    kl, variance, _ = torch.ops.cfbnn.diagonal_kl_pass(loc, log_scale, float(prior_variance), False)
    return variance, kl


def folded_kl_backward(loc, variance, grad_loc, half_grad_variance, prior_variance: float, grad_kl):
    """The layer's gradients finished in place with its KL's folded in
    (``cfbnn::finish_diagonal_gradients``): ``half_grad_variance`` (``dL/d Var / 2``) becomes ``dL/d
    log_scale`` in one pass over the matrix, and no second pair of gradient buffers reaches autograd."""
    if grad_kl is None:  # the KL unused: its gradient is not read (kl_sign 0)
        grad_kl, sign = constant(0.0, loc.dtype, loc.device), 0.0
    else:
        sign = 1.0
    torch.ops.cfbnn.finish_diagonal_gradients(
        grad_loc, half_grad_variance, loc, variance, grad_kl, sign, float(prior_variance)
    )
    return grad_loc, half_grad_variance


def gradient_pair(first, second, zeros):
    """``(first, second)`` with a missing one as ``zeros()`` (an output nobody used): the classic
    functions do not materialize missing gradients (:func:`classic_twin`)."""
    return (zeros() if first is None else first), (zeros() if second is None else second)


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """Stands in for an output that was not computed (an unfolded KL)."""
    return like.new_empty(0)


CONSTANTS = {}


def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor of ``value``, made once per (value, dtype, device): a fixed prior's variance
    is the same number every step (a few of them; never written to)."""
    key = (value, dtype, device)
    tensor = CONSTANTS.get(key)
    if tensor is None:
        if len(CONSTANTS) > 64:
            CONSTANTS.clear()
        tensor = CONSTANTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return tensor


def classic_twin(function):
    """``function`` (an autograd.Function written with ``setup_context``, as torch.func needs) in
    the classic ``forward(ctx, ...)`` form, which autograd applies without binding a signature
    (~30 us per call on a CPU): the form used outside torch.func transforms."""
    # the three steps as plain functions: dynamo (torch.compile) takes ``function.backward(ctx,
    # ...)`` for a call of that node's backward and refuses a ``ctx`` that is not its own
    forward_pass, setup_context, backward_pass = function.forward, function.setup_context, function.backward

    class Classic(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_pass(*inputs)
            setup_context(ctx, inputs, output)
            # no zeros made for the outputs that get no gradient (the non-differentiable ones
            # above all): each was an allocation and a pass; the backward passes take ``None``
            ctx.set_materialize_grads(False)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward_pass(ctx, *grads)

    Classic.__name__ = Classic.__qualname__ = function.__name__ + "Classic"
    return Classic


def apply(function, classic, *inputs):
    """``classic.apply`` outside torch.func transforms (``torch.compile`` included: dynamo traces
    the classic form, not ``setup_context``'s), ``function.apply`` inside."""
    return (function if torch._C._are_functorch_transforms_active() else classic).apply(*inputs)


def flat_sum(tensor: torch.Tensor) -> torch.Tensor:
    return flat(tensor).sum(0)


def with_folded_kl(outputs):
    """``(gamma, xi, KL or None)`` from the pre-activation functions' outputs (the KL is the fifth)."""
    kl = outputs[4]
    return outputs[0], outputs[1], (kl if kl.numel() == 1 else None)
