"""The closed-form ELBO's tail-pass Triton kernels (moments/triton_tail_kernels.py) compiled for an
H100/H200 (sm_90a) without a GPU, by Triton's own compiler and ptxas: what the interpreter cannot
show (the types the compiler infers, constexpr branches, register spills). Their values are tested
under the interpreter (tests/bnn/test_operator_elbo.py, tests/test_cuda_twin.py) and on CUDA."""

import os
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as compile_kernel  # noqa: E402

from cfbnn_cli.moments import triton_kernels, triton_tail_kernels  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
FLOOR = {"fp32": 1.1754943508222875e-38, "fp64": 2.2250738585072014e-308}
DEPTH = {"fp32": triton_kernels.CF_DEPTH_F32, "fp64": triton_kernels.CF_DEPTH}
# the kernel's tensors in the results' dtype; the leaky slope (the ``tail`` tuple's last) and the
# column sums are float64
TENSORS = ("y_ptr", "loc_ptr", "log_precision_ptr", "g_mean_ptr", "g_variance_ptr")


def _ptxas_report(dtype: str, activation: int, gradients: bool, tmp_path) -> str:
    """ptxas' report on ``relu_tail_kernel`` (with its gradients or not) compiled for sm_90a, at the
    launch's tile."""
    constants = {
        "FLOOR": FLOOR[dtype],
        "BLOCK_R": triton_tail_kernels.FORWARD_ROWS,
        "BLOCK_C": triton_tail_kernels.FORWARD_COLUMNS,
        "CF_DEPTH": DEPTH[dtype],
        "ACTIVATION": activation,
        "BIAS": 1,
        "GRADIENTS": gradients,
    }
    signature = {"tail": (f"*{dtype}",) * 5 + ("*fp64",), **{name: f"*{dtype}" for name in TENSORS}}
    signature.update({"sums": (f"*{dtype}",) * 2, "partial_ptr": "*fp64", "rows": "i32", "width": "i32"})
    signature["scale"] = "fp64"
    signature.update({name: "constexpr" for name in constants})
    kernel = triton_tail_kernels.relu_tail_kernel
    compiled = compile_kernel(ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))
    ptx = tmp_path / "relu_tail_kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    command = [PTXAS, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull]
    return subprocess.run(command, capture_output=True, text=True, check=True).stderr


def _assert_compiles_without_spills(dtype, activation, gradients, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # compiled here, not found in a cache
    report = _ptxas_report(dtype, activation, gradients, tmp_path)
    assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) == 0, report


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton has no NVIDIA backend")
def test_the_relu_tail_pass_with_its_gradients_compiles_for_sm90_without_spills(tmp_path, monkeypatch):
    _assert_compiles_without_spills("fp32", 0, True, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton has no NVIDIA backend")
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("activation", [0, 1, 2])
@pytest.mark.parametrize("gradients", [True, False])
def test_every_variant_compiles_for_sm90_without_spills(dtype, activation, gradients, tmp_path, monkeypatch):
    _assert_compiles_without_spills(dtype, activation, gradients, tmp_path, monkeypatch)
