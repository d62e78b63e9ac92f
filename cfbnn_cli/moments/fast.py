"""The fast CPU path of the activation moments: fused C++ kernels, built at run time.

``get_activation(name).moments(mean, std)`` on CPU float32/float64 tensors runs one
fused kernel per call (one pass over the data, a few passes over cache-sized
blocks for the piecewise-polynomial engine) instead of the ~60 small torch ops of
the reference path, and its backward pass is a second fused kernel. The numerics
are those of the reference path (see ``moments/csrc/cfbnn_moments.cpp``);
the tests hold the two paths to each other and both to quadrature.

What the backward needs. ReLU, leaky ReLU, ReLU^2 and (float32) the hard sigmoid
save nothing but their inputs and Phi: the backward kernel recomputes the Gaussian
factors block by block. That costs about one forward pass, and saves allocating,
writing and re-reading two to four more arrays -- measured, the cheaper side on
CPU, where fresh pages from the allocator (glibc returns freed blocks of this size
to the system) cost ~1 us per 4 kB. The general engine, whose forward pass is
expensive, saves the four partial derivatives instead.

The closed-form ELBO's steps are ``cfbnn::`` operators (:mod:`cfbnn_cli.moments.elbo_ops`); the
library's loading and bindings are in :mod:`cfbnn_cli.moments.kernel_library`.

Build. The kernels (``moments/csrc/cfbnn_moments.cpp``) are plain C++ built once per
machine and cached per user: :mod:`cfbnn_cli.moments.kernel_build` says how (the cache
key, the ownership and hash checks, one builder at a time). If no compiler is found or
every build fails, a warning carrying the compiler's message is issued once and the
reference torch path is used.

Which path runs. The fast path is the default for CPU tensors of dtype float32 or
float64. It is skipped (the reference path runs) when

* it is turned off: environment variable ``CFBNN_FAST_MOMENTS=0`` (read at import),
  :func:`set_fast_path(False) <set_fast_path>`, or ``with fast_path(False): ...``;
* the tensors are on another device (CUDA: the operators of :mod:`cfbnn_cli.moments.ops`) or of
  another dtype;
* the code is being traced by ``torch.compile`` (the reference ops are what
  inductor can fuse);
* the kernels are unavailable (see :func:`fast_path_info`).

Autograd. Each call is one :class:`torch.autograd.Function` with an analytic
backward (the heat-equation identities of the reference path); under
``torch.func`` transforms it batches through its ``vmap`` rule. A backward that builds
a graph (``create_graph=True``, as ``torch.func.grad`` always asks) still runs the
backward kernel for ReLU, leaky ReLU and ReLU² (:class:`_KernelBackward`); a second
derivative differentiates the reference path.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .gaussian import (
    align_batched,
    is_transformed,
)

__all__ = [
    "set_fast_path",
    "fast_path",
    "fast_path_enabled",
    "fast_path_info",
    "load_kernels",
    "usable",
    "moments",
    "count_negative",
    "relu_mean",
    "piecewise_supported",
]

from .kernel_handles import KernelHandle
from .kernel_library import (  # noqa: F401 - the fast path's switches and library, re-exported
    DTYPE_SUFFIX,
    KernelState,
    count_negative,
    cpu_operators_registered,
    data_pointer,
    fast_path,
    fast_path_enabled,
    fast_path_info,
    gradient_pointer,
    kernel_function,
    library_loaded,
    library_takes,
    load_kernels,
    plain_tensors,
    set_fast_path,
    usable,
)
from .piecewise_tables import MAX_BREAKPOINTS, MAX_DEGREE, coefficient_tables, piecewise_supported  # noqa: F401


class _FastMoments(torch.autograd.Function):
    """(mean, std) -> (Phi, Upsilon, Var, *saved factors) through one fused kernel."""

    @staticmethod
    def forward(mean, std, op, want_var, need_grad):
        return op.forward(mean.contiguous(), std.contiguous(), want_var, need_grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        mean, std, op, want_var, need_grad = inputs
        ctx.op = op
        ctx.set_materialize_grads(False)
        extras = list(output[3:])
        if not want_var:
            extras.append(output[2])
        if extras:
            ctx.mark_non_differentiable(*extras)
        if need_grad:
            ctx.save_for_backward(mean, std, output[0], *output[3:])

    @staticmethod
    def backward(ctx, grad_phi, grad_ups, grad_var, *_):
        mean, std, phi, *saved = ctx.saved_tensors
        grads = (grad_phi, grad_ups, grad_var)
        mean, std = mean.contiguous(), std.contiguous()
        if torch.is_grad_enabled():
            # create_graph=True (also what torch.func.grad asks for, so every per-draw gradient of
            # the gradient-variance measurement comes here): a differentiable backward, the
            # kernel itself where it can be a function of its own
            if ctx.op.backward_from_inputs:
                grad_mean, grad_std = _KernelBackward.apply(mean, std, phi, ctx.op, *grads)
            else:
                grad_mean, grad_std = ctx.op.differentiable_backward(mean, std, phi, grads)
        else:
            grad_mean, grad_std = ctx.op.backward(mean, std, phi, saved, grads, plain=getattr(ctx, "plain", False))
        return grad_mean, grad_std, None, None, None

    @staticmethod
    def vmap(info, in_dims, mean, std, op, want_var, need_grad):
        mean, std = torch.broadcast_tensors(*align_batched(mean, std, in_dims[:2]))
        out = _FastMoments.apply(mean, std, op, want_var, need_grad)
        return out, tuple(None if (k == 2 and not want_var) else 0 for k in range(len(out)))


class _KernelBackward(torch.autograd.Function):
    """``(d mean, d std)`` of :class:`_FastMoments` through the backward kernel, as a function
    of ``(mean, std, Phi, grad_Phi, grad_Upsilon, grad_Var)`` with a derivative of its own.

    A backward pass that builds a graph (``create_graph=True``, and always under
    ``torch.func.grad``) then still runs the one-pass kernel instead of the reference path's
    ~20 ops; only a second derivative, when one is taken, goes through the reference path's
    differentiable vector-Jacobian product (``op.differentiable_backward``), differentiated by
    ``torch.func.vjp`` (so that it is differentiable again). For ops whose backward kernel
    needs nothing saved (``backward_from_inputs``)."""

    @staticmethod
    def forward(mean, std, phi, op, grad_phi, grad_ups, grad_var):
        shape = torch.broadcast_shapes(mean.shape, std.shape)
        mean, std = (t.expand(shape).contiguous() for t in (mean, std))
        grads = tuple(None if g is None else g.expand(shape) for g in (grad_phi, grad_ups, grad_var))
        return op.backward(mean, std, phi.expand(shape).contiguous(), (), grads, plain=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        mean, std, phi, op, *grads = inputs
        ctx.op = op
        ctx.present = tuple(g is not None for g in grads)
        ctx.save_for_backward(mean, std, phi, *[g for g in grads if g is not None])

    @staticmethod
    def backward(ctx, grad_grad_mean, grad_grad_std):
        mean, std, phi, *present_grads = ctx.saved_tensors
        op, present = ctx.op, ctx.present

        def first_derivative(mean, std, phi, *given):
            given = iter(given)
            grads = tuple(next(given) if here else None for here in present)
            grad_mean, grad_std = op.differentiable_backward(mean, std, phi, grads)
            # a part that does not depend on the inputs comes back as None: zeros of its shape
            return tuple(torch.zeros_like(mean) if g is None else g for g in (grad_mean, grad_std))

        cotangents = tuple(torch.zeros_like(mean) if g is None else g for g in (grad_grad_mean, grad_grad_std))
        _, vjp = torch.func.vjp(first_derivative, mean, std, phi, *present_grads)
        found = iter(vjp(cotangents))
        grad_mean, grad_std, grad_phi = next(found), next(found), next(found)
        grads = tuple(next(found) if here else None for here in present)
        return (grad_mean, grad_std, grad_phi, None, *grads)

    @staticmethod
    def vmap(info, in_dims, mean, std, phi, op, grad_phi, grad_ups, grad_var):
        # elementwise: every batched input's vmap dimension first, the others broadcast to it
        dims = tuple(in_dims[:3]) + tuple(in_dims[4:])
        mean, std, phi, *grads = align_batched(mean, std, phi, grad_phi, grad_ups, grad_var, dims)
        shape = torch.broadcast_shapes(*(t.shape for t in (mean, std, phi, *grads) if t is not None))
        shape = (info.batch_size,) + shape[1:]
        mean, std, phi = (t.expand(shape) for t in (mean, std, phi))
        grads = [None if g is None else g.expand(shape) for g in grads]
        return _KernelBackward.apply(mean, std, phi, op, *grads), (0, 0)


class _FastMomentsPlain(torch.autograd.Function):
    """:class:`_FastMoments` for ordinary tensors: the same forward and backward in the classic
    ``forward(ctx, ...)`` form, which autograd applies ~15 us faster per call (no signature
    binding); functorch transforms need the other form (setup_context and a vmap rule)."""

    @staticmethod
    def forward(ctx, mean, std, op, want_var):
        out = op.forward(mean.contiguous(), std.contiguous(), want_var, True)
        _FastMoments.setup_context(ctx, (mean, std, op, want_var, True), out)
        ctx.plain = True  # no functorch wrappers anywhere: the backward may call the kernels directly
        return out

    @staticmethod
    def backward(ctx, grad_phi, grad_ups, grad_var, *rest):
        return _FastMoments.backward(ctx, grad_phi, grad_ups, grad_var, *rest)[:4]


def moments(op: KernelHandle, mean: torch.Tensor, std: torch.Tensor, want_var: bool) -> Tuple[torch.Tensor, ...]:
    """``(Phi, Upsilon, Var)`` of broadcast CPU float tensors through ``op``'s kernels.

    The variance is an empty placeholder when ``want_var`` is false.
    """
    need_grad = torch.is_grad_enabled() and (mean.requires_grad or std.requires_grad)
    transformed = is_transformed(mean) or is_transformed(std)
    if not transformed:
        if not need_grad:  # no autograd and no functorch: call the kernel directly
            return op.forward(mean.contiguous(), std.contiguous(), want_var, False)[:3]
        return _FastMomentsPlain.apply(mean, std, op, want_var)[:3]
    return _FastMoments.apply(mean, std, op, want_var, need_grad)[:3]


class _ReLUMean(torch.autograd.Function):
    """E[relu(z)] alone, for prediction without autograd (``ReLU.mean`` under ``torch.no_grad``)."""

    @staticmethod
    def forward(mean, std):
        mean = mean.contiguous()
        std = std.contiguous()
        phi = torch.empty(mean.shape, dtype=mean.dtype)
        kernel_function("relu_mean", mean.dtype)(
            mean.numel(), mean.data_ptr(), std.data_ptr(), phi.data_ptr(), torch.get_num_threads()
        )
        return phi

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - only used without autograd
        raise RuntimeError("cfbnn: the mean-only ReLU kernel has no backward; call .moments() under autograd")

    @staticmethod
    def vmap(info, in_dims, mean, std):
        mean, std = torch.broadcast_tensors(*align_batched(mean, std, in_dims))
        return _ReLUMean.apply(mean, std), 0


def relu_mean(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``E[relu(z)]`` of broadcast CPU tensors without autograd."""
    if is_transformed(mean) or is_transformed(std):
        return _ReLUMean.apply(mean, std)
    return _ReLUMean.forward(mean, std)
