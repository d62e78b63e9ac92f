"""Registration is cheap: ``import cfbnn_cli.bnn`` declares the ``cfbnn::`` operators and loads the
C++ library without importing Triton (the kernel modules are imported by the first Triton launch:
:class:`cfbnn_cli.moments.operators.LazyModule`) or torch's compiler stack (``torch._dynamo``).
Asserted on what a fresh process imports, not on timings (which vary twofold on a loaded machine);
docs/fast_path.md has the measured times."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("triton", "torch._dynamo", "torch._inductor")

IMPORT_ONLY = r"""
import json, sys
import torch
before = set(sys.modules)
import cfbnn_cli.bnn
print(json.dumps(sorted(set(sys.modules) - before)))
"""

IMPORT_THEN_USE = r"""
import importlib.util, json, sys
import torch
from cfbnn_cli.bnn import BayesianNetwork, ClosedFormBNN
from cfbnn_cli.moments import elbo_ops, extension, moment_ops, operators
from cfbnn_cli.moments.relu_family import reference_moments

torch.manual_seed(0)
x, y = torch.randn(16, 4), torch.randn(16)
for model in (ClosedFormBNN(4, 8), BayesianNetwork(4, [8, 8])):
    loss = model.elbo(x, y)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(model.predict(x).mean).all()
# a training step and a prediction on the CPU import nothing of torch's compiler stack
assert not (extension.status()["loaded"] and "torch._dynamo" in sys.modules), "torch._dynamo imported"
mean = torch.randn(7, 5, dtype=torch.float64)
std = torch.rand(7, 5, dtype=torch.float64) + 0.1
phi, ups, var = torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)
torch.testing.assert_close((phi, ups, var), tuple(reference_moments(mean, std, 0)))
torch.testing.assert_close(moment_ops.relu_mean(mean, std), phi)
# the lazy modules resolve where Triton is installed (and HAVE_TRITON says whether it is)
assert operators.HAVE_TRITON == (importlib.util.find_spec("triton") is not None)
if operators.HAVE_TRITON:
    assert moment_ops.triton_kernels.BLOCK > 0 and elbo_ops.triton_tail_kernels.FORWARD_ROWS > 0
    assert elbo_ops.triton.cdiv(5, 2) == 3 and "triton" in sys.modules
print(json.dumps("ok"))
"""


def _start(code: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-c", code]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process):
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fresh_processes():
    """Both fresh processes below, started at once: ``{name: Popen}``."""
    return {"import_only": _start(IMPORT_ONLY), "import_then_use": _start(IMPORT_THEN_USE)}


def test_importing_the_package_pulls_in_neither_triton_nor_the_compiler_stack(fresh_processes):
    added = _result(fresh_processes["import_only"])
    assert "cfbnn_cli.moments.operators" in added and "cfbnn_cli.bnn" in added
    heavy = [name for name in added if any(name == h or name.startswith(h + ".") for h in HEAVY)]
    assert not heavy, heavy
    assert not any(name.startswith("cfbnn_cli.moments.triton_") for name in added)


def test_the_operators_work_on_the_cpu_after_the_cheap_import(fresh_processes):
    assert _result(fresh_processes["import_then_use"]) == "ok"
