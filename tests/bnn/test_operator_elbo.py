"""The ReLU network's ELBO on the fused nodes (:mod:`cfbnn_cli.bnn.fused.normal_elbo`), one
implementation for both devices: its value and every gradient against the same network computed
layer by layer on the operators' reference kernels (``Estimator.bind(network, fused=False)`` inside
the tests' reference mode) in float64 -- one hidden layer (``cfbnn::normal_elbo``), two with the first
sampled (``analytic``: ``cfbnn::normal_ell`` for the last two layers) and two or three with every
layer integrated (``deterministic``: ``cfbnn::deep_normal_elbo``), both output-bias settings, float64
and float32 -- on the CPU's C++ kernels, on the reference kernels, and on the Triton kernels run on the
CPU by Triton's interpreter (the CUDA twin, in a subprocess started with ``TRITON_INTERPRET=1``).
tests/test_cuda.py and the CUDA tests below run it compiled on a GPU."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from autograd_nodes import node_names
from dispatch_count import counts, training_step_operators
from reference_kernels import kernels_for, reference_kernels

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.estimators import make_estimator
from cfbnn_cli.moments import elbo_ops, get_activation
from cfbnn_cli.moments.activations import family_of

REPO = Path(__file__).resolve().parents[2]

# shared by the checks on either kernels: the error measure, a network whose means and spreads
# reach the moments' tails, and every case's errors and route against the reference path
CHECK = """
import copy, json, torch
from autograd_nodes import node_names
from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.likelihoods import NormalLikelihood
from cfbnn_cli.bnn.estimators import make_estimator
from cfbnn_cli.moments import get_activation
from reference_kernels import reference_kernels

def layer_by_layer(net, estimator):  # the estimator's objective on net, layer by layer (no whole-ELBO or tail node)
    return make_estimator(estimator).bind(net, fused=False)

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
                with reference_kernels():  # layer by layer on the reference kernels
                    reference = layer_by_layer(reference_net, estimator).elbo(
                        x.double(), y.double(), num_data=100, noise=tuple(n.double() for n in noise) or None,
                    )
                    reference_grads = torch.autograd.grad(reference, list(reference_net.parameters()))
                names = node_names(value)
                if len(hidden) == 1:
                    route = "cfbnn::normal_elbo" in names
                elif estimator == "analytic":
                    route = "cfbnn::normal_ell" in names
                else:
                    route = "cfbnn::deep_normal_elbo" in names
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
        with reference_kernels():
            ell = layer_by_layer(reference_net, "analytic").ell(x.double(), y.double())
            reference = (ell * weights.double()).sum()
            reference_grads = torch.autograd.grad(reference, list(reference_net.parameters()))
        out[f"1_per-point_{dtype}"] = {
            "value": scaled(value.detach(), reference.detach()),
            "grads": max(scaled(g, r) for g, r in zip(grads, reference_grads)),
            "dtype": str(value.dtype),
            "route": "cfbnn::normal_ell" in node_names(value),
        }
    # the backward builds no graph of itself: a second order is an error, never a silent zero
    net = network([150], True, torch.float64)
    x, y = torch.randn(21, 4, dtype=torch.float64), torch.randn(21, dtype=torch.float64)
    try:
        graph = torch.autograd.grad(net.elbo(x, y), list(net.parameters()), create_graph=True)
        torch.autograd.grad(sum(g.sum() for g in graph), list(net.parameters()))
        out["second_order"] = "allowed"
    except RuntimeError as error:  # (first derivatives only: differentiating the gradients raises)
        out["second_order"] = "refused" if "first derivatives only" in str(error) else str(error)
    return out
"""

# in the subprocess: the operators' Triton kernels as their CPU kernels (the CUDA twin), then the checks
INTERPRETED = """
from cuda_twin import cuda_twin

with cuda_twin() as calls:
    out = errors()
out["calls"] = dict(calls)
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
    tests = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *tests, env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", CHECK + INTERPRETED], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    errors = json.loads(line[len("RESULT ") :])
    steps = set(elbo_ops.STEPS) | {"relu_tail", "relu_tail_backward"}
    steps |= {"relu_family_moments", "relu_family_moments_backward"}
    calls = errors.pop("calls")
    assert steps <= set(calls) and min(calls.values()) > 0, calls  # every step ran on its Triton kernel
    _assert_within_tolerance(errors)


def test_the_reference_kernels_match_the_reference_path():
    """Without the C++ library (an install without a compiler): the same nodes, their every step's
    CPU kernel the reference torch formula (:mod:`cfbnn_cli.moments.elbo_reference`; here the tests'
    reference mode), against the layers one by one."""
    namespace = {}
    exec(CHECK, namespace)  # noqa: S102 - the checks shared with the runs above
    with reference_kernels():
        _assert_within_tolerance(namespace["errors"]())


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
        assert wanted.grad_fn.operator.name == "normal_elbo"
        with torch.no_grad():
            plain = net.elbo(x, y, num_data=100)
        tolerance = 1e-13 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(plain, wanted.detach(), rtol=tolerance, atol=0.0)


def test_the_per_point_ell_keeps_each_points_gradient():
    """The ELBO sums the output layer's rows at once, so its node takes the tail pass's backward
    ahead and scales it by the one upstream gradient; the per-point ELL is differentiated row by
    row (weights differing per point here) and takes the tail pass's own backward: both held to
    the layers one by one on the reference kernels."""
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
    by_layer = make_estimator("analytic").bind(reference, fused=False)
    with reference_kernels():
        values = (
            (weights * by_layer.ell(x, y, noise=noise)).sum(),
            by_layer.elbo(x, y, num_data=40, noise=noise),
        )
        want = [torch.autograd.grad(value, list(reference.parameters())) for value in values]
    for got_grads, want_grads in zip(got, want):
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


# the most operators (aten:: and cfbnn::) one training step of these networks may dispatch on the
# CPU where the ReLU family's nodes take it: the ELBO as one node with one hidden layer, or deeper
# with every layer integrated (deterministic); the analytic estimator sampling the first of two
# hidden layers, the last two as one node. Layer by layer: more.
STEP_BUDGET = {"one_hidden": 20, "deterministic_two": 50, "deterministic_three": 80, "analytic_two": 110}


def test_which_networks_take_the_fused_nodes():
    """Networks of the ReLU family (ReLU, leaky ReLU, ReLU^2), one hidden layer or more, take the
    fused nodes, decided when the estimator is bound to the network (``Objective.route``): a
    training step dispatches its budget of operators (the CPU's kernel count;
    tests/bnn/dispatch_count.py), the cfbnn:: ones among them. Other activations (the piecewise
    polynomials) and subclasses go layer by layer, and the bound objective says why."""
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
            route = make_estimator(options.get("estimator", "analytic")).bind(net).route
            assert ("normal_ell" if case == "analytic_two" else "the whole ELBO as one node") in route, route
            total, cfbnn = counts(training_step_operators(net, x, y, **options))
            assert total <= STEP_BUDGET[case] and cfbnn > 0, (name, case, total, cfbnn)
            by_layer = make_estimator(options.get("estimator", "analytic")).bind(net, fused=False)
            by_layer_total = counts(training_step_operators(net, x, y, bound=by_layer))[0]
            assert by_layer_total > total, (name, case, by_layer_total, total)  # the nodes save dispatches
    hard_sigmoid = get_activation("hard_sigmoid")
    assert family_of(hard_sigmoid) is None
    piecewise = BayesianNetwork(3, [5, 4], activation=hard_sigmoid)  # node by node, on its C++ kernels
    route = make_estimator("deterministic").bind(piecewise).route
    assert route.startswith("layer by layer") and "is not one of the ReLU family" in route, route
    total, cfbnn = counts(training_step_operators(piecewise, x, y, estimator="deterministic"))
    assert total > STEP_BUDGET["deterministic_two"] and cfbnn > 0, (total, cfbnn)

    class Shifted(type(get_activation("relu"))):  # a subclass may change the function: not the family's nodes
        pass

    assert family_of(Shifted()) is None
    shifted = BayesianNetwork(3, [5], activation=Shifted())
    assert counts(training_step_operators(shifted, x, y))[0] > STEP_BUDGET["one_hidden"]


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
    assert value.grad_fn.operator.name == "normal_elbo"
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
    assert ("cfbnn::normal_ell" if estimator == "analytic" else "cfbnn::deep_normal_elbo") in node_names(value)
    grads = torch.autograd.grad(value, list(gpu.parameters()))
    assert abs(float(value) - float(reference)) <= 1e-10 * abs(float(reference))
    for got, want in zip(grads, reference_grads):
        assert float((got.cpu() - want).abs().max()) <= 1e-10 * float(want.abs().max())


@pytest.mark.parametrize("family", [(0, 0.0), (1, -0.5), (2, 0.0)], ids=["relu", "leaky_relu", "relu_squared"])
def test_the_deep_elbo_passes_gradcheck(family):
    """cfbnn::deep_normal_elbo's written-out backward pass (two propagated layers, with and without
    the output bias) against finite differences in float64, the noise precision's gradient too."""
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
            return torch.ops.cfbnn.deep_normal_elbo(x, y, log_precision, list(p), list(biases), 0.64, 10.0, *family)

        assert torch.autograd.gradcheck(elbo, (log_precision, *parameters))


def test_a_kernel_that_fails_raises_where_it_is_called_and_nothing_falls_back():
    """No first-use check and no second route: a device's kernel that fails (a Triton kernel that does
    not compile, say) raises its own error at the call, with no warning and no other kernel tried;
    afterwards the working kernel serves again, nothing switched away from it."""

    def broken(*args):
        raise RuntimeError("this kernel does not compile here")

    torch.manual_seed(0)
    net = BayesianNetwork(3, [5, 5])
    x, y = torch.randn(4, 3), torch.randn(4)
    noise = net.sample_noise(4, estimator="analytic")
    before = net.elbo(x, y, estimator="analytic", noise=noise).detach()
    relu = get_activation("relu")
    for name, call in (
        ("relu_family_moments", lambda: relu.moments(torch.zeros(2), torch.ones(2))),
        ("diagonal_kl_pass", lambda: net.elbo(x, y, estimator="analytic", noise=noise)),  # inside a node
        ("normal_elbo_rows", lambda: net.elbo(x, y, estimator="deterministic")),  # the whole-ELBO node
    ):
        with kernels_for({name: broken}), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="does not compile here"):
                call()
        assert not said, (name, [str(w.message) for w in said])
    assert torch.equal(net.elbo(x, y, estimator="analytic", noise=noise).detach(), before)
