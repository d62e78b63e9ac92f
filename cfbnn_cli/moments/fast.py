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

The closed-form ELBO's own kernels are in :mod:`cfbnn_cli.moments.elbo_kernels`; the library's
loading and bindings in :mod:`cfbnn_cli.moments.kernel_library`.

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

from typing import Optional, Tuple

import numpy as np
import torch

from .gaussian import (
    align_batched,
    is_transformed,
    standard_normal_cdf,
    standard_normal_pdf,
    standardize,
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
    "ReLUOp",
    "LeakyReLUOp",
    "ReLUSquaredOp",
    "IdentityOp",
    "PiecewiseOp",
    "HardSigmoidOp",
]

from .elbo_kernels import (  # noqa: F401 - the ELBO kernels, re-exported for bnn.fused and bnn.network
    MomentsFromVariance,
    augment_pair,
    diagonal_kl_gradients,
    diagonal_kl_sums,
    finish_diagonal_gradients,
    layer_kernels_apply,
    moments_from_variance,
    normal_output_gradients,
    normal_row_gradients,
    normal_rows,
    normal_tail,
)
from .kernel_library import (  # noqa: F401 - the fast path's switches and library, re-exported
    _ABI,
    _ENV_CACHE,
    _ENV_SWITCH,
    _SUFFIX,
    _bind,
    _grad_arg,
    _kernel,
    _load,
    _plain,
    _ptr,
    _self_test,
    _State,
    count_negative,
    fast_path,
    fast_path_enabled,
    fast_path_info,
    load_kernels,
    set_fast_path,
    usable,
)
from .piecewise_tables import MAX_BREAKPOINTS, MAX_DEGREE, _piecewise_tables, piecewise_supported  # noqa: F401


class _Op:
    """One activation's kernels: forward -> (phi, ups, var, *saved); backward -> (d mean, d std)."""

    tail_kind: Optional[int] = None  # the kernel of :func:`normal_tail` for this activation (None: none)
    # the backward kernel needs only (mean, std, Phi, grads): it can be a function of its own
    # (:class:`_KernelBackward`), which a backward pass that builds a graph still runs
    backward_from_inputs = False

    def _eps(self, dtype):
        return ()

    def __init__(self, reference):
        # reference(mean, std) -> (phi, ups, var) through the eager torch path (differentiable)
        self.reference = reference

    def forward(self, mean, std, want_var, need_grad):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, mean, std, phi, saved, grads):  # pragma: no cover - abstract
        raise NotImplementedError

    def differentiable_backward(self, mean, std, phi, grads):
        """(d mean, d std) built from differentiable ops (double backward, torch.func): by default
        the vector-Jacobian product of the reference path."""
        return _reference_vjp(self, mean, std, grads)


def _outputs(mean, count):
    return [torch.empty(mean.shape, dtype=mean.dtype) for _ in range(count)]


def _partials_backward(phi, saved, grads, torch_ops=False, plain=False):
    """(d mean, d std) from the partials (dPhi/dm, dPhi/ds, dVar/dm, dVar/ds); Ups = Var + Phi^2."""
    pm, ps, vm, vs = saved
    gp, gu, gv = grads
    if not torch_ops and (plain or (_plain(phi, pm, gp, gu, gv) and _State.library is not None)):
        gm, gs = _outputs(phi, 2)
        (p_ptr, p_scalar, gp), (u_ptr, u_scalar, gu), (v_ptr, v_scalar, gv) = (_grad_arg(g) for g in grads)
        _kernel("partials_backward", phi.dtype)(
            phi.numel(),
            phi.data_ptr(),
            pm.data_ptr(),
            ps.data_ptr(),
            vm.data_ptr(),
            vs.data_ptr(),
            p_ptr,
            p_scalar,
            u_ptr,
            u_scalar,
            v_ptr,
            v_scalar,
            gm.data_ptr(),
            gs.data_ptr(),
            torch.get_num_threads(),
        )
        return gm, gs
    first = _combine(gp, None if gu is None else 2.0 * phi * gu)
    second = _combine(gu, gv)
    return _combine(_mul(pm, first), _mul(vm, second)), _combine(_mul(ps, first), _mul(vs, second))


def _mul(a, b):
    return None if b is None else a * b


def _combine(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


class ReLUOp(_Op):
    """ReLU: the forward saves nothing beyond its inputs and Phi; the backward kernel recomputes
    the two Gaussian factors block by block (cheaper than allocating, writing and re-reading
    them: on this path memory traffic and fresh pages cost more than an exp)."""

    saved_count = 0
    tail_kind = 0
    backward_from_inputs = True

    def forward(self, mean, std, want_var, need_grad):
        phi = torch.empty(mean.shape, dtype=mean.dtype)
        ups = torch.empty(mean.shape, dtype=mean.dtype)
        var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
        _kernel("relu_forward", mean.dtype)(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            phi.data_ptr(),
            ups.data_ptr(),
            _ptr(var),
            None,
            None,
            torch.get_num_threads(),
        )
        return phi, ups, var if var is not None else _placeholder(mean)

    def backward(self, mean, std, phi, saved, grads, plain=False):
        if plain or (_plain(mean, *grads) and _State.library is not None):
            gm = torch.empty(mean.shape, dtype=mean.dtype)
            gs = torch.empty(mean.shape, dtype=mean.dtype)
            (p_ptr, p_scalar, gp), (u_ptr, u_scalar, gu), (v_ptr, v_scalar, gv) = (_grad_arg(g) for g in grads)
            _kernel("relu_backward", mean.dtype)(
                mean.numel(),
                mean.data_ptr(),
                std.data_ptr(),
                phi.data_ptr(),
                p_ptr,
                p_scalar,
                u_ptr,
                u_scalar,
                v_ptr,
                v_scalar,
                gm.data_ptr(),
                gs.data_ptr(),
                torch.get_num_threads(),
            )
            return gm, gs
        with torch.no_grad():
            return self.differentiable_backward(mean, std, phi, grads)

    def differentiable_backward(self, mean, std, phi, grads):
        # as relu_reference.ReLUMomentsReference: the Gaussian factors recomputed differentiably, the saved
        # Phi (an output of this Function, so itself differentiable) reused
        t, _, _ = standardize(mean, std)
        cdf, cdf_neg, pdf = standard_normal_cdf(t), standard_normal_cdf(-t), standard_normal_pdf(t)
        partials = (cdf, pdf, 2.0 * phi * cdf_neg, 2.0 * (std * cdf - phi * pdf))
        return _partials_backward(phi, partials, grads, torch_ops=True)


class _PartialsOp(_Op):
    """Kernels that save the four partial derivatives (leaky relu, relu squared, piecewise)."""

    saved_count = 4

    def backward(self, mean, std, phi, saved, grads, plain=False):
        return _partials_backward(phi, saved, grads, plain=plain)


class _RecomputingOp(_Op):
    """Leaky ReLU and ReLU^2: like ReLU, nothing saved; the backward kernel recomputes the four
    partial derivatives per block (one cheap forward pass) instead of allocating four buffers."""

    saved_count = 0
    kernel = ""
    backward_from_inputs = True

    def forward(self, mean, std, want_var, need_grad):
        phi = torch.empty(mean.shape, dtype=mean.dtype)
        ups = torch.empty(mean.shape, dtype=mean.dtype)
        var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
        _kernel(self.kernel + "_forward", mean.dtype)(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            *self._eps(mean.dtype),
            phi.data_ptr(),
            ups.data_ptr(),
            _ptr(var),
            None,
            None,
            None,
            None,
            torch.get_num_threads(),
        )
        return phi, ups, var if var is not None else _placeholder(mean)

    def backward(self, mean, std, phi, saved, grads, plain=False):
        if plain or (_plain(mean, *grads) and _State.library is not None):
            gm = torch.empty(mean.shape, dtype=mean.dtype)
            gs = torch.empty(mean.shape, dtype=mean.dtype)
            (p_ptr, p_scalar, gp), (u_ptr, u_scalar, gu), (v_ptr, v_scalar, gv) = (_grad_arg(g) for g in grads)
            _kernel(self.kernel + "_backward", mean.dtype)(
                mean.numel(),
                mean.data_ptr(),
                std.data_ptr(),
                *self._eps(mean.dtype),
                phi.data_ptr(),
                p_ptr,
                p_scalar,
                u_ptr,
                u_scalar,
                v_ptr,
                v_scalar,
                gm.data_ptr(),
                gs.data_ptr(),
                torch.get_num_threads(),
            )
            return gm, gs
        # wrapped tensors without create_graph: the reference's vector-Jacobian product
        return _reference_vjp(self, mean, std, grads, create_graph=False)


class LeakyReLUOp(_RecomputingOp):
    kernel = "leaky"
    tail_kind = 1

    def __init__(self, reference, negative_slope):
        super().__init__(reference)
        self.negative_slope = negative_slope

    def _eps(self, dtype):
        eps = self.negative_slope
        if dtype == torch.float32:  # what float32 torch arithmetic multiplies by
            eps = float(np.float32(eps))
        return (eps,)


class ReLUSquaredOp(_RecomputingOp):
    kernel = "relusq"
    tail_kind = 2


class IdentityOp(_Op):
    saved_count = 0

    def forward(self, mean, std, want_var, need_grad):
        phi, ups = _outputs(mean, 2)
        var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
        _kernel("identity_forward", mean.dtype)(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            phi.data_ptr(),
            ups.data_ptr(),
            _ptr(var),
            torch.get_num_threads(),
        )
        return (phi, ups, var if var is not None else _placeholder(mean))

    def differentiable_backward(self, mean, std, phi, grads):
        return self.backward(mean, std, phi, (), grads)

    def backward(self, mean, std, phi, saved, grads, plain=False):
        gp, gu, gv = grads
        # Phi = mean, Var = std^2, Ups = Var + Phi^2
        grad_mean = _combine(gp, None if gu is None else 2.0 * phi * gu)
        second = _combine(gu, gv)
        grad_std = None if second is None else 2.0 * std * second
        return grad_mean, grad_std


class PiecewiseOp(_PartialsOp):
    def __init__(self, reference, breakpoints, polynomials):
        super().__init__(reference)
        self.tables = {dtype: _piecewise_tables(breakpoints, polynomials, dtype) for dtype in _SUFFIX}

    def forward(self, mean, std, want_var, need_grad):
        phi, ups = _outputs(mean, 2)
        var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
        saved = _outputs(mean, 4) if need_grad else [None] * 4
        tables = self.tables[mean.dtype]
        _kernel("pw_forward", mean.dtype)(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            tables["B"],
            tables["D"],
            *(
                tables[key].ctypes.data
                for key in ("bp", "coef", "deriv", "side", "tails", "jumps", "gl", "coef32", "bp32")
            ),
            phi.data_ptr(),
            ups.data_ptr(),
            _ptr(var),
            *(_ptr(t) for t in saved),
            torch.get_num_threads(),
        )
        return (phi, ups, var if var is not None else _placeholder(mean), *(t for t in saved if t is not None))


class HardSigmoidOp(PiecewiseOp):
    """The hard sigmoid: the engine's sums unrolled in one float32 kernel (the engine itself for
    float64 and, inside the kernel, for the rare elements it hands over). In float32 nothing is
    saved: the backward kernel recomputes the partials per block."""

    def __init__(self, reference, alpha, breakpoints, polynomials):
        super().__init__(reference, breakpoints, polynomials)
        self.a = float(np.float32(abs(alpha)))
        self.sign = 1.0 if alpha >= 0 else -1.0

    def _tables(self, dtype):
        tables = self.tables[dtype]
        return (tables["B"], tables["D"]) + tuple(
            tables[key].ctypes.data for key in ("bp", "coef", "deriv", "side", "tails", "jumps", "gl", "coef32", "bp32")
        )

    def forward(self, mean, std, want_var, need_grad):
        if mean.dtype != torch.float32:
            return super().forward(mean, std, want_var, need_grad)
        phi = torch.empty(mean.shape, dtype=mean.dtype)
        ups = torch.empty(mean.shape, dtype=mean.dtype)
        var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
        _State.library.hs_forward_f32(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            *self._tables(mean.dtype),
            self.a,
            self.sign,
            phi.data_ptr(),
            ups.data_ptr(),
            _ptr(var),
            None,
            None,
            None,
            None,
            torch.get_num_threads(),
        )
        return phi, ups, var if var is not None else _placeholder(mean)

    def backward(self, mean, std, phi, saved, grads, plain=False):
        if mean.dtype != torch.float32:
            return super().backward(mean, std, phi, saved, grads, plain=plain)
        if not (plain or (_plain(mean, *grads) and _State.library is not None)):
            return _reference_vjp(self, mean, std, grads, create_graph=False)
        gm = torch.empty(mean.shape, dtype=mean.dtype)
        gs = torch.empty(mean.shape, dtype=mean.dtype)
        (p_ptr, p_scalar, gp), (u_ptr, u_scalar, gu), (v_ptr, v_scalar, gv) = (_grad_arg(g) for g in grads)
        _State.library.hs_backward_f32(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            *self._tables(mean.dtype),
            self.a,
            self.sign,
            phi.data_ptr(),
            p_ptr,
            p_scalar,
            u_ptr,
            u_scalar,
            v_ptr,
            v_scalar,
            gm.data_ptr(),
            gs.data_ptr(),
            torch.get_num_threads(),
        )
        return gm, gs


def _placeholder(mean):
    """Stands in for an output that was not asked for (the variance)."""
    return mean.new_empty((0,))


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


def _reference_vjp(op, mean, std, grads, create_graph=True):
    """The vector-Jacobian product of the reference path (differentiable with create_graph)."""
    inputs = [t for t in (mean, std) if t.requires_grad]
    if not inputs:
        return None, None
    with torch.enable_grad():
        outputs = op.reference(mean, std)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return None, None
        found = torch.autograd.grad(
            [o for o, _ in pairs], inputs, [g for _, g in pairs], create_graph=create_graph, allow_unused=True
        )
    found = iter(found)
    grad_mean = next(found) if mean.requires_grad else None
    grad_std = next(found) if std.requires_grad else None
    return grad_mean, grad_std


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


def moments(op: _Op, mean: torch.Tensor, std: torch.Tensor, want_var: bool) -> Tuple[torch.Tensor, ...]:
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
        _kernel("relu_mean", mean.dtype)(
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
