"""The CPU kernel library as Python sees it: whether the fast path is on (the switch the tests
and benchmarks use to choose the reference path), and the library loaded once per process (built
by :mod:`cfbnn_cli.moments.kernel_build`), self-tested, and then registering its C++ CPU kernels of
the ``cfbnn::`` operators with torch's dispatcher. Python calls four of its C entry points (its ABI
number, whether it has OpenMP, its self-test, the registration) and no kernel: every kernel is
reached through an operator."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import warnings
from typing import Dict, Optional

import torch

from . import kernel_build
from .gaussian import is_transformed, register_negative_counter

_ENV_SWITCH = "CFBNN_FAST_MOMENTS"
_ENV_CACHE = "CFBNN_CACHE_DIR"
_ENV_TWIN = "CFBNN_CUDA_TWIN"  # 1: the CUDA twin's process (tests), whose CPU kernels are Triton's
_ABI = 18  # must match CFBNN_ABI in the source


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
    """Turn our kernels on (the default) or off globally, on every device: off, every ``cfbnn::``
    route takes the reference torch formulas (the C++ kernels on the CPU and the Triton kernels on
    CUDA both unused), for comparisons or to rule the kernels out."""
    KernelState.enabled = bool(enabled)


def fast_path_enabled() -> bool:
    """Whether the fast path is switched on (it may still be unavailable: see :func:`fast_path_info`)."""
    return KernelState.enabled


@contextlib.contextmanager
def fast_path(enabled: bool = True):
    """``with fast_path(False): ...`` runs the reference path on every device in a block (restored
    after)."""
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
    ``load_seconds``, ``flags``, ``openmp``, ``error`` (why not available) and ``operators`` (the
    ``cfbnn::`` operators' C++ CPU kernels registered).
    """
    if KernelState.enabled or KernelState.tried:
        load_kernels()
    info = dict(KernelState.info) if KernelState.tried else {"error": "not built: the fast path is switched off"}
    info["enabled"] = KernelState.enabled
    info["available"] = KernelState.library is not None
    info["operators"] = KernelState.operators
    return info


# --------------------------------------------------------------------------- building


SELF_TEST_TOLERANCE = 1e-12  # the largest relative error of the library's self-test that is accepted


def _self_test(library) -> Optional[str]:
    """A wrong build (a broken vector math library, say) must not be used: the library checks its
    ReLU kernel at known points against closed forms it computes with ``erfc``
    (``cfbnn_self_test`` in ``csrc/cfbnn_ops.cpp``); why not to use it, or ``None``."""
    error = library.cfbnn_self_test()
    if not error <= SELF_TEST_TOLERANCE:
        return f"self-test failed (relative error {error:.2e})"
    return None


def _bind(library) -> None:
    """The library's four C entry points (nothing else of it is called from Python: its kernels
    are reached through the ``cfbnn::`` operators it registers)."""
    library.cfbnn_abi.restype = ctypes.c_int
    library.cfbnn_openmp.restype = ctypes.c_int
    library.cfbnn_self_test.restype = ctypes.c_double
    library.cfbnn_register_cpu_kernels.restype = ctypes.c_int


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
            KernelState.library.cfbnn_register_cpu_kernels()  # (once per process: it returns at a second call)
            KernelState.operators = True
        if KernelState.library is None:
            reason = str(KernelState.info.get("error") or "unknown reason").splitlines()
            warnings.warn(
                "cfbnn: the fast CPU moment kernels are unavailable; using the reference torch path. "
                + "\n".join(reason[-14:]),  # the plainest flag set's compiler message, last
                RuntimeWarning,
                stacklevel=3,
            )
    return KernelState.library


def register_cpu_kernels() -> None:
    """Called once, when :mod:`cfbnn_cli.moments` is imported (every operator declared): the C++
    library loaded -- built the first time on a machine (about 20 s), then taken from the cache in
    milliseconds -- and its CPU kernels registered with the dispatcher, so that which kernel runs is
    decided here and no call asks. Not where the kernels are switched off (``CFBNN_FAST_MOMENTS=0``:
    the reference kernels, every operator's default, serve the CPU for the whole process) nor in the
    CUDA twin's process (``CFBNN_CUDA_TWIN=1``: :mod:`.cuda_twin` gives the CPU the Triton kernels)."""
    if KernelState.enabled and os.environ.get(_ENV_TWIN) != "1":
        load_kernels()


def cpu_operators_registered() -> bool:
    """Whether the ``cfbnn::`` operators' CPU kernels are the C++ library's: it registers them when
    it has loaded and passed its self-test (``cfbnn_register_cpu_kernels``); ``False`` where it did
    not build or was not loaded (:func:`register_cpu_kernels`): the reference kernels serve."""
    return KernelState.operators


def load_library(rebuild: bool):
    """``(library or None, info)``: the library built or taken from the cache, its entry points
    bound and its self-test passed."""
    return kernel_build.load_library(_ABI, _bind, _self_test, rebuild)


# --------------------------------------------------------------------------- dispatch


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
    """Whether the kernel library is loaded (:func:`register_cpu_kernels`). ``torch.compile`` runs
    this eagerly and keeps the answer as a constant."""
    return KernelState.library is not None


# the argument checks' sign test in one pass of the library's kernel (cfbnn::count_negative); its
# reference kernel where the library is not loaded
_LIB = torch.library.Library("cfbnn", "FRAGMENT")
_LIB.define("count_negative(Tensor x) -> int")
_LIB.impl("count_negative", lambda x: int((x < 0).sum()), "CompositeExplicitAutograd")


def count_negative(x: torch.Tensor) -> Optional[int]:
    """Number of entries < 0 of a CPU float tensor through the library's kernel, or ``None`` where it
    does not serve (the caller then asks torch)."""
    if not KernelState.enabled or x.dtype not in (torch.float32, torch.float64) or is_transformed(x):
        return None
    if not library_loaded() or not KernelState.operators:
        return None
    return torch.ops.cfbnn.count_negative(x)


register_negative_counter(count_negative)  # argument checks count on the CPU in one kernel pass
