"""The network's CUDA kernels on the CPU (:func:`cuda_twin.cuda_twin`, tests/cuda_twin.py): the
dispatcher running each ``cfbnn::`` operator's CUDA kernel -- the Triton kernels, under Triton's
interpreter -- against the reference kernels (tests/reference_kernels.py) in float64:
the closed-form ELBO and its gradients (one hidden layer, two with the first sampled, two
propagated), ``vmap`` over draws as the gradient-variance measurement takes them (Table 1), the
predictive moments, the Figure 1 head's deterministic prediction for the ReLU family (one launch of each
prediction operator), one Adam step, and NaN propagation through the moments (the hard sigmoid's
too: on CUDA its reference ops). ``TRITON_INTERPRET=1`` must be set before Triton is imported, so
the checks run in a subprocess (as tests/moments/triton_check.py's do).

What the twin cannot show -- compilation for a GPU, streams, CUDA graphs, the GPU's arithmetic --
is tests/test_cuda.py's, on a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECKS = r"""
import contextlib, copy, json, sys, torch
from torch.func import functional_call, grad, vmap
from autograd_nodes import node_names
from cfbnn_cli.bnn import BayesianNetwork, bayesian_head
from cfbnn_cli.bnn.gradient_variance import gradient_variance
from cfbnn_cli.bnn.likelihoods import NormalLikelihood
from cfbnn_cli.moments import get_activation
from cuda_twin import cuda_twin
from reference_kernels import reference_kernels
from cfbnn_cli.train.optimizers import adam

WIDTH, ROWS = (int(n) for n in sys.argv[1:3])  # the last hidden layer's width, the batch's rows
DTYPES = (torch.float64, torch.float32)

def scaled(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))

def network(hidden, dtype, activation="relu", **params):
    torch.manual_seed(0)
    net = BayesianNetwork(
        4, hidden, likelihood=NormalLikelihood(2.0, True), prior_scale=0.9,
        activation=get_activation(activation, **params),
    )
    with torch.no_grad():  # means and spreads that reach the moments' tails
        for layer in net.layers:
            layer.loc.normal_(0.0, 1.0)
            layer.log_scale.uniform_(-4.0, 0.5)
    return net.to(dtype)

def data(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 4, generator=g, dtype=dtype) * 2, torch.randn(ROWS, generator=g, dtype=dtype)

def reference(net):  # the network in float64, for the reference kernels (twin_off)
    return copy.deepcopy(net).double()

def draws(net, x, y, noise):  # the per-draw gradients as gradient_variance takes them
    params = {name: p.detach() for name, p in net.named_parameters()}
    def negative_elbo(p, draw):
        return -functional_call(net, p, (x, y), {"estimator": "analytic", "noise": draw})
    return vmap(grad(negative_elbo), in_dims=(None, 0))(params, noise)

def vmap_cases():
    # first, before anything else has used the kernels: their first launches inside vmap(grad(...)),
    # as a gradient-variance measurement's first chunk makes them on a GPU
    out = {}
    for activation, params in (("relu", {}), ("leaky_relu", {"negative_slope": -0.5}), ("relu_squared", {})):
        for dtype in DTYPES:
            net, (x, y) = network([6, WIDTH], dtype, activation, **params), data(dtype)
            noise = net.sample_noise(ROWS, generator=torch.Generator().manual_seed(2), num_samples=3)
            got = draws(net, x, y, noise)
            with twin_off():
                want = draws(reference(net), x.double(), y.double(), tuple(n.double() for n in noise))
            out[f"vmap_{activation}_{dtype}"] = max(scaled(got[k], want[k]) for k in want)
    net, (x, y) = network([6, WIDTH], torch.float64), data(torch.float64)
    options = dict(estimator="analytic", num_samples=6, chunk_size=3, cuda_graphs=False)
    got = gradient_variance(net, x, y, 100, generator=torch.Generator().manual_seed(3), **options)
    with twin_off():
        want = gradient_variance(reference(net), x, y, 100, generator=torch.Generator().manual_seed(3), **options)
    out["gradient_variance"] = max(abs(got[k] - want[k]) / max(abs(want[k]), 1e-30) for k in want)
    return out

ROUTES = {"one": "cfbnn::normal_elbo", "analytic": "cfbnn::normal_ell", "deterministic": "cfbnn::deep_normal_elbo"}

def elbo_cases():
    out = {}
    cases = [([WIDTH], "analytic", "relu"), ([6, WIDTH], "analytic", "relu"), ([6, WIDTH], "deterministic", "relu")]
    cases += [([6, WIDTH], "deterministic", "leaky_relu"), ([WIDTH], "analytic", "relu_squared")]
    for hidden, estimator, activation in cases:
        params = {"negative_slope": -0.5} if activation == "leaky_relu" else {}
        for dtype in DTYPES:
            net, (x, y) = network(hidden, dtype, activation, **params), data(dtype)
            noise = net.sample_noise(ROWS, estimator=estimator, generator=torch.Generator().manual_seed(4))
            value = net.elbo(x, y, num_data=100, noise=noise or None, estimator=estimator)
            grads = torch.autograd.grad(value, list(net.parameters()))
            base = reference(net)
            with twin_off():
                noise64 = tuple(n.double() for n in noise) or None
                want = base.elbo(x.double(), y.double(), num_data=100, noise=noise64, estimator=estimator)
            want_grads = torch.autograd.grad(want, list(base.parameters()))
            route = ROUTES["one" if len(hidden) == 1 else estimator] in node_names(value)
            out[f"elbo_{len(hidden)}_{estimator}_{activation}_{dtype}"] = {
                "value": scaled(value.detach(), want.detach()),
                "grads": max(scaled(g, w) for g, w in zip(grads, want_grads)),
                "route": route,
            }
    # the per-point ELL, its points weighted differently (the ELL node's tail backward in its backward
    # pass), and an ELBO evaluated without a gradient (the tail pass alone): cfbnn::relu_tail and its
    # backward
    for dtype in DTYPES:
        net, (x, y) = network([WIDTH], dtype), data(dtype)
        weights = torch.rand(ROWS, generator=torch.Generator().manual_seed(5), dtype=dtype)
        value = (net.expected_log_likelihood_per_point(x, y) * weights).sum()
        grads = torch.autograd.grad(value, list(net.parameters()))
        with torch.no_grad():
            evaluated = net.elbo(x, y, num_data=100)
        base = reference(net)
        with twin_off():
            want = (base.expected_log_likelihood_per_point(x.double(), y.double()) * weights.double()).sum()
            want_grads = torch.autograd.grad(want, list(base.parameters()))
            with torch.no_grad():
                want_evaluated = base.elbo(x.double(), y.double(), num_data=100)
        out[f"elbo_per_point_{dtype}"] = {
            "value": max(scaled(value.detach(), want.detach()), scaled(evaluated, want_evaluated)),
            "grads": max(scaled(g, w) for g, w in zip(grads, want_grads)),
            "route": "cfbnn::normal_ell" in node_names(value),
        }
    return out

def prediction_cases():
    # the moments propagated through two hidden layers; the exact mean of one (cfbnn::relu_mean)
    out = {}
    for dtype in DTYPES:
        deep, shallow, (x, _) = network([6, WIDTH], dtype), network([WIDTH], dtype), data(dtype)
        with torch.no_grad():
            got = [*deep.output_moments(x, estimator="deterministic"), shallow.output_mean(x)]
            predictive = deep.predict(x, estimator="deterministic")
            got += [predictive.mean, predictive.variance]
            with twin_off():
                deep, shallow, x = reference(deep), reference(shallow), x.double()
                want = [*deep.output_moments(x, estimator="deterministic"), shallow.output_mean(x)]
                predictive = deep.predict(x, estimator="deterministic")
                want += [predictive.mean, predictive.variance]
        out[f"prediction_{dtype}"] = max(scaled(g, w) for g, w in zip(got, want))
    return out

def head_cases():
    # the Figure 1 head's deterministic prediction (cfbnn::prediction_operand, one batched product,
    # cfbnn::prediction_hidden_mean) for the ReLU family, against the reference path in float64
    out = {}
    for activation, params in (("relu", {}), ("leaky_relu", {"negative_slope": -0.5}), ("relu_squared", {})):
        for dtype in DTYPES:
            torch.manual_seed(0)
            head = bayesian_head(4, [6, WIDTH], 3, activation=get_activation(activation, **params), init_scale=0.5)
            head, x = head.to(dtype), data(dtype)[0]
            with torch.no_grad():
                before = dict(calls)
                got = head.output_mean(x)
                launches = {k: v - before.get(k, 0) for k, v in calls.items() if v != before.get(k, 0)}
                with twin_off():
                    want = reference(head).output_mean(x.double())
            out[f"head_{activation}_{dtype}"] = scaled(got, want)
            out[f"head_launches_{activation}_{dtype}"] = launches
    return out

def adam_cases():
    out = {}
    for dtype in DTYPES:
        net, (x, y) = network([WIDTH], dtype), data(dtype)
        nets = [net, reference(net)]
        for index, model in enumerate(nets):
            with twin_off() if index else contextlib.nullcontext():
                optimizer = adam(model.parameters(), lr=0.05)
                xs, ys = (x, y) if index == 0 else (x.double(), y.double())
                (-model.elbo(xs, ys, num_data=100)).backward()
                optimizer.step()
        out[f"adam_{dtype}"] = max(scaled(a.detach(), b.detach()) for a, b in zip(*(m.parameters() for m in nets)))
    return out

def nan_cases():
    # each NaN input gives NaN moments where CUDA's route runs: the Triton kernels for the ReLU
    # family, the reference ops for the hard sigmoid (a NaN std once read as std 0 there: Phi = 1)
    out = {}
    for name in ("relu", "leaky_relu", "relu_squared", "hard_sigmoid"):
        activation = get_activation(name)
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(0)
            mean = torch.randn(6, 40, generator=g, dtype=dtype) * 3
            std = torch.rand(6, 40, generator=g, dtype=dtype) + 0.1
            mean[1, 3], std[4, 7] = float("nan"), float("nan")
            mean[5, 0], std[5, 0] = 10.0, float("nan")  # a NaN std with a finite mean far right
            bad = mean.isnan() | std.isnan()
            clean = activation.moments(mean.masked_fill(bad, 0.0), std.masked_fill(bad, 1.0), return_variance=True)
            nan_kept = exact_elsewhere = True
            for grad_mode in (True, False):
                with torch.set_grad_enabled(grad_mode):
                    outputs = [*activation.moments(mean, std, return_variance=True), activation.mean(mean, std)]
                for value, want in zip(outputs, (*clean, clean[0])):
                    nan_kept &= bool(value[bad].isnan().all())
                    exact_elsewhere &= torch.equal(value[~bad], want[~bad])
            out[f"nan_{name}_{dtype}"] = {"nan": nan_kept, "exact": exact_elsewhere}
    return out

def twin_off():  # the reference kernels, registered over the twin's for the block
    return reference_kernels()

with cuda_twin() as calls:
    out = vmap_cases()
    out["vmap_calls"] = dict(calls)
    out.update(elbo_cases())
    out.update(prediction_cases())
    out.update(head_cases())
    out.update(adam_cases())
    out.update(nan_cases())
out["calls"] = dict(calls)
print("RESULT", json.dumps(out))
"""


def _run(width: int, rows: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    paths = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "bnn"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    command = [sys.executable, "-c", CHECKS, str(width), str(rows)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _assert_the_twin_matches(out: dict) -> None:
    vmap_calls = out.pop("vmap_calls")
    # vmap reached the tail node's kernels (its vmap rule: the draws' rows as rows of one call; the
    # backward steps, which sum over each draw's rows, by their vmap rules' batched formulas)
    assert vmap_calls.get("relu_tail", 0) > 0 and vmap_calls.get("normal_ell_rows", 0) > 0, vmap_calls
    calls = out.pop("calls")
    steps = {"augment_pair", "outer_layers_pass", "diagonal_kl_pass", "normal_elbo_rows", "normal_rows_backward"}
    steps |= {"relu_tail"}
    steps |= {"relu_tail_backward", "output_layer_gradients", "finish_diagonal_gradients", "relu_mean"}
    steps |= {"relu_family_moments", "relu_family_moments_backward"}
    steps |= {"prediction_operand", "prediction_hidden_mean"}
    assert steps <= set(calls), sorted(steps - set(calls))
    for case, error in out.items():
        tolerance = 1e-10 if "float64" in case else 2e-5
        if case.startswith("elbo_"):
            assert error["route"], (case, "the operators' route was not taken")
            assert error["value"] < tolerance and error["grads"] < tolerance, (case, error)
        elif case.startswith("nan_"):
            assert error["nan"] and error["exact"], (case, error)
        elif case.startswith("head_launches_"):  # one prediction: one launch of each pass, nothing else
            assert error == {"prediction_operand": 1, "prediction_hidden_mean": 1}, (case, error)
        elif case == "gradient_variance":
            assert error < 1e-8, error  # (a variance of per-draw gradients: their errors, squared)
        else:
            assert error < tolerance, (case, error)


def test_the_cuda_route_on_the_cpu_matches_the_reference_path():
    _assert_the_twin_matches(_run(width=40, rows=21))


@pytest.mark.slow
def test_the_cuda_route_on_the_cpu_matches_the_reference_path_past_one_block():
    """Widths and rows past one Triton block each way (the partial blocks too)."""
    _assert_the_twin_matches(_run(width=150, rows=37))
