"""The kernels of one closed-form training step on the CUDA route, counted on the CPU: inside the
CUDA twin (:func:`cuda_twin.cuda_twin`, tests/cuda_twin.py: the Triton kernels under Triton's
interpreter, so in a subprocess) :func:`kernel_count.count_kernels` (tests/kernel_count.py) counts each
Triton launch and each torch operation that is a kernel on CUDA, in the work a CUDA graph of the
step holds (:meth:`~cfbnn_cli.train.graphs.GraphedTrainingStep.captured_step`: forward,
backward, fused Adam) and in what runs before each replay (the batch's gather), in both shapes of
the GPU benchmark's two sizes: inputs narrower than the hidden layer (D=90/H=200, as measured) and
wider (D=2048/H=1000 there; D=300/H=100 here, which takes the same route and launches what it does,
at a twentieth of the interpreter's time), a batch of 8 rows, which launches what 500 do. A step that launches more fails here, in CI; ``benchmarks/bench_operators.py
--list-kernels`` counts the real launches on a GPU with the profiler (where cuBLAS may add a
split-K reduction to a matrix product: the GPU target, 18, leaves room for that)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP_BOUND = 15  # kernels in the graph of one step (see WANT)
# one step's kernels on the CUDA route, by name: the ELBO's four forward launches around its two
# matrix products, the loss's negation and its backward, the backward's launches around its two
# matrix products, and fused Adam with its step count
WANT = {
    "triton::outer_layers_kernel": 1,  # [x, 1], [x^2, 1], both layers' Var and KL sums
    "aten::linear": 2,  # the forward's two products (one GEMM each on CUDA)
    "aten::mm": 2,  # the backward's two
    "triton::relu_tail_kernel": 1,  # the tail pass, its backward taken ahead at dL/d elbo = 1
    "triton::normal_rows_kernel": 1,  # the rows, the ELBO's sum, the KL finished
    "aten::neg": 2,  # loss = -elbo, and its backward
    "triton::normal_rows_backward_kernel": 1,
    "aten::sum": 1,  # the tail pass's column sums over its row blocks
    "triton::output_gradients_kernel": 1,
    "triton::diagonal_gradients_kernel": 1,
    "aten::_fused_adam_": 1,
    "aten::_foreach_add_": 1,
}

COUNT = r"""
import json, torch
from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.moments import validate_args
from cuda_twin import cuda_twin
from kernel_count import count_kernels
from reference_kernels import reference_kernels
from cfbnn_cli.train.graphs import BatchLoss, GraphedTrainingStep
from cfbnn_cli.train.optimizers import adam

def counts(dim, hidden, rows=8, n=40):
    torch.manual_seed(0)
    model = BayesianNetwork(dim, [hidden])
    optimizer = adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(n, dim), torch.randn(n)
    loss = BatchLoss((x, y), lambda xb, yb: -model.elbo(xb, yb, num_data=n, estimator="analytic"))
    step = GraphedTrainingStep(model, optimizer, loss, "cpu")
    batch = torch.randperm(n)[:rows]
    with reference_kernels():  # the warm-up step (Adam's state), quickly: the reference kernels
        value = step(batch)
    fill, graphed = step.captured_step(batch, value)
    optimizer.zero_grad(set_to_none=True)  # as before a capture: backward() writes the gradients
    with count_kernels() as before_replay:
        fill(batch)
    with count_kernels() as in_graph:
        graphed()
    return {"fill": dict(before_replay), "step": dict(in_graph)}

def deterministic_step(activation):
    # a 2-hidden-layer ELBO with every layer integrated, and its gradients (after a first use)
    torch.manual_seed(0)
    model = BayesianNetwork(9, [20, 20], activation=activation)
    x, y = torch.randn(50, 9), torch.randn(50)
    for _ in range(2):  # (the first: Triton's first launches; the second counted)
        with count_kernels() as launched:
            value = model.elbo(x, y, num_data=500, estimator="deterministic")
            torch.autograd.grad(value, list(model.parameters()))
    return dict(launched)

with cuda_twin(), validate_args(False):
    out = {f"{dim}x{hidden}": counts(dim, hidden) for dim, hidden in ((90, 200), (300, 100))}
    out["family"] = {name: deterministic_step(name) for name in ("relu", "leaky_relu", "relu_squared")}
print("RESULT", json.dumps(out))
"""


@pytest.fixture(scope="module")
def twin_counts():
    """The counts of :data:`COUNT`, run once (a subprocess: the interpreter's environment)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COUNT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_a_closed_form_step_launches_at_most_fifteen_kernels_on_the_cuda_route(twin_counts):
    twin_counts = {size: counted for size, counted in twin_counts.items() if size != "family"}
    for size, counted in twin_counts.items():
        assert sum(counted["step"].values()) <= STEP_BOUND, (size, counted)
        assert counted["step"] == WANT, (size, counted)
        # the batch's gather outside the graph: one gather each for x and y, nothing else
        assert counted["fill"] == {"aten::index_select": 2}, (size, counted)


def test_every_relu_family_member_launches_relus_kernels_on_the_cuda_route(twin_counts):
    """One operator for the family, the member an argument: a deterministic 2-hidden-layer step (its
    propagated layer's moments from the variances, one kernel each way) launches for leaky ReLU and
    ReLU^2 exactly ReLU's kernels, besides leaky ReLU's slope written to the device once for each of
    its three launches that read it (the moments each way and the tail pass)."""
    family = twin_counts["family"]
    assert (
        family["relu"].get("triton::moments_kernel") == 1 and family["relu"].get("triton::moments_backward_kernel") == 1
    )
    assert family["relu_squared"] == family["relu"], family
    leaky = dict(family["leaky_relu"])
    assert leaky.pop("aten::full") == 3 and leaky == family["relu"], family


def test_the_counter_counts_kernels_not_views_or_allocations():
    """The counter itself on torch operations: a view, an allocation or a detach launches nothing on
    CUDA; a product, a copy and an in-place update launch one each, each call counted."""
    import torch
    from kernel_count import count_kernels

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with count_kernels() as kernels:
        product = a @ b  # one GEMM
        product.t().reshape(-1)  # a view, then a copy (not contiguous)
        torch.empty(7)
        product.detach()
        product.add_(1.0)
        (a @ b).sum()
    assert kernels == {"aten::mm": 2, "aten::clone": 1, "aten::add_": 1, "aten::sum": 1}, kernels
