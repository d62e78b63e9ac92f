"""Which kernel serves which device is decided once, when ``cfbnn_cli.moments`` is imported: every
``cfbnn::`` operator's default kernel (``CompositeExplicitAutograd``) is its reference formula, and
right after the import -- before any call -- the CPU key holds the C++ library's kernel (registered
from ``csrc/moment_ops.cpp`` and ``csrc/elbo_ops.cpp``) or nothing (the operators without a C++ kernel, which then run their
default), never a Python kernel that a later load would replace. Without the library (an install
without a compiler) no CPU kernel is registered at all, and the operators still compute, on their
reference kernels. Read from the dispatcher's own table (``torch._C._dispatch_dump``), in fresh
processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from reference_kernels import PRELUDE, package_without_library

from cfbnn_cli.moments import extension

REPO = Path(__file__).resolve().parents[2]

DUMP = r"""
import json, torch
import cfbnn_cli.moments
from cfbnn_cli.moments import extension

names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("cfbnn::"))
table = {}
for name in names:
    lines = torch._C._dispatch_dump(name).splitlines()
    keys = {line.split(":")[0]: line for line in lines if ": registered at " in line}
    table[name] = {key: keys[key].split(" registered at ")[1].split(" :: ")[0] for key in keys}
mean, std = torch.randn(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64) + 0.1
phi = torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)[0]
print(json.dumps({"library": extension.status()["loaded"], "table": table,
                  "phi": phi.tolist(), "mean": mean.tolist(), "std": std.tolist()}))
"""


def _dump(package=str(REPO)) -> dict:
    environment = dict(os.environ, CFBNN_TEST_PACKAGE=package)
    environment.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-c", PRELUDE + DUMP]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_the_reference_is_every_default(table: dict) -> None:
    assert len(table) >= 20, sorted(table)  # every operator of the package, not a few
    for name, keys in table.items():
        assert "CompositeExplicitAutograd[alias]" in keys, (name, keys)
        assert ".py:" in keys["CompositeExplicitAutograd[alias]"], (name, keys)  # (Python's reference)


def _assert_relu_phi(out: dict) -> None:
    import torch

    from cfbnn_cli.moments.gaussian import standard_normal_cdf, standard_normal_pdf

    mean, std = torch.tensor(out["mean"], dtype=torch.float64), torch.tensor(out["std"], dtype=torch.float64)
    t = mean / std  # E[relu(z)] = m Phi(m/s) + s phi(m/s), eq. (20)
    want = mean * standard_normal_cdf(t) + std * standard_normal_pdf(t)
    torch.testing.assert_close(torch.tensor(out["phi"], dtype=torch.float64), want, rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(not extension.status()["loaded"], reason="the C++ CPU kernels were not built here")
def test_after_the_import_the_cpu_key_holds_the_cpp_kernel_or_nothing():
    out = _dump()
    assert out["library"]
    _assert_the_reference_is_every_default(out["table"])
    cpu = {name: keys["CPU"] for name, keys in out["table"].items() if "CPU" in keys}
    assert all(
        where.startswith("/") and ("moment_ops.cpp:" in where or "elbo_ops.cpp:" in where) for where in cpu.values()
    ), cpu
    # the ELBO's steps and the activations' moments: C++ on the CPU from the import on
    for name in ("cfbnn::relu_family_moments", "cfbnn::relu_tail_with_gradients", "cfbnn::normal_elbo_rows"):
        assert name in cpu, sorted(cpu)
    _assert_relu_phi(out)


def test_without_the_library_no_cpu_kernel_is_registered(tmp_path):
    out = _dump(package_without_library(tmp_path))
    assert not out["library"]
    _assert_the_reference_is_every_default(out["table"])
    assert not [name for name, keys in out["table"].items() if "CPU" in keys]
    _assert_relu_phi(out)  # the reference kernel computed it
