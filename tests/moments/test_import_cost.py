"""Registration is cheap (issue #43, item 5): ``import cfbnn_cli.bnn`` registers the ``cfbnn::``
operators without importing Triton (the kernel modules are imported by the first Triton launch:
:class:`cfbnn_cli.moments.ops.LazyModule`) or torch's compiler stack (``torch._dynamo``, which
``torch.compiler.assume_constant_result`` would import only to mark a function). Asserted on
what a fresh process imports, not on timings (which vary twofold on a loaded machine);
docs/fast_path.md has the measured times."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
from cfbnn_cli.moments import kernel_library, ops, relu_mean_ops
from cfbnn_cli.moments.relu_reference import relu_forward

torch.manual_seed(0)
x, y = torch.randn(16, 4), torch.randn(16)
for model in (ClosedFormBNN(4, 8), BayesianNetwork(4, [8, 8])):
    loss = model.elbo(x, y)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(model.predict(x).mean).all()
# with the C++ kernels registered (they load first), the CPU route never enters a custom_op's
# Python kernel, whose first call would import torch._dynamo (torch's _disable_dynamo)
assert not (kernel_library.cpu_operators_registered() and "torch._dynamo" in sys.modules)
mean = torch.randn(7, 5, dtype=torch.float64)
std = torch.rand(7, 5, dtype=torch.float64) + 0.1
phi, ups, var = torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)
torch.testing.assert_close((phi, ups, var), tuple(relu_forward(mean, std)[:3]))
torch.testing.assert_close(relu_mean_ops.relu_mean(mean, std), phi)
# the lazy modules resolve where Triton is installed (and HAVE_TRITON says whether it is)
assert ops.HAVE_TRITON == (importlib.util.find_spec("triton") is not None)
if ops.HAVE_TRITON:
    assert ops.triton_kernels.BLOCK > 0 and ops.triton_tail_kernels.FORWARD_ROWS > 0
    assert ops.triton.cdiv(5, 2) == 3 and "triton" in sys.modules
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
    assert "cfbnn_cli.moments.ops" in added and "cfbnn_cli.bnn" in added
    heavy = [name for name in added if any(name == h or name.startswith(h + ".") for h in HEAVY)]
    assert not heavy, heavy
    assert not any(name.startswith("cfbnn_cli.moments.triton_") for name in added)


def test_the_operators_work_on_the_cpu_after_the_cheap_import(fresh_processes):
    assert _result(fresh_processes["import_then_use"]) == "ok"


def test_the_constant_mark_is_the_one_torch_sets():
    """:func:`~cfbnn_cli.moments.kernel_library._assume_constant_result` sets, without importing
    ``torch._dynamo``, what ``torch.compiler.assume_constant_result`` sets (and returns the
    function itself, as torch's does): ``torch.compile`` keeps ``library_loaded`` out of a trace."""
    from cfbnn_cli.moments import kernel_library

    def probe():
        return None

    assert torch.compiler.assume_constant_result(probe) is probe
    assert vars(probe) and all(getattr(kernel_library.library_loaded, k) == v for k, v in vars(probe).items())
    # with torch._dynamo loaded (as it now is), torch's own decorator is used
    marked = kernel_library._assume_constant_result(lambda: None)
    assert vars(marked) == vars(probe)
