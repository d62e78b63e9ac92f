"""The ReLU network's ELBO on the ``cfbnn::`` operators (:mod:`cfbnn_cli.bnn.fused.operator_elbo`,
:mod:`~cfbnn_cli.bnn.fused.operator_deep_elbo`), one implementation for both devices: its value
and every gradient against the network's reference torch path in float64 -- one hidden layer
(:class:`NormalELBO`), two with the first sampled (``analytic``: :class:`NormalELL` for the last
two layers) and two or three with every layer integrated (``deterministic``:
:class:`DeepNormalELBO`), both output-bias
settings, float64 and float32 -- on the CPU's C++ kernels, and on the Triton kernels run on the CPU
by Triton's interpreter (``TRITON_INTERPRET=1``, set in a subprocess before Triton is imported, the
Triton kernels registered there as the operators' CPU kernels). tests/test_cuda.py and the CUDA
tests below run it compiled on a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from autograd_nodes import node_names
from dispatch_count import counts, training_step_operators

from cfbnn_cli.bnn import BayesianNetwork, fused
from cfbnn_cli.moments import elbo_ops, fast_path, get_activation
from cfbnn_cli.moments.activations import family_of

REPO = Path(__file__).resolve().parents[2]

# shared by the checks on either kernels: the error measure, a network whose means and spreads
# reach the moments' tails, and every case's errors and route against the reference path
CHECK = """
import copy, json, torch
from autograd_nodes import node_names
from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.likelihoods import NormalLikelihood
from cfbnn_cli.moments import fast_path, get_activation

def scaled(got, want):
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))

def network(hidden, output_bias, dtype, activation="relu", **params):
    torch.manual_seed(0)
    net = BayesianNetwork(
        4, hidden, output_bias=output_bias, likelihood=NormalLikelihood(2.0, True), prior_scale=0.9,
        activation=get_activation(activation, **params),
    )
    with torch.no_grad():
        for layer in net.layers:
            layer.loc.normal_(0.0, 1.0)
            layer.log_scale.uniform_(-4.0, 0.5)
    return net.to(dtype)

def errors():
    out = {}
    cases = [([150], "analytic", "relu")] + [([6, 150], estimator, "relu") for estimator in ("analytic", "deterministic")]
    cases.append(([5, 4, 40], "deterministic", "relu"))  # three hidden layers: two propagated
    # the rest of the ReLU family: one hidden layer (NormalELBO), two sampled then integrated
    # (NormalELL) and two integrated (DeepNormalELBO)
    cases += [(hidden, "analytic", name) for name in ("leaky_relu", "relu_squared") for hidden in ([150], [6, 150])]
    cases += [([6, 150], "deterministic", name) for name in ("leaky_relu", "relu_squared")]
    for hidden, estimator, activation in cases:
        params = {"negative_slope": -0.5} if activation == "leaky_relu" else {}
        for dtype in (torch.float64, torch.float32):
            # (the output bias is the rows' business, the same for every activation: ReLU covers both)
            for output_bias in (True, False) if activation == "relu" else (True,):
                net = network(hidden, output_bias, dtype, activation, **params)
                x, y = torch.randn(21, 4, dtype=dtype) * 2, torch.randn(21, dtype=dtype)
                g = torch.Generator().manual_seed(1)
                noise = tuple(n.to(dtype) for n in net.sample_noise(21, estimator=estimator, generator=g))
                value = net.elbo(x, y, num_data=100, noise=noise or None, estimator=estimator)
                grads = torch.autograd.grad(value, list(net.parameters()))
                reference_net = copy.deepcopy(net).double()
                with fast_path(False):  # the reference torch path (no kernels)
                    reference = reference_net.elbo(
                        x.double(), y.double(), num_data=100, noise=tuple(n.double() for n in noise) or None,
                        estimator=estimator,
                    )
                reference_grads = torch.autograd.grad(reference, list(reference_net.parameters()))
                names = node_names(value)
                if len(hidden) == 1:
                    route = "NormalELBO" in names
                elif estimator == "analytic":
                    route = "NormalELL" in names
                else:
                    route = "DeepNormalELBO" in names
                name = "" if activation == "relu" else "_" + activation
                out[f"{len(hidden)}_{estimator}_{dtype}_{output_bias}{name}"] = {
                    "value": scaled(value.detach(), reference.detach()),
                    "grads": max(scaled(g, r) for g, r in zip(grads, reference_grads)),
                    "dtype": str(value.dtype),
                    "route": route,
                }
    # the per-point ELL, its points weighted differently (the ELL node's tail backward in its backward
    # pass, not taken ahead): the VAE's and the per-point API's route
    for dtype in (torch.float64, torch.float32):
        net = network([150], True, dtype)
        x, y, weights = torch.randn(21, 4, dtype=dtype) * 2, torch.randn(21, dtype=dtype), torch.rand(21, dtype=dtype)
        value = (net.expected_log_likelihood_per_point(x, y) * weights).sum()
        grads = torch.autograd.grad(value, list(net.parameters()))
        reference_net = copy.deepcopy(net).double()
        with fast_path(False):
            reference = (reference_net.expected_log_likelihood_per_point(x.double(), y.double()) * weights.double()).sum()
        reference_grads = torch.autograd.grad(reference, list(reference_net.parameters()))
        out[f"1_per-point_{dtype}"] = {
            "value": scaled(value.detach(), reference.detach()),
            "grads": max(scaled(g, r) for g, r in zip(grads, reference_grads)),
            "dtype": str(value.dtype),
            "route": "NormalELL" in node_names(value),
        }
    # the backward builds no graph: asking for a second order is an error, never a silent zero
    net = network([150], True, torch.float64)
    x, y = torch.randn(21, 4, dtype=torch.float64), torch.randn(21, dtype=torch.float64)
    try:
        torch.autograd.grad(net.elbo(x, y), list(net.parameters()), create_graph=True)
        out["second_order"] = "allowed"
    except RuntimeError as error:  # (first derivatives only: a graph of the gradients is refused)
        out["second_order"] = "refused" if "first derivatives only" in str(error) else str(error)
    return out
"""

# in the subprocess: the operators' Triton kernels registered as their CPU kernels, then the checks
INTERPRETED = """
from cfbnn_cli.moments import elbo_ops, ops, tail_ops
calls = {}

def counted(name, kernel):  # each Triton step counts its calls: the test asserts that every one ran
    def run(*args):
        calls[name] = calls.get(name, 0) + 1
        return kernel(*args)
    return run

# the C++ library registers its CPU kernels when it loads: load it first, so that these come later and win
from cfbnn_cli.moments import kernel_library
assert kernel_library.load_kernels() is not None and kernel_library.cpu_operators_registered()
library = torch.library.Library("cfbnn", "IMPL")
for name, kernel in elbo_ops.TRITON_KERNELS.items():
    library.impl(name, counted(name, kernel), "CPU")
library.impl("relu_tail", counted("relu_tail", tail_ops.triton_relu_tail), "CPU")
library.impl("relu_tail_backward", counted("relu_tail_backward", tail_ops.triton_relu_tail_backward), "CPU")
for op in ("relu_family_moments", "relu_family_moments_backward"):  # the propagated hidden layers' moments
    library.impl(op, counted(op, getattr(ops, "triton_" + op.replace("relu_", ""))), "CPU")
out = errors()
out["calls"] = calls
for dtype in (torch.float32, torch.float64):  # the first-use check that guards the CUDA route
    ops._self_check(torch.device("cpu"), dtype)
out["self_check"] = "ran"
print("RESULT", json.dumps(out))
"""


def _assert_within_tolerance(errors: dict) -> None:
    assert errors.pop("second_order") == "refused"
    assert len(errors) == 30
    for case, error in errors.items():
        tolerance = 1e-10 if "float64" in case else 2e-5
        assert error["route"], (case, "the operators' route was not taken")
        assert error["dtype"] == case.split("_")[2], errors
        assert error["value"] < tolerance and error["grads"] < tolerance, (case, errors)


def test_the_cpu_kernels_match_the_reference_path():
    namespace = {}
    exec(CHECK, namespace)  # noqa: S102 - the checks shared with the interpreted run below
    _assert_within_tolerance(namespace["errors"]())


@pytest.mark.slow  # the default suite's twin (tests/test_cuda_twin.py) runs these steps on their kernels too
def test_the_triton_kernels_match_the_reference_path_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", CHECK + INTERPRETED], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    errors = json.loads(line[len("RESULT ") :])
    assert errors.pop("self_check") == "ran"
    steps = set(elbo_ops.STEPS) | {"relu_tail", "relu_tail_backward"}
    steps |= {"relu_family_moments", "relu_family_moments_backward"}
    calls = errors.pop("calls")
    assert steps <= set(calls) and min(calls.values()) > 0, calls  # every step ran on its Triton kernel
    _assert_within_tolerance(errors)


WITHOUT_LIBRARY = """
from cfbnn_cli.moments import kernel_library
out = errors()
out["available"] = kernel_library.fast_path_info()["available"]
print("RESULT", json.dumps(out))
"""


def test_without_the_cpp_library_the_nodes_run_the_reference_kernels(tmp_path):
    """No compiler: the same nodes, their every step's CPU kernel the reference torch formula
    (:mod:`cfbnn_cli.moments.elbo_reference`), against the reference path layer by layer."""
    env = dict(os.environ, CFBNN_CUDA_TWIN="1")  # (the library not loaded, the kernels not switched off)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CHECK + WITHOUT_LIBRARY],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    errors = json.loads(line[len("RESULT ") :])
    assert errors.pop("available") is False  # (no library: nothing but the reference kernels ran)
    _assert_within_tolerance(errors)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "relu_squared"])
def test_the_elbo_is_the_same_whether_or_not_a_gradient_is_wanted(activation, dtype):
    """With a gradient wanted the node takes the tail pass's backward ahead
    (``cfbnn::relu_tail_with_gradients``), without one the tail pass alone (``cfbnn::relu_tail``):
    the same row sums (added in another order: to a few units in the last place)."""
    params = {"negative_slope": -0.5} if activation == "leaky_relu" else {}
    for output_bias in (True, False):
        namespace = {}
        exec(CHECK, namespace)  # noqa: S102 - the shared network of the checks above
        net = namespace["network"]([150], output_bias, dtype, activation, **params)
        x, y = torch.randn(21, 4, dtype=dtype) * 2, torch.randn(21, dtype=dtype)
        wanted = net.elbo(x, y, num_data=100)
        assert type(wanted.grad_fn).__name__ == "NormalELBOBackward"
        with torch.no_grad():
            plain = net.elbo(x, y, num_data=100)
        tolerance = 1e-13 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(plain, wanted.detach(), rtol=tolerance, atol=0.0)


def test_the_per_point_ell_keeps_each_points_gradient():
    """The ELBO sums the output layer's rows at once, so its node takes the tail pass's backward
    ahead and scales it by the one upstream gradient; the per-point ELL is differentiated row by
    row (weights differing per point here) and takes the tail pass's own backward: both held to
    the reference torch path."""
    import copy

    from cfbnn_cli.bnn.likelihoods import NormalLikelihood

    torch.manual_seed(3)
    net = BayesianNetwork(4, [6, 30], likelihood=NormalLikelihood(2.0, True)).double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    weights = torch.rand(9, dtype=torch.float64) * 3
    noise = net.sample_noise(9, estimator="analytic", generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(net)

    def objectives(model):
        per_point = model.expected_log_likelihood_per_point(x, y, noise=noise, estimator="analytic")
        return (weights * per_point).sum(), model.elbo(x, y, num_data=40, noise=noise, estimator="analytic")

    got = [torch.autograd.grad(value, list(net.parameters())) for value in objectives(net)]
    with fast_path(False):
        want = [torch.autograd.grad(value, list(reference.parameters())) for value in objectives(reference)]
    for got_grads, want_grads in zip(got, want):
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


# the most operators (aten:: and cfbnn::) one training step of these networks may dispatch on the
# CPU where the ReLU family's operators take it: the ELBO as one node with one hidden layer, or
# deeper with every layer integrated (deterministic); the analytic estimator sampling the first of
# two hidden layers, the last two as one node. The reference path dispatches 240 to 780 for them.
STEP_BUDGET = {"one_hidden": 20, "deterministic_two": 50, "deterministic_three": 80, "analytic_two": 110}


def test_which_networks_take_the_operators():
    """Networks of the ReLU family (ReLU, leaky ReLU, ReLU^2), one hidden layer or more, take the
    family's operators: a training step dispatches its budget of operators (the CPU's kernel
    count; tests/bnn/dispatch_count.py), the cfbnn:: ones among them. Other activations (the
    piecewise polynomials) and subclasses do not, and with the fast path off no cfbnn:: operator
    runs at all."""
    x, y = torch.randn(4, 3), torch.randn(4)
    cases = {
        "one_hidden": ([5], {}),
        "deterministic_two": ([5, 4], {"estimator": "deterministic"}),
        "deterministic_three": ([5, 4, 6], {"estimator": "deterministic"}),
        "analytic_two": ([5, 4], {"estimator": "analytic"}),
    }
    for name, family in (("relu", (0, 0.0)), ("leaky_relu", (1, 0.01)), ("relu_squared", (2, 0.0))):
        assert family_of(get_activation(name)) == family
        for case, (hidden, options) in cases.items():
            net = BayesianNetwork(3, hidden, activation=name)
            assert fused.operators_apply(net.activation, x, *net.parameters())
            total, cfbnn = counts(training_step_operators(net, x, y, **options))
            assert total <= STEP_BUDGET[case] and cfbnn > 0, (name, case, total, cfbnn)
            with fast_path(False):
                reference, none = counts(training_step_operators(net, x, y, **options))
            assert none == 0 and reference > 2 * STEP_BUDGET[case], (name, case, reference)
    net = BayesianNetwork(3, [5])
    assert not fused.operators_apply(net.activation, x, x.double())  # one dtype
    hard_sigmoid = get_activation("hard_sigmoid")
    assert family_of(hard_sigmoid) is None and not fused.operators_apply(hard_sigmoid, x, *net.parameters())
    piecewise = BayesianNetwork(3, [5, 4], activation=hard_sigmoid)  # node by node, on its C++ kernels
    total, cfbnn = counts(training_step_operators(piecewise, x, y, estimator="deterministic"))
    assert total > STEP_BUDGET["deterministic_two"] and cfbnn > 0, (total, cfbnn)

    class Shifted(type(net.activation)):  # a subclass may change the function: not the family's operators
        pass

    assert family_of(Shifted()) is None
    shifted = BayesianNetwork(3, [5], activation=Shifted())
    assert counts(training_step_operators(shifted, x, y))[0] > STEP_BUDGET["one_hidden"]
    with fast_path(False):
        assert not fused.operators_apply(net.activation, x, *net.parameters())


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_first_use_inside_a_prediction_still_checks_with_gradients(monkeypatch, context):
    """The first use of the ELBO's kernels may come from a prediction (the deterministic
    estimator's propagated layers ask the same question under no_grad / inference_mode): the
    check, which takes gradients, must still pass there, not rule the kernels out for good."""
    from cfbnn_cli.moments import ops

    monkeypatch.setattr(ops, "FIRST_USE", {})

    def check(device, dtype):
        value = torch.ones(3, dtype=dtype, device=device, requires_grad=True)
        (grad,) = torch.autograd.grad((value * value).sum(), [value])
        assert torch.equal(grad, 2 * value.detach())

    with torch.no_grad() if context == "no_grad" else torch.inference_mode():
        assert ops.first_use_check("the test kernels", torch.device("cpu"), torch.float32, check) is True


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
@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "relu_squared"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_cuda_elbo_takes_the_operators_and_matches_the_cpu(dtype, tolerance, activation):
    torch.manual_seed(1)
    net = BayesianNetwork(20, [300], prior_scale=0.7, activation=activation).to(dtype)
    x, y = torch.randn(500, 20, dtype=dtype), torch.randn(500, dtype=dtype)
    reference = net.elbo(x, y, num_data=5000, estimator="analytic")
    reference_grads = torch.autograd.grad(reference, list(net.parameters()))
    gpu = net.cuda()
    value = gpu.elbo(x.cuda(), y.cuda(), num_data=5000, estimator="analytic")
    assert type(value.grad_fn).__name__.startswith("NormalELBO")
    grads = torch.autograd.grad(value, list(gpu.parameters()))
    assert abs(float(value) - float(reference)) <= tolerance * abs(float(reference))
    for got, want in zip(grads, reference_grads):
        assert float((got.cpu() - want).abs().max()) <= tolerance * float(want.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("estimator", ["analytic", "deterministic"])
def test_cuda_deeper_network_takes_the_operators_and_matches_the_cpu(estimator):
    torch.manual_seed(2)
    net = BayesianNetwork(20, [50, 300], prior_scale=0.7).double()
    x, y = torch.randn(500, 20, dtype=torch.float64), torch.randn(500, dtype=torch.float64)
    noise = net.sample_noise(500, estimator=estimator, generator=torch.Generator().manual_seed(3))
    reference = net.elbo(x, y, num_data=5000, noise=noise, estimator=estimator)
    reference_grads = torch.autograd.grad(reference, list(net.parameters()))
    gpu = net.cuda()
    value = gpu.elbo(x.cuda(), y.cuda(), num_data=5000, noise=tuple(n.cuda() for n in noise), estimator=estimator)
    assert ("NormalELLBackward" if estimator == "analytic" else "DeepNormalELBOBackward") in node_names(value)
    grads = torch.autograd.grad(value, list(gpu.parameters()))
    assert abs(float(value) - float(reference)) <= 1e-10 * abs(float(reference))
    for got, want in zip(grads, reference_grads):
        assert float((got.cpu() - want).abs().max()) <= 1e-10 * float(want.abs().max())


@pytest.mark.parametrize("family", [(0, 0.0), (1, -0.5), (2, 0.0)], ids=["relu", "leaky_relu", "relu_squared"])
def test_the_deep_elbo_passes_gradcheck(family):
    """DeepNormalELBO's written-out backward pass (two propagated layers, with and without the
    output bias) against finite differences in float64, the noise precision's gradient too."""
    from cfbnn_cli.bnn.fused.operator_deep_elbo import DeepNormalELBO

    g = torch.Generator().manual_seed(12)
    dt = torch.float64
    x, y = 0.5 * torch.randn(6, 3, generator=g, dtype=dt), torch.randn(6, generator=g, dtype=dt)
    for output_bias in (True, False):
        parameters = []
        for rows, columns in [(4, 4), (5, 5), (3, 6), (1, 3 + output_bias)]:  # (outputs, inputs + bias column)
            parameters += [
                # (inputs and weights of scale 1/2: ReLU^2 stacked three deep stays in a range where
                # finite differences keep their digits)
                (0.5 * torch.randn(rows, columns, generator=g, dtype=dt)).requires_grad_(),
                (0.3 * torch.randn(rows, columns, generator=g, dtype=dt) - 1.0).requires_grad_(),
            ]
        log_precision = torch.tensor(0.2, dtype=dt, requires_grad=True)
        biases = (True, True, True, output_bias)

        def elbo(log_precision, *p):
            return DeepNormalELBO.apply(x, y, log_precision, biases, 0.64, 10.0, family, *p)

        assert torch.autograd.gradcheck(elbo, (log_precision, *parameters))
