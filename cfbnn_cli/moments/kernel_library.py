"""The CPU kernels as Python sees them: whether the fast path is on (the switch the tests and
benchmarks use to choose the reference path), and the C++ library (:mod:`.extension`, built when
cfbnn was installed) loaded once per process, its static registrations giving the ``cfbnn::``
operators their CPU kernels."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Dict, Optional

import torch

from . import extension
from .gaussian import is_transformed, register_negative_counter

_ENV_SWITCH = "CFBNN_FAST_MOMENTS"


def _switch_from_environment() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


class KernelState:
    enabled = _switch_from_environment()


def set_fast_path(enabled: bool) -> None:
    """Turn our kernels on (the default) or off globally, on every device: off, every ``cfbnn::``
    route takes the reference torch formulas."""
    KernelState.enabled = bool(enabled)


def fast_path_enabled() -> bool:
    """Whether the fast path is switched on."""
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
    """Whether the C++ CPU kernels are loaded (:func:`.extension.status`) and the switch."""
    info = extension.status()
    info.update(enabled=KernelState.enabled, available=info["loaded"], operators=info["loaded"], library=info["path"])
    return info


def load_kernels():
    """The loaded library's path, or ``None`` where the C++ CPU kernels are not loaded."""
    return extension.status()["path"] if extension.status()["loaded"] else None


def register_cpu_kernels() -> None:
    """Called once, when :mod:`cfbnn_cli.moments` is imported (every operator declared): the C++
    library loaded, its static registrations the CPU kernels. Not where the kernels are switched off
    (``CFBNN_FAST_MOMENTS=0``: the reference kernels serve the CPU for the whole process) nor in the
    CUDA twin's process (``CFBNN_CUDA_TWIN=1``: :mod:`.cuda_twin` gives the CPU the Triton kernels;
    the library's CPU autograd would stand in for the Python autograd the CUDA route runs)."""
    if KernelState.enabled and os.environ.get("CFBNN_CUDA_TWIN") != "1":
        extension.load()


def cpu_operators_registered() -> bool:
    """Whether the ``cfbnn::`` operators' CPU kernels are the C++ library's."""
    return bool(extension.status()["loaded"])


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
    """Whether the kernel library is loaded. ``torch.compile`` runs this eagerly and keeps the answer
    as a constant."""
    return bool(extension.status()["loaded"])


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
    if not library_loaded():
        return None
    return torch.ops.cfbnn.count_negative(x)


register_negative_counter(count_negative)  # argument checks count on the CPU in one kernel pass
