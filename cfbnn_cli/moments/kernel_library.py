"""The CPU kernel library as Python sees it: whether the fast path is on, the library loaded
once per process (built by :mod:`cfbnn_cli.moments.kernel_build`), each C function's argument
types declared once (``_SIGNATURES``), a self-test against known values, and the small helpers
every caller of a kernel uses (pointers, dtype suffixes, which tensors a kernel can read)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
import warnings
from typing import Dict, Optional

import numpy as np
import torch

from . import kernel_build
from .gaussian import is_transformed, register_negative_counter

_ENV_SWITCH = "CFBNN_FAST_MOMENTS"
_ENV_CACHE = "CFBNN_CACHE_DIR"
_ABI = 15  # must match CFBNN_ABI in the source


def _switch_from_environment() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


class KernelState:
    enabled = _switch_from_environment()
    library = None  # the loaded ctypes library
    operators = False  # its C++ kernels of the cfbnn:: operators are registered (csrc/cfbnn_ops.cpp)
    tried = False  # a load/build was attempted (successful or not)
    info: Dict[str, object] = {}
    lock = threading.Lock()


def set_fast_path(enabled: bool) -> None:
    """Turn the fast CPU kernels on (the default) or off (the reference torch path) globally."""
    KernelState.enabled = bool(enabled)


def fast_path_enabled() -> bool:
    """Whether the fast path is switched on (it may still be unavailable: see :func:`fast_path_info`)."""
    return KernelState.enabled


@contextlib.contextmanager
def fast_path(enabled: bool = True):
    """``with fast_path(False): ...`` runs the reference path in a block (restored after)."""
    previous = KernelState.enabled
    set_fast_path(enabled)
    try:
        yield
    finally:
        set_fast_path(previous)


def fast_path_info() -> Dict[str, object]:
    """Whether the kernels are available and how they were built (building them if needed).

    Keys: ``enabled``, ``available``, ``library`` (path of the cached file), ``loaded_from``
    (what was loaded: a sealed in-memory copy of that file's verified bytes, or a private
    copy where the system has no sealed files), ``cached`` (found on disk),
    ``build_seconds`` (compile time of this process's build, 0 if cached),
    ``load_seconds``, ``flags``, ``openmp``, ``error`` (why not available), ``operators``
    (the ``cfbnn::`` operators' C++ CPU kernels registered) and ``operators_error`` (why not).
    """
    if KernelState.enabled or KernelState.tried:
        load_kernels()
    info = dict(KernelState.info) if KernelState.tried else {"error": "not built: the fast path is switched off"}
    info["enabled"] = KernelState.enabled
    info["available"] = KernelState.library is not None
    info["operators"] = KernelState.operators
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
    if KernelState.tried and not rebuild:
        return KernelState.library
    with KernelState.lock:
        if KernelState.tried and not rebuild:
            return KernelState.library
        KernelState.library, KernelState.info = load_library(rebuild)
        KernelState.tried = True
        if KernelState.library is not None:
            KernelState.operators = KernelState.operators or register_cpu_operators(KernelState.library)
        if KernelState.library is None:
            reason = str(KernelState.info.get("error") or "unknown reason").splitlines()
            warnings.warn(
                "cfbnn: the fast CPU moment kernels are unavailable; using the reference torch path. "
                + "\n".join(reason[-14:]),  # the plainest flag set's compiler message, last
                RuntimeWarning,
                stacklevel=3,
            )
    return KernelState.library


def register_cpu_operators(library) -> bool:
    """Register the library's CPU kernels of the ``cfbnn::`` operators with torch's dispatcher
    (``cfbnn_register_cpu_kernels``); whether it has them (a library whose operators' unit did not
    build has not: ``fast_path_info()["operators_error"]``). They replace the Python CPU kernels,
    registered when :mod:`.elbo_ops` and :mod:`.tail_ops` were imported (before this: the later
    registration wins: the package's ``__init__`` imports those two before anything can load the
    library); registered once per process."""
    register = getattr(library, "cfbnn_register_cpu_kernels", None)
    if register is None:
        return False
    register.restype = ctypes.c_int
    register()
    return True


def cpu_operators_registered() -> bool:
    """Whether the ``cfbnn::`` operators' CPU kernels are the C++ library's (see
    :func:`register_cpu_operators`); ``False`` before the library was loaded."""
    return KernelState.operators


def load_library(rebuild: bool):
    """``(library or None, info)``: the kernels built or taken from the cache, bound and self-tested."""
    return kernel_build.load_library(_ABI, _bind, _self_test, rebuild)


# --------------------------------------------------------------------------- dispatch


def usable(mean: torch.Tensor) -> bool:
    """Whether ``mean`` (already checked and of one dtype/device with std) takes the fast path:
    :func:`library_takes`, outside ``torch.compile`` (the direct kernel calls pass data pointers,
    which a trace has not got; the ``cfbnn::`` operators are what a compiled graph calls)."""
    return not torch.compiler.is_compiling() and library_takes(mean)


def library_takes(mean: torch.Tensor) -> bool:
    """Whether the C++ library is in use for ``mean``: a CPU float32/float64 tensor, the fast path
    on and the library loaded (on first use)."""
    if not KernelState.enabled or mean.device.type != "cpu" or mean.dtype not in DTYPE_SUFFIX:
        return False
    return library_loaded()


def _assume_constant_result(fn):
    """:func:`torch.compiler.assume_constant_result` without its import of ``torch._dynamo`` (about
    2 s on a small CPU, for a decorator that only sets an attribute, ``_dynamo_marked_constant``,
    in torch 2.14): the mark set here where dynamo is not loaded yet, torch's decorator where it is
    (``tests/moments/test_import_cost.py`` checks that the two agree)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def library_loaded() -> bool:
    """Whether the kernel library is loaded, loading it on first use. ``torch.compile`` runs this
    eagerly and keeps the answer as a constant: the build, its lock and its self-test (ctypes
    calls) stay out of the trace."""
    return (KernelState.library if KernelState.tried else load_kernels()) is not None


DTYPE_SUFFIX = {torch.float32: "_f32", torch.float64: "_f64"}


def count_negative(x: torch.Tensor) -> Optional[int]:
    """Number of entries < 0 of a CPU float tensor, or None where the kernels do not apply."""
    if not KernelState.enabled or x.dtype not in DTYPE_SUFFIX or not x.is_contiguous() or is_transformed(x):
        return None
    if (KernelState.library if KernelState.tried else load_kernels()) is None:
        return None
    return kernel_function("count_negative", x.dtype)(x.numel(), x.data_ptr(), torch.get_num_threads())


register_negative_counter(count_negative)  # argument checks count on the CPU in one kernel pass


def kernel_function(name: str, dtype: torch.dtype):
    return getattr(KernelState.library, name + DTYPE_SUFFIX[dtype])


def data_pointer(tensor: Optional[torch.Tensor]):
    return None if tensor is None else tensor.data_ptr()


def gradient_pointer(grad: Optional[torch.Tensor]):
    """(pointer, is_scalar) for a gradient: absent, a broadcast scalar (all strides 0) or dense."""
    if grad is None:
        return None, 0, None
    if grad.is_contiguous():
        return grad.data_ptr(), 0, grad
    if grad.dim() > 0 and all(stride == 0 for stride in grad.stride()):
        return grad.data_ptr(), 1, grad
    grad = grad.contiguous()
    return grad.data_ptr(), 0, grad


def plain_tensors(*tensors) -> bool:
    """All present tensors are ordinary CPU tensors the kernels can read (no functorch wrappers)."""
    return all(t is None or (t.device.type == "cpu" and not is_transformed(t)) for t in tensors)
