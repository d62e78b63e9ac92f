"""Every Triton kernel the CUDA route launches, compiled for an H100/H200 (sm_90a) without a GPU,
with the argument types, constexprs and launch options of its real launches: recorded in the CUDA
twin under Triton's interpreter (kernel_launches.py, in a subprocess), then compiled here by
Triton's own compiler and its bundled ptxas. The interpreter runs a kernel's Python with numpy
semantics and does not enforce the compiler's rules (a module global that is not a
``tl.constexpr`` runs there and is refused by the compiler), and a kernel that does not compile
raises where it is first called on a GPU: every kernel must be known to compile.

Each launch must compile without register spills (ptxas' spill stores, as the tail and prediction
compile tests assert for the tiles they name). The default suite compiles the float32 ReLU launches
of every kernel (the prediction kernels at one wide layer's tile); the slow test every launch of
both dtypes and the three activations, the prediction kernels at every tile a layer's width can
pick. Values are tested elsewhere: under the interpreter (tests/test_cuda_twin.py,
tests/moments/test_ops.py) and on CUDA (tests/test_cuda.py)."""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from kernel_launches import launched_kernels, ptxas_path, recorded_launches, refusal  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
needs_nvidia_backend = pytest.mark.skipif(not os.path.exists(ptxas_path()), reason="this Triton has no NVIDIA backend")
EVERY_TILE = (1, 2, 4, 8, 16, 32, 64, 128)  # widths whose tiles (with the ones column and without) are all of them


def _assert_every_launch_compiles(dtypes, activations, tile_widths, tmp_path, monkeypatch, workers=1) -> list:
    launches = recorded_launches(dtypes, activations, tile_widths, REPO)
    recorded = {(launch["module"], launch["kernel"]) for launch in launches}
    assert recorded == launched_kernels(), sorted(launched_kernels() ^ recorded)  # every kernel with a grid
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # compiled here, not found in a cache
    monkeypatch.delenv("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", raising=False)  # the compiler's own rule
    directories = [tmp_path / str(index) for index in range(len(launches))]
    if workers > 1:  # (spawned: a forked torch process may hang)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            refusals = list(pool.map(refusal, launches, directories))
    else:
        refusals = list(map(refusal, launches, directories))
    failures = [reason for reason in refusals if reason]
    assert not failures, f"{len(failures)} of {len(launches)} launches:\n" + "\n".join(failures)
    return launches


def _constexpr_values(launches, kernel: str, name: str) -> set:
    values = set()
    for launch in (launch for launch in launches if launch["kernel"] == kernel):
        index = list(launch["signature"]).index(name)
        values |= {value for path, value in launch["constexprs"] if path == [index]}
    return values


@needs_nvidia_backend
def test_every_kernel_compiles_for_sm90_without_spills_in_its_float32_relu_launches(tmp_path, monkeypatch):
    launches = _assert_every_launch_compiles(["float32"], ["relu"], [200], tmp_path, monkeypatch)
    # the workload took both sides of the routes' choices: the ELBO summed and per row, with and
    # without the output bias, the tail pass with its gradients taken ahead and without, the
    # moments from the std and from the variance, the prediction operand with its activation folded in
    assert _constexpr_values(launches, "normal_rows_kernel", "PER_ROW") == {True, False}
    assert _constexpr_values(launches, "normal_rows_kernel", "BIAS") == {True, False}
    assert _constexpr_values(launches, "relu_tail_kernel", "GRADIENTS") == {True, False}
    assert _constexpr_values(launches, "moments_kernel", "FROM_VARIANCE") == {True, False}
    assert _constexpr_values(launches, "prediction_operand_kernel", "ACTIVATION") == {-1, 0}
    assert 128 in _constexpr_values(launches, "prediction_hidden_mean_kernel", "BLOCK_C")


@pytest.mark.slow
@needs_nvidia_backend
def test_every_launch_of_both_dtypes_and_every_activation_compiles_for_sm90_without_spills(tmp_path, monkeypatch):
    activations = ["relu", "leaky_relu", "relu_squared"]
    launches = _assert_every_launch_compiles(
        ["float32", "float64"], activations, EVERY_TILE, tmp_path, monkeypatch, workers=2
    )
    assert _constexpr_values(launches, "relu_tail_backward_kernel", "ACTIVATION") == {0, 1, 2}
    assert _constexpr_values(launches, "moments_backward_kernel", "CF_DEPTH") == {64, 80}  # float32, float64
    assert _constexpr_values(launches, "prediction_hidden_mean_kernel", "BLOCK_C") == set(EVERY_TILE)
