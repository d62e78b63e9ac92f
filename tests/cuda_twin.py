"""The CUDA route on the CPU, for tests without a GPU: inside :func:`cuda_twin` every ``cfbnn::``
operator runs, for CPU tensors, the kernel a CUDA tensor dispatches to -- its Triton kernel, under
Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported, so in a process of its
own: tests/test_cuda_twin.py), or its reference kernel where CUDA has no kernel of its own (the
piecewise polynomials). A ``torch.library`` registration for the CPU key, removed on exit: the
package is the same code on either device (nothing in it asks which device a tensor is on), so this
is the whole difference.

What it cannot show: compilation by Triton for a GPU (the interpreter runs the kernels' Python
with numpy semantics), CUDA streams, CUDA graph capture and replay, and the GPU's own floating
point (fused multiply-adds, its ``exp``/``log``); tests/test_cuda.py covers those on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Callable, Dict, Iterator

from reference_kernels import kernels_for

from cfbnn_cli.moments.operators import HAVE_TRITON, OPERATORS

__all__ = ["cuda_kernels", "cuda_twin"]


def cuda_kernels() -> Dict[str, Callable]:
    """``{operator name: the kernel a CUDA tensor dispatches to}``: its Triton kernel where it has
    one (the operand checks, then the launch), else its reference kernel."""
    return {name: operator.cuda or operator.reference for name, operator in OPERATORS.items()}


def _counted(name: str, kernel: Callable, calls: collections.Counter) -> Callable:
    def run(*args):
        calls[name] += 1
        return kernel(*args)

    return run


@contextlib.contextmanager
def cuda_twin() -> Iterator[collections.Counter]:
    """``with cuda_twin() as calls: ...``: CPU tensors take the CUDA kernels (see the module's
    docstring); ``calls`` counts each operator's kernel calls, so a test can see that the Triton
    kernels ran. The CPU's own kernels come back on exit."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not HAVE_TRITON:
        raise RuntimeError("cuda_twin needs Triton and TRITON_INTERPRET=1 set before Triton is imported")
    calls = collections.Counter()
    with kernels_for({name: _counted(name, kernel, calls) for name, kernel in cuda_kernels().items()}):
        yield calls
