"""The one-hidden-layer ELBO off the CPU (:mod:`cfbnn_cli.bnn.fused.device_elbo`): its value and
every gradient against the network's reference torch path in float64, run on the CPU through
Triton's interpreter (``TRITON_INTERPRET=1``, set in a subprocess before Triton is imported);
tests/test_cuda.py runs it compiled on a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.fused import device_elbo_applies

REPO = Path(__file__).resolve().parents[2]

# shared by the interpreted checks: imports, the error measure and a network whose means and
# spreads reach the moments' tails
PRELUDE = """
import copy, json, torch
import cfbnn_cli.bnn.fused as fused
from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.fused import device_normal_elbo
from cfbnn_cli.bnn.likelihoods import NormalLikelihood
from cfbnn_cli.moments import fast_path, ops

def scaled(got, want):
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))

def network(hidden, output_bias, dtype):
    torch.manual_seed(0)
    net = BayesianNetwork(4, hidden, output_bias=output_bias, likelihood=NormalLikelihood(2.0, True), prior_scale=0.9)
    with torch.no_grad():
        for layer in net.layers:
            layer.loc.normal_(0.0, 1.0)
            layer.log_scale.uniform_(-4.0, 0.5)
    return net.to(dtype)
"""


def _run_interpreted(check: str) -> dict:
    """``PRELUDE + check`` in a subprocess under ``TRITON_INTERPRET=1``; its ``RESULT`` line."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + check], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


CHECK = """
out = {}
for dtype in (torch.float64, torch.float32):
    for output_bias in (True, False):
        net = network([150], output_bias, dtype)
        x, y = torch.randn(21, 4, dtype=dtype) * 2, torch.randn(21, dtype=dtype)
        parameters = list(net.parameters())
        value = device_normal_elbo(x, y, net.likelihood.log_precision, *net.layers, 0.81, 100 / 21)
        grads = torch.autograd.grad(value, parameters)
        reference_net = copy.deepcopy(net).double()
        with fast_path(False):
            reference = reference_net.elbo(x.double(), y.double(), num_data=100, estimator="analytic")
        reference_grads = torch.autograd.grad(reference, list(reference_net.parameters()))
        out[f"{dtype}_{output_bias}"] = {
            "value": scaled(value.detach(), reference.detach()),
            "grads": max(scaled(g, r) for g, r in zip(grads, reference_grads)),
            "dtype": str(value.dtype),
        }
# the backward builds no graph: asking for a second order is an error, never a silent zero
value = device_normal_elbo(x, y, net.likelihood.log_precision, *net.layers, 0.81, 1.0)
first = torch.autograd.grad(value, parameters, create_graph=True)
try:
    torch.autograd.grad(sum(g.sum() for g in first), parameters)
    out["second_order"] = "allowed"
except RuntimeError:  # (once_differentiable: the first-order gradients carry no graph)
    out["second_order"] = "refused"
from cfbnn_cli.bnn.fused import device_elbo
from cfbnn_cli.moments import ops
for dtype in (torch.float32, torch.float64):  # the first-use checks that guard the routes
    device_elbo._self_check(torch.device("cpu"), dtype)
    ops._self_check(torch.device("cpu"), dtype)
out["self_check"] = "ran"
print("RESULT", json.dumps(out))
"""


def test_device_elbo_matches_the_reference_path_under_the_interpreter():
    errors = _run_interpreted(CHECK)
    assert errors.pop("second_order") == "refused"
    assert errors.pop("self_check") == "ran"
    assert len(errors) == 4
    for case, error in errors.items():
        tolerance = 1e-10 if case.startswith("torch.float64") else 2e-5
        assert error["dtype"] == case.split("_")[0], errors
        assert error["value"] < tolerance and error["grads"] < tolerance, (case, errors)


def test_the_route_is_taken_off_the_cpu_only():
    """On the CPU the C++ single node is the route (faster there); the device route needs Triton's
    device and the operators switched on."""
    net = BayesianNetwork(3, [5])
    x = torch.randn(4, 3)
    assert not device_elbo_applies(net.activation, x, *net.parameters())


def test_kernels_that_fail_on_first_use_leave_one_warning_and_the_other_route(monkeypatch, caplog):
    from cfbnn_cli.moments import ops

    def broken(device, dtype):
        raise RuntimeError("PassManager::run failed\nmore compiler text")

    monkeypatch.setattr(ops, "FIRST_USE", {})
    key = (torch.device("cpu"), torch.float32)
    with caplog.at_level("WARNING"):
        assert ops.first_use_check("the test kernels", *key, broken) is False
        assert ops.first_use_check("the test kernels", *key, broken) is False  # decided once
        assert ops.first_use_check("other kernels", *key, lambda device, dtype: None) is True
    warnings = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert warnings == [
        "the test kernels failed on cpu (RuntimeError: PassManager::run failed); the reference route is used there"
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_cuda_elbo_takes_the_device_route_and_matches_the_cpu(dtype, tolerance):
    torch.manual_seed(1)
    net = BayesianNetwork(20, [300], prior_scale=0.7).to(dtype)
    x, y = torch.randn(500, 20, dtype=dtype), torch.randn(500, dtype=dtype)
    reference = net.elbo(x, y, num_data=5000, estimator="analytic")
    reference_grads = torch.autograd.grad(reference, list(net.parameters()))
    gpu = net.cuda()
    value = gpu.elbo(x.cuda(), y.cuda(), num_data=5000, estimator="analytic")
    assert type(value.grad_fn).__name__.startswith("DeviceNormalELBO")
    grads = torch.autograd.grad(value, list(gpu.parameters()))
    assert abs(float(value) - float(reference)) <= tolerance * abs(float(reference))
    for got, want in zip(grads, reference_grads):
        assert float((got.cpu() - want).abs().max()) <= tolerance * float(want.abs().max())


DEEP_CHECK = """
def _nodes(node, seen=None):
    seen = set() if seen is None else seen
    if node is not None and node not in seen:
        seen.add(node)
        for child, _ in node.next_functions:
            _nodes(child, seen)
    return [type(n).__name__ for n in seen]

out = {}
for estimator in ("analytic", "deterministic"):
    for dtype in (torch.float64, torch.float32):
        for output_bias in (True, False):
            net = network([6, 150], output_bias, dtype)
            x, y = torch.randn(21, 4, dtype=dtype) * 2, torch.randn(21, dtype=dtype)
            noise = tuple(n.to(dtype) for n in net.sample_noise(21, estimator=estimator, generator=torch.Generator().manual_seed(1)))
            reference_net = copy.deepcopy(net).double()
            with fast_path(False):  # the reference torch path (CPU kernels off)
                reference = reference_net.elbo(x.double(), y.double(), num_data=100, noise=tuple(n.double() for n in noise), estimator=estimator)
                reference_grads = torch.autograd.grad(reference, list(reference_net.parameters()))
                # the device routes on these CPU tensors: the tail, and the propagated hidden layer
                # through cfbnn::relu_moments_from_variance's Triton kernels
                applies, kernels = fused.device_elbo_applies, ops.device_kernels_apply
                fused.device_elbo_applies = lambda *tensors: True
                ops.device_kernels_apply = lambda tensor: True
                try:
                    value = net.elbo(x, y, num_data=100, noise=noise, estimator=estimator)
                finally:
                    fused.device_elbo_applies, ops.device_kernels_apply = applies, kernels
            grads = torch.autograd.grad(value, list(net.parameters()))
            out[f"{estimator}_{dtype}_{output_bias}"] = {
                "value": scaled(value.detach(), reference.detach()),
                "grads": max(scaled(g, r) for g, r in zip(grads, reference_grads)),
                "route": "DeviceNormalELL" in repr(_nodes(value.grad_fn))
                and (estimator == "analytic" or "relu_moments_from_variance" in repr(_nodes(value.grad_fn))),
            }
print("RESULT", json.dumps(out))
"""


def test_deeper_networks_take_the_device_tail_and_match_the_reference_under_the_interpreter():
    """Two hidden layers: ``analytic`` samples the first and integrates the last two layers,
    ``deterministic`` propagates the first's moments; either way the last hidden layer and the
    output go through :class:`DeviceNormalELL` (forced here on CPU tensors, Triton interpreted)."""
    errors = _run_interpreted(DEEP_CHECK)
    assert len(errors) == 8
    for case, error in errors.items():
        tolerance = 1e-10 if "float64" in case else 2e-5
        assert error["route"], (case, "the device tail was not taken")
        assert error["value"] < tolerance and error["grads"] < tolerance, (case, errors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("estimator", ["analytic", "deterministic"])
def test_cuda_deeper_network_takes_the_device_tail_and_matches_the_cpu(estimator):
    torch.manual_seed(2)
    net = BayesianNetwork(20, [50, 300], prior_scale=0.7).double()
    x, y = torch.randn(500, 20, dtype=torch.float64), torch.randn(500, dtype=torch.float64)
    noise = net.sample_noise(500, estimator=estimator, generator=torch.Generator().manual_seed(3))
    reference = net.elbo(x, y, num_data=5000, noise=noise, estimator=estimator)
    reference_grads = torch.autograd.grad(reference, list(net.parameters()))
    gpu = net.cuda()
    value = gpu.elbo(x.cuda(), y.cuda(), num_data=5000, noise=tuple(n.cuda() for n in noise), estimator=estimator)
    nodes, stack = set(), [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack.extend(child for child, _ in node.next_functions)
    assert any(type(node).__name__.startswith("DeviceNormalELL") for node in nodes)
    grads = torch.autograd.grad(value, list(gpu.parameters()))
    assert abs(float(value) - float(reference)) <= 1e-10 * abs(float(reference))
    for got, want in zip(grads, reference_grads):
        assert float((got.cpu() - want).abs().max()) <= 1e-10 * float(want.abs().max())
