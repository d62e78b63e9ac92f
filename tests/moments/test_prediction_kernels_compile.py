"""The prediction's Triton kernels (moments/triton_predict_kernels.py) compiled for an H100/H200
(sm_90a) without a GPU, by Triton's own compiler and ptxas: what the interpreter cannot show (the
types the compiler infers, constexpr branches, register spills). Their values are tested under the
interpreter (prediction_check.py) and on CUDA."""

import os
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as compile_kernel  # noqa: E402

from cfbnn_cli.moments import triton_kernels, triton_predict_kernels  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
FLOOR = {"fp32": 1.1754943508222875e-38, "fp64": 2.2250738585072014e-308}
DEPTH = {"fp32": triton_kernels.CF_DEPTH_F32, "fp64": triton_kernels.CF_DEPTH}


def _spill_stores(kernel, dtype, constants, tmp_path) -> int:
    """Compile ``kernel`` for sm_90a (its ``prediction`` tuple: three pointers, then rows, width, the
    second half's offset) and return ptxas' spill stores."""
    signature = {"prediction": (f"*{dtype}",) * 3 + ("i32",) * 3}
    signature.update({name: "constexpr" for name in constants})
    compiled = compile_kernel(ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))
    ptx = tmp_path / f"{kernel.__name__}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    report = subprocess.run(
        [PTXAS, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull], capture_output=True, text=True, check=True
    ).stderr
    return int(re.search(r"(\d+) bytes spill stores", report).group(1))


def _compile_both(dtype, activation, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # compiled here, not found in a cache
    tile = {"BIAS": 1, "BLOCK_R": 8, "BLOCK_C": 128}
    operand = _spill_stores(
        triton_predict_kernels.prediction_operand_kernel, dtype, {"ACTIVATION": activation, **tile}, tmp_path
    )
    assert operand == 0
    if activation >= 0:
        constants = {"ACTIVATION": activation, "FLOOR": FLOOR[dtype], "CF_DEPTH": DEPTH[dtype], **tile}
        assert _spill_stores(triton_predict_kernels.prediction_hidden_mean_kernel, dtype, constants, tmp_path) == 0


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton has no NVIDIA backend")
def test_the_relu_kernels_compile_for_sm90_without_spills(tmp_path, monkeypatch):
    _compile_both("fp32", 0, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton has no NVIDIA backend")
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("activation", [-1, 0, 1, 2])
def test_every_variant_compiles_for_sm90_without_spills(dtype, activation, tmp_path, monkeypatch):
    _compile_both(dtype, activation, tmp_path, monkeypatch)
