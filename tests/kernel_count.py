"""The kernels a call would launch on CUDA, counted on any device: each Triton launch, and each torch
operation that launches a kernel on CUDA (not a view, an allocation or a detach). On the CPU under
Triton's interpreter inside :func:`cuda_twin.cuda_twin` (tests/) that is the count of the CUDA route,
so a test without a GPU can bound the kernels of a training step (tests/test_kernel_count.py); on
a GPU, ``benchmarks/bench_operators.py --list-kernels`` counts the real launches with the profiler.

How: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every torch operation below
autograd -- the autograd engine's own (the backward pass's seed, say) too. A ``cfbnn::`` operator is
not counted itself: its kernel runs with the mode still on, so what it launches is counted (the
Triton launches, through the launcher's ``run``, and any torch operation the launch wrapper
makes). The torch operations inside a Triton launch (the interpreter's copies) are not counted.

What it cannot see: how many kernels one torch operation makes on CUDA. It counts one a call,
which is what the profiler shows for most (fused Adam over a few parameters is one
``multi_tensor_apply`` launch, a fill one kernel), but cuBLAS may add a split-K reduction kernel
to a matrix product. And it counts the CUDA route only where the CUDA route runs (on CUDA, or in
the twin): a ``cfbnn::`` operator's C++ CPU kernel makes torch calls of its own.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_kernels"]

_aten = torch.ops.aten
# torch operations that launch nothing on CUDA: allocations, detaching, scalar metadata
_NO_KERNEL = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.lift_fresh.default,
    _aten._unsafe_view.default,  # (a view whose schema does not say so)
    _aten.sym_size.int,
    _aten.sym_stride.int,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
}


def _is_view(func) -> bool:
    """Whether ``func`` returns a view of an input (``Tensor(a)`` in its schema, not written)."""
    returns = func._schema.returns
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns) and not func._schema.is_mutable


def launches_kernel(func) -> bool:
    """Whether the torch operation ``func`` launches a kernel on CUDA (one, as counted here): not
    the profiler's own markers (``record_function``), an allocation or a view."""
    return func.namespace != "profiler" and func not in _NO_KERNEL and not _is_view(func)


class _KernelCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels = collections.Counter()
        self.in_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_launch:  # (the interpreter's own handling of a launch's tensors)
            return func(*args, **kwargs)
        if func.namespace == "cfbnn":
            # the operator's kernel with the mode on again: its launches and torch operations count
            with self:
                return func.redispatch(_backend_keys(args, kwargs), *args, **kwargs)
        if launches_kernel(func):
            self.kernels[f"aten::{func._opname}"] += 1
        return func(*args, **kwargs)


def _backend_keys(args, kwargs) -> torch._C.DispatchKeySet:
    """The dispatch key of the operands' device (CPU, CUDA): the operator's own kernel there."""
    tensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    return torch._C.DispatchKeySet(torch._C._parse_dispatch_key(tensor.device.type.upper()))


def _launcher_classes():
    """The classes whose ``run`` launches a Triton kernel (the interpreter's and the compiler's)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - no Triton: torch operations only
        return ()
    return (InterpretedFunction, JITFunction)


@contextlib.contextmanager
def count_kernels() -> Iterator[collections.Counter]:
    """``with count_kernels() as kernels: step()``: ``kernels`` counts, by name, the kernels the
    calls inside would launch on CUDA (``triton::<kernel>`` and ``aten::<operation>``); see the
    module doc. ``sum(kernels.values())`` is the number of launches."""
    counter = _KernelCounter()
    originals = {cls: cls.run for cls in _launcher_classes()}

    def counted(run):
        def launch(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(self, *args, **kwargs)
            counter.kernels[f"triton::{self.fn.__name__}"] += 1
            counter.in_launch += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.in_launch -= 1

        return launch

    try:
        for cls, run in originals.items():
            cls.run = counted(run)
        with counter:
            yield counter.kernels
    finally:
        for cls, run in originals.items():
            cls.run = run
