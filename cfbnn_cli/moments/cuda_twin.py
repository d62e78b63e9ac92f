"""The CUDA route on the CPU, for tests without a GPU: inside :func:`cuda_twin` a CPU tensor takes
every decision a CUDA tensor takes -- the ``cfbnn::`` operators where CUDA takes them, after the
same first-use checks, the reference torch ops where CUDA has no kernel (the C++ library is not
loaded in the twin's process: ``CFBNN_CUDA_TWIN=1``) -- and the dispatcher runs each operator's CUDA
kernel for it: the Triton kernels, under Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported, so in a process of its own: tests/test_cuda_twin.py).

What it cannot show: compilation by Triton for a GPU (the interpreter runs the kernels' Python
with numpy semantics), CUDA streams, CUDA graph capture and replay, and the GPU's own floating
point (fused multiply-adds, its ``exp``/``log``); tests/test_cuda.py covers those on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from typing import Callable, Dict, Iterator

import torch

from . import elbo_ops, kl_ops, ops, predict_ops, relu_mean_ops, tail_ops

__all__ = ["cuda_kernels", "cuda_twin"]

# the operators defined with torch.library.custom_op; elbo_ops' steps register theirs by key
CUSTOM_OPERATORS = (
    ops.relu_family_moments,
    ops.relu_family_moments_backward,
    kl_ops.diagonal_kl,
    kl_ops.diagonal_kl_backward,
    relu_mean_ops.relu_mean,
    tail_ops.relu_tail,
    tail_ops.relu_tail_backward,
    predict_ops.prediction_operand,
    predict_ops.prediction_hidden_mean,
)


def cuda_kernels() -> Dict[str, Callable]:
    """``{operator name: the kernel a CUDA tensor dispatches to}``: a custom_op's CUDA kernel if it
    registered one, else the function it was defined with (its default kernel: the operand checks,
    then the Triton launch); an ELBO step's Triton kernel (:data:`.elbo_ops.TRITON_KERNELS`)."""
    kernels = {
        operator._name.split("::")[-1]: operator._backend_fns.get("cuda", operator._init_fn)
        for operator in CUSTOM_OPERATORS
    }
    kernels.update(elbo_ops.TRITON_KERNELS)
    return kernels


def _counted(name: str, kernel: Callable, calls: collections.Counter) -> Callable:
    def run(*args):
        calls[name] += 1
        return kernel(*args)

    return run


@contextlib.contextmanager
def cuda_twin() -> Iterator[collections.Counter]:
    """``with cuda_twin() as calls: ...``: CPU tensors take the CUDA route (see the module's
    docstring); ``calls`` counts each operator's kernel calls, so a test can see that the Triton
    kernels ran. Restored on exit: the CPU kernels, the library's state, the first-use decisions.

    It needs a process started with ``CFBNN_CUDA_TWIN=1``, where the C++ library does not register
    its CPU kernels (:func:`.kernel_library.register_cpu_kernels`): they come with an autograd of
    their own for the CPU (``AutogradCPU``), which would stand in for the Python autograd the CUDA
    route runs; an operator the twin does not replace (the piecewise family's) runs its reference
    kernel there, as on CUDA."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not ops.HAVE_TRITON:
        raise RuntimeError("cuda_twin needs Triton and TRITON_INTERPRET=1 set before Triton is imported")
    calls = collections.Counter()
    library = torch.library.Library("cfbnn", "IMPL")
    first_use = dict(ops.FIRST_USE)
    for key in [key for key in ops.FIRST_USE if key[1].type == "cpu"]:  # decided afresh inside
        del ops.FIRST_USE[key]
    try:
        with warnings.catch_warnings():  # (replacing a registered CPU kernel is the point here)
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for name, kernel in cuda_kernels().items():
                library.impl(name, _counted(name, kernel, calls), "CPU")
        ops.TRITON_DEVICE_TYPES.add("cpu")
        yield calls
    finally:
        ops.TRITON_DEVICE_TYPES.discard("cpu")
        library._destroy()  # the CPU kernels registered before come back
        ops.FIRST_USE.clear()
        ops.FIRST_USE.update(first_use)
