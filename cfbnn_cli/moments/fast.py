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

Beyond the moments the library holds kernels of the closed-form ELBO itself (used by
:mod:`cfbnn_cli.bnn.fused`): ``tail_pass``, the last hidden layer's moments, a one-output
layer integrated exactly and their gradients in one pass over the block each way
(:func:`normal_tail`), with the Normal likelihood's rows around it in one loop each
(:func:`normal_rows`, :func:`normal_row_gradients`, :func:`normal_output_gradients`);
``hidden_pass``, a hidden layer's moments from its pre-activations' variances
(:func:`moments_from_variance`; it can write ``[Phi, 1]`` and ``[Ups, 1]`` for the next
layer's bias); and the KL of a mean-field matrix and its gradients in one pass each
(:func:`diagonal_kl_sums`, :func:`diagonal_kl_gradients`).

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

import contextlib
import ctypes
import math
import os
import threading
import warnings
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from . import kernel_build
from .gaussian import (
    align_batched,
    is_transformed,
    register_negative_counter,
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

_ENV_SWITCH = "CFBNN_FAST_MOMENTS"
_ENV_CACHE = "CFBNN_CACHE_DIR"
_ABI = 15  # must match CFBNN_ABI in the source


def _switch_from_environment() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


class _State:
    enabled = _switch_from_environment()
    library = None  # the loaded ctypes library
    tried = False  # a load/build was attempted (successful or not)
    info: Dict[str, object] = {}
    lock = threading.Lock()


def set_fast_path(enabled: bool) -> None:
    """Turn the fast CPU kernels on (the default) or off (the reference torch path) globally."""
    _State.enabled = bool(enabled)


def fast_path_enabled() -> bool:
    """Whether the fast path is switched on (it may still be unavailable: see :func:`fast_path_info`)."""
    return _State.enabled


@contextlib.contextmanager
def fast_path(enabled: bool = True):
    """``with fast_path(False): ...`` runs the reference path in a block (restored after)."""
    previous = _State.enabled
    set_fast_path(enabled)
    try:
        yield
    finally:
        set_fast_path(previous)


def fast_path_info() -> Dict[str, object]:
    """Whether the kernels are available and how they were built (building them if needed).

    Keys: ``enabled``, ``available``, ``library`` (path), ``cached`` (found on disk),
    ``build_seconds`` (compile time of this process's build, 0 if cached),
    ``load_seconds``, ``flags``, ``openmp``, ``error`` (why not available).
    """
    if _State.enabled or _State.tried:
        load_kernels()
    info = dict(_State.info) if _State.tried else {"error": "not built: the fast path is switched off"}
    info["enabled"] = _State.enabled
    info["available"] = _State.library is not None
    return info


# --------------------------------------------------------------------------- building


def _reference_values():
    """ReLU (Phi, Upsilon) at mean in {-3, 0, 1.5}, std in {1, 0.5, 2}, float64 (math.erfc)."""
    out = []
    for m, s in ((-3.0, 1.0), (0.0, 0.5), (1.5, 2.0)):
        t = m / s
        cdf = 0.5 * math.erfc(-t / math.sqrt(2.0))
        pdf = math.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
        phi = m * cdf + s * pdf
        ups = (m * m + s * s) * cdf + m * s * pdf
        out.append((m, s, phi, ups))
    return out


def _self_test(library) -> Optional[str]:
    """A wrong build (a broken vector math library, say) must not be used: check known values."""
    cases = _reference_values()
    mean = np.array([c[0] for c in cases] * 40, dtype=np.float64)  # > one block: the padded path too
    std = np.array([c[1] for c in cases] * 40, dtype=np.float64)
    phi = np.empty_like(mean)
    ups = np.empty_like(mean)
    _bind(library)
    library.relu_forward_f64(
        mean.size, mean.ctypes.data, std.ctypes.data, phi.ctypes.data, ups.ctypes.data, None, None, None, 1
    )
    expected_phi = np.array([c[2] for c in cases] * 40)
    expected_ups = np.array([c[3] for c in cases] * 40)
    error = max(
        np.max(np.abs(phi - expected_phi) / np.abs(expected_phi)),
        np.max(np.abs(ups - expected_ups) / np.abs(expected_ups)),
    )
    if not error <= 1e-12:
        return f"self-test failed (relative error {error:.2e})"
    return None


_POINTER = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_DOUBLE = ctypes.c_double

_SIGNATURES = {
    "relu_forward": [_I64] + [_POINTER] * 7 + [_INT],
    "relu_mean": [_I64] + [_POINTER] * 3 + [_INT],
    "relu_backward": [_I64] + [_POINTER] * 3 + [_POINTER, _INT] * 3 + [_POINTER, _POINTER, _INT],
    "leaky_backward": [_I64, _POINTER, _POINTER, _DOUBLE, _POINTER] + [_POINTER, _INT] * 3 + [_POINTER, _POINTER, _INT],
    "relusq_backward": [_I64] + [_POINTER] * 3 + [_POINTER, _INT] * 3 + [_POINTER, _POINTER, _INT],
    "leaky_forward": [_I64, _POINTER, _POINTER, _DOUBLE] + [_POINTER] * 7 + [_INT],
    "relusq_forward": [_I64] + [_POINTER] * 9 + [_INT],
    "identity_forward": [_I64] + [_POINTER] * 5 + [_INT],
    "partials_backward": [_I64] + [_POINTER] * 5 + [_POINTER, _INT] * 3 + [_POINTER, _POINTER, _INT],
    "pw_forward": [_I64, _POINTER, _POINTER, _INT, _INT] + [_POINTER] * 16 + [_INT],
    "count_negative": [_I64, _POINTER, _INT],
    "diag_kl_sums": [_I64] + [_POINTER] * 4 + [_INT],
    "diag_gradient_finish": [_I64, _POINTER, _POINTER, _DOUBLE, _DOUBLE, _DOUBLE, _POINTER, _POINTER, _INT],
    "hidden_pass": [_INT, _INT, _I64, _POINTER, _POINTER, _DOUBLE] + [_POINTER] * 8 + [_I64, _INT],
    "tail_pass": [_INT, _INT, _I64, _I64, _POINTER, _POINTER, _DOUBLE] + [_POINTER] * 10 + [_INT],
    "diag_kl_backward": [_I64, _POINTER, _POINTER, _DOUBLE, _DOUBLE, _POINTER, _POINTER, _INT],
    "augment_pair": [_I64, _I64, _POINTER, _POINTER, _POINTER, _INT],
    "normal_rows": [_I64] + [_POINTER] * 3 + [_DOUBLE] * 4 + [_POINTER] * 3,
    "normal_row_gradients": [_I64] + [_POINTER] * 3 + [_DOUBLE] + [_POINTER] * 3,
    "normal_output_gradients": [_I64, _POINTER, _POINTER, _INT, _DOUBLE, _DOUBLE, _POINTER, _POINTER],
}
_RESULT_TYPES = {"count_negative": ctypes.c_int64, "normal_rows": ctypes.c_double}
_SIGNATURES_F32_ONLY = {
    "hs_forward": [_I64, _POINTER, _POINTER, _INT, _INT]
    + [_POINTER] * 9
    + [_DOUBLE, _DOUBLE]
    + [_POINTER] * 7
    + [_INT],
    "hs_backward": [_I64, _POINTER, _POINTER, _INT, _INT]
    + [_POINTER] * 9
    + [_DOUBLE, _DOUBLE, _POINTER]
    + [_POINTER, _INT] * 3
    + [_POINTER, _POINTER, _INT],
}


def _bind(library) -> None:
    for name, argtypes in _SIGNATURES.items():
        for suffix in ("_f32", "_f64"):
            function = getattr(library, name + suffix)
            function.argtypes = argtypes
            function.restype = _RESULT_TYPES.get(name)
    for name, argtypes in _SIGNATURES_F32_ONLY.items():
        function = getattr(library, name + "_f32")
        function.argtypes = argtypes
        function.restype = None
    library.cfbnn_abi.restype = ctypes.c_int
    library.cfbnn_openmp.restype = ctypes.c_int


def load_kernels(rebuild: bool = False):
    """The kernel library (``ctypes.CDLL``), built and loaded on first use; ``None`` if unavailable.

    ``rebuild=True`` ignores the on-disk cache (and the result of an earlier attempt).
    """
    if _State.tried and not rebuild:
        return _State.library
    with _State.lock:
        if _State.tried and not rebuild:
            return _State.library
        _State.library, _State.info = _load(rebuild)
        _State.tried = True
        if _State.library is None:
            reason = str(_State.info.get("error") or "unknown reason").splitlines()
            warnings.warn(
                "cfbnn: the fast CPU moment kernels are unavailable; using the reference torch path. "
                + "\n".join(reason[-14:]),  # the plainest flag set's compiler message, last
                RuntimeWarning,
                stacklevel=3,
            )
    return _State.library


def _load(rebuild: bool):
    return kernel_build.load_library(_ABI, _bind, _self_test, rebuild)


# --------------------------------------------------------------------------- dispatch


def usable(mean: torch.Tensor) -> bool:
    """Whether ``mean`` (already checked and of one dtype/device with std) takes the fast path."""
    if not _State.enabled or mean.device.type != "cpu" or mean.dtype not in _SUFFIX:
        return False
    if torch.compiler.is_compiling():
        return False
    return (_State.library if _State.tried else load_kernels()) is not None


_SUFFIX = {torch.float32: "_f32", torch.float64: "_f64"}


def count_negative(x: torch.Tensor) -> Optional[int]:
    """Number of entries < 0 of a CPU float tensor, or None where the kernels do not apply."""
    if not _State.enabled or x.dtype not in _SUFFIX or not x.is_contiguous() or is_transformed(x):
        return None
    if (_State.library if _State.tried else load_kernels()) is None:
        return None
    return _kernel("count_negative", x.dtype)(x.numel(), x.data_ptr(), torch.get_num_threads())


register_negative_counter(count_negative)  # argument checks count on the CPU in one kernel pass


def _kernel(name: str, dtype: torch.dtype):
    return getattr(_State.library, name + _SUFFIX[dtype])


def _ptr(tensor: Optional[torch.Tensor]):
    return None if tensor is None else tensor.data_ptr()


def _grad_arg(grad: Optional[torch.Tensor]):
    """(pointer, is_scalar) for a gradient: absent, a broadcast scalar (all strides 0) or dense."""
    if grad is None:
        return None, 0, None
    if grad.is_contiguous():
        return grad.data_ptr(), 0, grad
    if grad.dim() > 0 and all(stride == 0 for stride in grad.stride()):
        return grad.data_ptr(), 1, grad
    grad = grad.contiguous()
    return grad.data_ptr(), 0, grad


def _plain(*tensors) -> bool:
    """All present tensors are ordinary CPU tensors the kernels can read (no functorch wrappers)."""
    return all(t is None or (t.device.type == "cpu" and not is_transformed(t)) for t in tensors)


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


MAX_BREAKPOINTS = 64
MAX_DEGREE = 16


def piecewise_supported(breakpoints, polynomials) -> bool:
    """Whether the engine kernel takes this piecewise polynomial (else the reference path runs)."""
    return len(breakpoints) <= MAX_BREAKPOINTS and max(len(p) - 1 for p in polynomials) <= MAX_DEGREE


def _taylor(coefficients: np.ndarray, point: float) -> np.ndarray:
    """Coefficients of p(point + u) in powers of u."""
    degree = len(coefficients) - 1
    return np.array(
        [
            sum(math.comb(k, j) * coefficients[k] * point ** (k - j) for k in range(j, degree + 1))
            for j in range(degree + 1)
        ]
    )


def _derivative(coefficients: np.ndarray) -> np.ndarray:
    return (
        np.array([k * coefficients[k] for k in range(1, len(coefficients))]) if len(coefficients) > 1 else np.zeros(1)
    )


def _pad(vector, length):
    out = np.zeros(length)
    vector = np.asarray(vector, dtype=np.float64)[:length]
    out[: len(vector)] = vector
    return out


def _piecewise_tables(breakpoints, polynomials, dtype) -> Dict[str, object]:
    """Host-side constants of the engine kernel (layout: see ``Spec`` in the kernel source)."""
    if dtype == torch.float32:  # what float32 torch arithmetic uses
        breakpoints = [float(np.float32(b)) for b in breakpoints]
        polynomials = [np.asarray(p, dtype=np.float32).astype(np.float64) for p in polynomials]
    B = len(breakpoints)
    D = max(len(p) - 1 for p in polynomials)
    K = 2 * D
    P = B + 1
    coef = np.zeros((P, D + 1))
    deriv = np.zeros((P, D + 1, D + 1))
    for i, p in enumerate(polynomials):
        coef[i, : len(p)] = p
        for k in range(D + 1):
            for j in range(D + 1 - k):
                deriv[i, k, j] = math.comb(j + k, k) * coef[i, j + k]
    side = np.zeros((P, 2))
    tails = np.zeros((P, 2, 6, K + 1))
    for i, p in enumerate(polynomials):
        for s, j in ((0, i - 1), (1, i)):
            if not 0 <= j < B:
                continue
            alpha = _pad(_taylor(np.asarray(p, dtype=np.float64), breakpoints[j]), D + 1)
            side[i, s] = alpha[0]
            a1 = alpha.copy()
            a1[0] = 0.0
            beta = _pad(_derivative(alpha), D + 1)
            gamma = _pad(_derivative(beta[:D] if D else beta), D + 1)
            vectors = (
                a1,
                np.convolve(a1, a1),
                beta,
                np.convolve(a1, beta),
                gamma,
                np.convolve(beta, beta) + np.convolve(a1, gamma),
            )
            for v, vector in enumerate(vectors):
                tails[i, s, v] = _pad(vector, K + 1)
    jumps = np.zeros((max(B, 1), 4))
    for j, b in enumerate(breakpoints):
        left, right = polynomials[j], polynomials[j + 1]
        jumps[j] = (
            np.polynomial.polynomial.polyval(b, left),
            np.polynomial.polynomial.polyval(b, right),
            np.polynomial.polynomial.polyval(b, _derivative(np.asarray(left, dtype=np.float64))),
            np.polynomial.polynomial.polyval(b, _derivative(np.asarray(right, dtype=np.float64))),
        )
    nodes, weights = np.polynomial.legendre.leggauss(16)
    return {
        "B": B,
        "D": D,
        "bp": np.ascontiguousarray(np.array(breakpoints if B else [0.0], dtype=np.float64)),
        "coef": np.ascontiguousarray(coef),
        "deriv": np.ascontiguousarray(deriv),
        "side": np.ascontiguousarray(side),
        "tails": np.ascontiguousarray(tails),
        "jumps": np.ascontiguousarray(jumps),
        "gl": np.ascontiguousarray(np.concatenate([nodes, weights])),
        "coef32": np.ascontiguousarray(coef.astype(np.float32)),
        "bp32": np.ascontiguousarray(np.array(breakpoints if B else [0.0], dtype=np.float32)),
    }


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


def _kl_kernels_apply(*tensors) -> bool:
    """Whether the KL and tail kernels take these tensors (plain contiguous CPU float32/float64
    of one dtype). Called on the hot path: the cheap global tests first."""
    if not _State.enabled or torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return False
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX:
        return False
    for tensor in tensors:
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return False
    return (_State.library if _State.tried else load_kernels()) is not None


def diagonal_kl_sums(
    loc: torch.Tensor, log_scale: torch.Tensor, variance_out: Optional[torch.Tensor] = None
) -> Optional[Tuple[float, float, float]]:
    """``(sum exp(2 log_scale), sum loc^2, sum log_scale)`` in one pass (float64 sums), or None
    where the kernels do not apply: what KL(q || N(0, s^2 I)) of a mean-field matrix needs.
    ``variance_out`` (contiguous, like ``log_scale``) receives ``exp(2 log_scale)`` in the same pass."""
    if not _kl_kernels_apply(loc, log_scale):
        return None
    out = np.empty(3, dtype=np.float64)
    _kernel("diag_kl_sums", loc.dtype)(
        loc.numel(), loc.data_ptr(), log_scale.data_ptr(), out.ctypes.data, _ptr(variance_out), torch.get_num_threads()
    )
    return float(out[0]), float(out[1]), float(out[2])


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
    _kernel("diag_gradient_finish", loc.dtype)(
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
    _kernel("diag_kl_backward", loc.dtype)(
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


def layer_kernels_apply(op: Optional[_Op], *tensors) -> bool:
    """Whether the layer kernels (:func:`normal_tail`, :func:`moments_from_variance`) run for
    ``op`` on these tensors: plain contiguous CPU float32/float64 tensors of one dtype, an
    activation with those kernels (ReLU, leaky ReLU, ReLU^2), the fast path on."""
    return op is not None and op.tail_kind is not None and _kl_kernels_apply(*tensors)


def normal_tail(
    op: _Op,
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
    eps = op._eps(mean.dtype)
    eps = eps[0] if eps else 0.0
    function = _kernel("tail_pass", mean.dtype)
    if row_mean_grad is None:
        mean_sum, spread_sum = mean.new_empty(rows), mean.new_empty(rows)
        function(
            op.tail_kind,
            0,
            rows,
            width,
            mean.data_ptr(),
            std.data_ptr(),
            eps,
            weight_phi.data_ptr(),
            weight_variance.data_ptr(),
            weight_second.data_ptr(),
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
    function(
        op.tail_kind,
        1,
        rows,
        width,
        mean.data_ptr(),
        std.data_ptr(),
        eps,
        weight_phi.data_ptr(),
        weight_variance.data_ptr(),
        weight_second.data_ptr(),
        row_mean_grad.data_ptr(),
        row_spread_grad.data_ptr(),
        None,
        None,
        grad_mean.data_ptr(),
        grad_std.data_ptr(),
        columns.data_ptr(),
        threads,
    )
    return grad_mean, grad_std, columns


def augment_pair(x: torch.Tensor):
    """``([x, 1], [x^2, 1])`` in one pass (kernel ``augment_pair``), or ``None`` where the kernels
    do not take ``x`` (not a plain contiguous CPU float32/float64 tensor, torch.func transforms)."""
    if not _kl_kernels_apply(x):
        return None
    augmented = x.new_empty(*x.shape[:-1], x.shape[-1] + 1)
    squared = torch.empty_like(augmented)
    _kernel("augment_pair", x.dtype)(
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
):
    """The Normal likelihood's rows after :func:`normal_tail`'s forward pass, one loop (kernel
    ``normal_rows``): ``(residual, squares, ELL, sum ELL)`` with ``residual = y - mean_sum - mean_bias``,
    ``squares = spread_sum + spread_bias + residual^2`` and ``ELL = -precision/2 squares + log_term``
    (eq. (7), one output). ``residual`` and ``squares`` are written over ``mean_sum`` and ``spread_sum``."""
    ell = torch.empty_like(mean_sum)
    total = _kernel("normal_rows", mean_sum.dtype)(
        mean_sum.shape[0],
        mean_sum.data_ptr(),
        spread_sum.data_ptr(),
        y.data_ptr(),
        mean_bias,
        spread_bias,
        precision,
        log_term,
        mean_sum.data_ptr(),
        spread_sum.data_ptr(),
        ell.data_ptr(),
    )
    return mean_sum, spread_sum, ell, total


def normal_row_gradients(grad_ell: torch.Tensor, residual: torch.Tensor, squares: torch.Tensor, precision: float):
    """Before :func:`normal_tail`'s backward pass (kernel ``normal_row_gradients``): from ``g =
    dL/d ELL`` the rows' ``u = dL/d mean_sum = precision g residual`` and ``k = dL/d squares =
    -precision/2 g``, and ``(sum u, sum k, sum g (1/2 - precision/2 squares))``: the output bias's
    gradients and ``dL/d log precision``."""
    row_u, row_k = torch.empty_like(grad_ell), torch.empty_like(grad_ell)
    sums = np.empty(3, dtype=np.float64)
    _kernel("normal_row_gradients", grad_ell.dtype)(
        grad_ell.shape[0],
        grad_ell.data_ptr(),
        residual.data_ptr(),
        squares.data_ptr(),
        precision,
        row_u.data_ptr(),
        row_k.data_ptr(),
        sums.ctypes.data,
    )
    return row_u, row_k, float(sums[0]), float(sums[1]), float(sums[2])


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
    _kernel("normal_output_gradients", grad_loc.dtype)(
        columns.shape[1],
        columns.data_ptr(),
        weight_phi.data_ptr(),
        int(bias),
        sum_u,
        sum_k,
        grad_loc.data_ptr(),
        grad_variance.data_ptr(),
    )


class _MomentsFromVariance(torch.autograd.Function):
    """``(Phi, Upsilon, Var)`` of pre-activations given their means and variances (kernel
    ``hidden_pass``): the square root inside the kernel, and the backward pass returns the
    gradient with respect to the variance. Plain CPU tensors only (see :func:`moments_from_variance`)."""

    @staticmethod
    def forward(ctx, mean, variance, op, augmented: bool = False):
        # augmented (2-D inputs, called directly by fused's single-node ELBO, never through apply):
        # Phi and Upsilon as [Phi, 1] and [Ups, 1], the next layer's inputs with its bias column
        if augmented:
            rows, width = mean.shape
            phi, ups = mean.new_empty(rows, width + 1), mean.new_empty(rows, width + 1)
        else:
            width, phi, ups = 0, torch.empty_like(mean), torch.empty_like(mean)
        var = torch.empty_like(mean)
        eps = op._eps(mean.dtype)
        _kernel("hidden_pass", mean.dtype)(
            op.tail_kind,
            0,
            mean.numel(),
            mean.data_ptr(),
            variance.data_ptr(),
            eps[0] if eps else 0.0,
            phi.data_ptr(),
            ups.data_ptr(),
            var.data_ptr(),
            None,
            None,
            None,
            None,
            None,
            width,
            torch.get_num_threads(),
        )
        ctx.op = op
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mean, variance)
        return phi, ups, var

    @staticmethod
    def backward(ctx, grad_phi, grad_ups, grad_var):
        """The gradients of (Phi, Ups, Var) are ``(..., H)`` (without the bias column, augmented or not)."""
        mean, variance = ctx.saved_tensors
        grads = [None if g is None else g.contiguous() for g in (grad_phi, grad_ups, grad_var)]
        grad_mean, grad_variance = torch.empty_like(mean), torch.empty_like(variance)
        eps = ctx.op._eps(mean.dtype)
        _kernel("hidden_pass", mean.dtype)(
            ctx.op.tail_kind,
            1,
            mean.numel(),
            mean.data_ptr(),
            variance.data_ptr(),
            eps[0] if eps else 0.0,
            None,
            None,
            None,
            *(_ptr(g) for g in grads),
            grad_mean.data_ptr(),
            grad_variance.data_ptr(),
            0,
            torch.get_num_threads(),
        )
        return grad_mean, grad_variance, None


def moments_from_variance(op: Optional[_Op], mean: torch.Tensor, variance: torch.Tensor):
    """``(Phi, Upsilon, Var)`` for ``z ~ N(mean, variance)`` through one kernel pass each way, or
    ``None`` where the kernel does not apply (then take ``sqrt`` and ``Activation.moments``):
    an activation without it (only ReLU, leaky ReLU and ReLU^2 have it), tensors that are not
    plain contiguous CPU float32/float64 of one shape and dtype, torch.func transforms, the fast
    path off. The argument checks are the caller's."""
    if mean.shape != variance.shape or not layer_kernels_apply(op, mean, variance):
        return None
    return _MomentsFromVariance.apply(mean, variance, op)
