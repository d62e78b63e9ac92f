"""What every ``cfbnn::`` moments operator registers besides its kernels, written once: the operand
checks, the kernels by device (the reference formulas as every device's default, Triton's for CUDA;
the C++ library adds the CPU's), the autograd registration through the backward operator (:func:`register_moments_autograd`, with
:class:`KernelVJP` where a graph of the backward is wanted and :func:`differentiable_by_formula` for the
backward operator's own derivative), the elementwise vmap rule, and :class:`OperatorMoments`, the
autograd.Function through which ``torch.func`` transforms reach an operator pair."""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from torch import Tensor

from .gaussian import align_batched, is_transformed

_FLOATS = (torch.float32, torch.float64)

# Triton comes with torch's CUDA wheels; CPU-only installs may lack it. Decided without importing it:
# one installed that does not import fails the first-use check (ops.first_use_check: the reference
# route, with a warning), as a Triton that does not compile the kernels does.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def check_operands(name: str, *tensors: Tensor) -> None:
    first = tensors[0]
    for tensor in tensors:
        if tensor.shape != first.shape:
            raise ValueError(f"cfbnn::{name}: every tensor must have the shape of `mean` {tuple(first.shape)}")
        if tensor.dtype != first.dtype or tensor.dtype not in _FLOATS:
            raise ValueError(f"cfbnn::{name}: tensors must share one dtype, float32 or float64; got {tensor.dtype}")


def absent_gradient(like: Tensor) -> Tensor:
    """The gradient of an output nothing used: one zero expanded to ``like``'s shape, which the
    kernels read as a scalar (the C++ one as no gradient at all) instead of a block of zeros."""
    return like.new_zeros(()).expand(like.shape)


def register_moments_autograd(forward, backward, formula: Callable) -> None:
    """The autograd registration of a moments operator ``forward(mean, std, *parameters) -> (Phi,
    Upsilon, Var)`` (the Python one: CUDA's; the CPU's is C++) through its backward operator
    ``backward(mean, std, phi, grad_phi, grad_upsilon, grad_variance, *parameters)``; where a graph
    of the backward is wanted, inside :class:`KernelVJP` with ``formula``'s derivative. An unused
    output's gradient is :func:`absent_gradient`, not a block of zeros."""

    def setup_context(ctx, inputs, output):
        mean, std, *parameters = inputs
        ctx.parameters = tuple(parameters)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mean, std, output[0])

    def backward_pass(ctx, grad_phi, grad_upsilon, grad_variance):
        mean, std, phi = ctx.saved_tensors
        grads = [g if g is not None else absent_gradient(mean) for g in (grad_phi, grad_upsilon, grad_variance)]
        if torch.is_grad_enabled():  # a graph of the backward is wanted: the kernel, differentiable again
            result = KernelVJP.apply(backward, formula, mean, std, phi, *grads, *ctx.parameters)
        else:
            result = backward(mean, std, phi, *grads, *ctx.parameters)
        return (*result, *(None,) * len(ctx.parameters))

    forward.register_autograd(backward_pass, setup_context=setup_context)


def elementwise_vmap(op, count: int):
    """The vmap rule of an elementwise operator with ``count`` outputs: each tensor argument with
    the vmap dimension first (an unbatched one expanded to the batch), one call on the batch; the
    other arguments (a slope, say) passed as they are."""

    def rule(info, in_dims, *arguments):
        moved = []
        for argument, dim in zip(arguments, in_dims):
            if isinstance(argument, Tensor):
                if dim is None:
                    argument = argument.unsqueeze(0).expand(info.batch_size, *argument.shape)
                else:
                    argument = argument.movedim(dim, 0)
                argument = argument.contiguous()
            moved.append(argument)
        return op(*moved), 0 if count == 1 else (0,) * count

    return rule


def register_moments_operators(forward, backward, formula: Callable) -> None:
    """Everything of a moments operator pair but its kernels and fake implementations: autograd
    (:func:`register_moments_autograd`), the backward operator's own derivative
    (:func:`differentiable_by_formula`) and both vmap rules."""
    register_moments_autograd(forward, backward, formula)
    differentiable_by_formula(backward, formula, 6)
    forward.register_vmap(elementwise_vmap(forward, 3))
    backward.register_vmap(elementwise_vmap(backward, 2))


_GRADIENTS = "Tensor phi, Tensor grad_phi, Tensor grad_upsilon, Tensor grad_variance"


def define_moments_operators(
    name: str,
    parameters: str,
    device_forward: Callable,
    device_backward: Callable,
    reference_forward,
    formula,
    spread: str = "std",
):
    """Declare a moments operator pair once and register all of it: ``cfbnn::<name>(Tensor mean,
    Tensor std<parameters>) -> (Phi, Upsilon, Var)`` and ``cfbnn::<name>_backward(mean, std, phi,
    grad_phi, grad_upsilon, grad_variance<parameters>) -> (grad_mean, grad_std)``, ``parameters``
    the schema of the numbers after the tensors (``", float negative_slope"``, or ``""``), ``spread``
    the second tensor's name (``"variance"`` for an operator that takes the variances).

    Kernels: ``reference_forward`` / ``formula`` (the torch formulas, the test oracle) are the
    default of every device; where Triton is installed ``device_forward`` / ``device_backward``
    (the Triton launches) are CUDA's; the CPU's are C++, registered by the library when the package
    is imported (:func:`.kernel_library.register_cpu_kernels`). Fake implementations, autograd,
    the backward's own derivative and vmap: :func:`register_moments_operators`. Returns
    ``(forward, backward)``."""

    def checked(kernel: Callable, suffix: str, count: int) -> Callable:
        def run(*arguments):
            check_operands(name + suffix, *arguments[:count])
            return kernel(*arguments)

        return run

    def reference_kernel(mean, std, *numbers):
        return tuple(value.clone() for value in reference_forward(mean, std, *numbers))

    def reference_backward(*arguments):
        with torch.no_grad():
            return tuple(formula(*arguments))

    forward_schema = f"(Tensor mean, Tensor {spread}{parameters}) -> (Tensor, Tensor, Tensor)"
    backward_schema = f"(Tensor mean, Tensor {spread}, {_GRADIENTS}{parameters}) -> (Tensor, Tensor)"
    forward = torch.library.custom_op(
        f"cfbnn::{name}", checked(reference_kernel, "", 2), mutates_args=(), schema=forward_schema
    )
    backward = torch.library.custom_op(
        f"cfbnn::{name}_backward", checked(reference_backward, "_backward", 6), mutates_args=(), schema=backward_schema
    )
    if HAVE_TRITON:
        forward.register_kernel("cuda")(checked(device_forward, "", 2))
        backward.register_kernel("cuda")(checked(device_backward, "_backward", 6))
    forward.register_fake(lambda mean, *_: (torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)))
    backward.register_fake(lambda mean, *_: (torch.empty_like(mean), torch.empty_like(mean)))
    register_moments_operators(forward, backward, formula)
    return forward, backward


class OperatorMoments(torch.autograd.Function):
    """``(Phi, Upsilon, Var)`` through a moments operator and its backward operator (arguments as
    :func:`register_moments_autograd`'s), as an autograd.Function so that ``torch.func``
    transforms (``grad``, ``vmap``, ``jacrev``) work as well as autograd: the operators' own
    autograd registrations serve autograd alone."""

    @staticmethod
    def forward(forward, backward, formula, mean, std, *parameters):
        return tuple(forward(mean, std, *parameters))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, backward, formula, mean, std, *parameters = inputs
        ctx.backward, ctx.formula, ctx.parameters = backward, formula, tuple(parameters)
        ctx.set_materialize_grads(False)  # an unused output's gradient: absent_gradient, not a block of zeros
        ctx.save_for_backward(mean, std, output[0])

    @staticmethod
    def backward(ctx, grad_phi, grad_upsilon, grad_variance):
        mean, std, phi = ctx.saved_tensors
        grads = [g if g is not None else absent_gradient(mean) for g in (grad_phi, grad_upsilon, grad_variance)]
        if torch.is_grad_enabled() or any(is_transformed(t) for t in (mean, std, phi, *grads)):
            result = KernelVJP.apply(ctx.backward, ctx.formula, mean, std, phi, *grads, *ctx.parameters)
        else:
            result = tuple(ctx.backward(mean, std, phi, *grads, *ctx.parameters))
        return (None, None, None, *result, *(None,) * len(ctx.parameters))

    @staticmethod
    def vmap(info, in_dims, forward, backward, formula, mean, std, *parameters):
        mean, std = align_batched(mean, std, in_dims[3:5])
        broadcast = torch.broadcast_tensors(mean, std)
        return OperatorMoments.apply(forward, backward, formula, *broadcast, *parameters), (0, 0, 0)


def moments_function(forward, backward, formula: Callable, mean: Tensor, std: Tensor, *parameters):
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` through a moments operator
    (arguments as :func:`register_moments_autograd`'s), autograd and ``torch.func`` included."""
    mean, std = torch.broadcast_tensors(mean, std)
    if is_transformed(mean) or is_transformed(std):
        return OperatorMoments.apply(forward, backward, formula, mean, std, *parameters)
    # outside torch.func the operator's own autograd registration serves: about 25 µs a call less
    # than the autograd.Function on the CPU
    return tuple(forward(mean, std, *parameters))


class KernelVJP(torch.autograd.Function):
    """The vector-Jacobian product of an activation's moments where a graph of it is wanted
    (``create_graph=True``, and always under ``torch.func.grad``: every per-draw gradient of the
    gradient-variance measurement): ``kernel(mean, std, phi, grad_phi, grad_upsilon,
    grad_variance, *parameters)``, the backward operator (one pass), computes it; a derivative of
    it, when one is taken, is that of ``formula`` (same arguments) in differentiable torch ops,
    so it is differentiable to any order. ``phi`` counts as an input of its own, as it does there."""

    @staticmethod
    def forward(kernel, formula, mean, std, phi, grad_phi, grad_upsilon, grad_variance, *parameters):
        return tuple(kernel(mean, std, phi, grad_phi, grad_upsilon, grad_variance, *parameters))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.formula, ctx.parameters = inputs[1], inputs[8:]
        ctx.save_for_backward(*inputs[2:8])

    @staticmethod
    def backward(ctx, grad_grad_mean, grad_grad_std):
        inputs = ctx.saved_tensors
        cotangents = tuple(absent_gradient(inputs[0]) if g is None else g for g in (grad_grad_mean, grad_grad_std))
        _, vjp = torch.func.vjp(lambda *tensors: ctx.formula(*tensors, *ctx.parameters), *inputs)
        return (None, None, *vjp(cotangents), *(None,) * len(ctx.parameters))

    @staticmethod
    def vmap(info, in_dims, kernel, formula, *arguments):
        # elementwise: every operand with the vmap dimension first, all expanded to one shape (the
        # operator takes one shape; a broadcast gradient stays a stride-0 view the kernel reads once)
        aligned = align_batched(*arguments[:6], in_dims[2:8])
        shape = torch.broadcast_shapes(*(t.shape for t in aligned))
        shape = (info.batch_size,) + shape[1:]
        return KernelVJP.apply(kernel, formula, *(t.expand(shape) for t in aligned), *arguments[6:]), (0, 0)


def differentiable_by_formula(backward_operator, formula: Callable, tensor_count: int) -> None:
    """Give a moments backward operator a derivative of its own: that of ``formula`` (the same
    arguments, differentiable torch ops) through ``torch.func.vjp``, as :class:`KernelVJP`'s. The
    CPU's C++ autograd of the moments operators (``csrc/cfbnn_ops.cpp``: MomentsAutograd) calls the
    backward operator through autograd when a graph of the backward is wanted (``create_graph``,
    ``torch.func.grad``): this makes that graph. The first ``tensor_count`` arguments are tensors,
    the rest numbers."""

    def setup_context(ctx, inputs, output):
        ctx.parameters = inputs[tensor_count:]
        ctx.save_for_backward(*inputs[:tensor_count])

    def backward(ctx, grad_grad_mean, grad_grad_spread):
        inputs = ctx.saved_tensors
        cotangents = tuple(absent_gradient(inputs[0]) if g is None else g for g in (grad_grad_mean, grad_grad_spread))
        _, vjp = torch.func.vjp(lambda *tensors: formula(*tensors, *ctx.parameters), *inputs)
        return (*vjp(cotangents), *(None,) * len(ctx.parameters))

    backward_operator.register_autograd(backward, setup_context=setup_context)
