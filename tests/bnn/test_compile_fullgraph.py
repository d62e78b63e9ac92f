"""``torch.compile(fullgraph=True)`` of the closed-form ELBO and of the predictive on the CPU: one
graph, the ``cfbnn::`` operators inside it (not the reference ops), the eager values and gradients;
the argument checks still raise, eager and compiled."""

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork, ClosedForm, ClosedFormBNN, DeterministicPropagation, NormalLikelihood
from cfbnn_cli.moments import extension, get_activation

assert extension.status()["loaded"], extension.status()

DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
# the one-hidden-layer ELBO is one operator, its node (cfbnn::normal_elbo): the graph calls it, its
# fake kernel gives the shapes
ELBO_OPERATORS = {"normal_elbo"}


class GraphRecorder:
    """A dynamo backend that runs each captured graph as it is and keeps the names of the
    ``cfbnn::`` operators it calls, in its subgraphs too (an autograd.Function's forward and
    backward are subgraphs of the graph that applies it)."""

    def __init__(self):
        self.graphs = 0
        self.operators = set()

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        for module in graph_module.modules():
            if isinstance(module, torch.fx.GraphModule):
                # a target prints as cfbnn.<name> (a packet) or cfbnn.<name>.default (an overload)
                names = (str(node.target).split(".") for node in module.graph.nodes if node.op == "call_function")
                self.operators.update(parts[1] for parts in names if parts[0] == "cfbnn")
        return graph_module.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def network(dtype):
    """The paper's network, ReLU, mean-field q on both layers, a learned Normal precision, with
    parameters moved off their initial values (so that every gradient is non-trivial)."""
    generator = torch.Generator().manual_seed(0)
    model = ClosedFormBNN(
        input_dim=3,
        hidden_dim=8,
        likelihood=NormalLikelihood(precision=2.0, learn=True),
        generator=generator,
    ).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=dtype))
    return model


def data(dtype, rows=16):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 3, generator=generator, dtype=dtype), torch.randn(rows, generator=generator, dtype=dtype)


def elbo_and_gradients(model, loss, x, y):
    value = loss(x, y)
    return value, torch.autograd.grad(value, list(model.parameters()))


def assert_same_elbo(model, compiled, x, y, dtype):
    def eager(x, y):
        return -model.elbo(x, y, num_data=100)

    want_value, want_gradients = elbo_and_gradients(model, eager, x, y)
    got_value, got_gradients = elbo_and_gradients(model, compiled, x, y)
    torch.testing.assert_close(got_value, want_value, **TOLERANCE[dtype])
    for got, want in zip(got_gradients, want_gradients):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_elbo_is_one_graph_on_the_operators_with_the_eager_values_and_gradients(dtype):
    model = network(dtype)
    recorder = GraphRecorder()
    compiled = torch.compile(lambda x, y: -model.elbo(x, y, num_data=100), fullgraph=True, backend=recorder)
    assert_same_elbo(model, compiled, *data(dtype), dtype)
    assert recorder.graphs == 1
    assert ELBO_OPERATORS <= recorder.operators, ELBO_OPERATORS - recorder.operators
    # the compiled function follows the parameters (no values baked in): a step, then again
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.9)
    assert_same_elbo(model, compiled, *data(dtype, rows=16), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_elbo_compiles_through_aot_autograd(dtype):
    """AOT autograd functionalizes the in-place gradient step (cfbnn::finish_diagonal_gradients)."""
    model = network(dtype)
    compiled = torch.compile(lambda x, y: -model.elbo(x, y, num_data=100), fullgraph=True, backend="aot_eager")
    assert_same_elbo(model, compiled, *data(dtype), dtype)


def predictive_moments(model):
    def moments(x):
        prediction = model(x)
        return prediction.mean, prediction.variance, prediction.var_a, prediction.var_b, prediction.noise

    return moments


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_predictive_is_one_graph_on_the_operator_with_the_eager_values(dtype):
    model = network(dtype)
    x, _ = data(dtype)
    recorder = GraphRecorder()
    got = torch.compile(predictive_moments(model), fullgraph=True, backend=recorder)(x)
    want = predictive_moments(model)(x)
    for name, got_value, want_value in zip(("mean", "variance", "var_a", "var_b", "noise"), got, want):
        torch.testing.assert_close(got_value, want_value, **TOLERANCE[dtype], msg=name)
    assert recorder.graphs == 1
    assert "relu_family_moments" in recorder.operators, recorder.operators


def test_a_negative_std_raises_eager_and_compiled():
    relu = get_activation("relu")
    mean, std = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.1
    std[2] = -0.5
    with pytest.raises(ValueError, match=r"`std` must be >= 0 \(a standard deviation\); got a value -0.5"):
        relu.moments(mean, std)
    # compiled: the check is an assertion inside the graph (reading the answer back would break it)
    compiled = torch.compile(lambda m, s: relu.moments(m, s), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"`std` must be >= 0"):
        compiled(mean, std)
    std[2] = 0.5
    for got, want in zip(compiled(mean, std), relu.moments(mean, std)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_elbo_and_the_predictive_compile_with_inductor(dtype):
    model = network(dtype)
    x, y = data(dtype)
    compiled = torch.compile(lambda x, y: -model.elbo(x, y, num_data=100), fullgraph=True)
    assert_same_elbo(model, compiled, x, y, dtype)
    got = torch.compile(predictive_moments(model), fullgraph=True)(x)
    for got_value, want_value in zip(got, predictive_moments(model)(x)):
        torch.testing.assert_close(got_value, want_value, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "estimator, operators",
    [
        # the whole ELBO as one node
        pytest.param(DeterministicPropagation(), {"deep_normal_elbo"}, id="deterministic"),
        # the first hidden layer sampled (given noise), the last two layers as one node
        # (cfbnn::normal_ell), whose rows the ELBO sums at once
        pytest.param(ClosedForm(), {"diagonal_preactivation", "normal_ell"}, id="analytic"),
    ],
)
def test_a_deeper_network_compiles_to_one_graph_on_the_operators(dtype, estimator, operators):
    generator = torch.Generator().manual_seed(2)
    model = BayesianNetwork(3, [8, 6], likelihood=NormalLikelihood(precision=2.0, learn=True), generator=generator)
    model = model.to(dtype)
    x, y = data(dtype)
    noise = estimator.sample_noise(model, x.shape[0], generator=generator, lead=())

    def loss(x, y):
        return -model.elbo(x, y, num_data=100, estimator=estimator, noise=noise)

    recorder = GraphRecorder()
    compiled = torch.compile(loss, fullgraph=True, backend=recorder)
    want_value, want_gradients = elbo_and_gradients(model, loss, x, y)
    got_value, got_gradients = elbo_and_gradients(model, compiled, x, y)
    torch.testing.assert_close(got_value, want_value, **TOLERANCE[dtype])
    for got, want in zip(got_gradients, want_gradients):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert recorder.graphs == 1
    assert operators <= recorder.operators, operators - recorder.operators


def test_a_deeper_networks_deterministic_predictive_compiles_to_one_graph():
    model = BayesianNetwork(3, [8, 6], generator=torch.Generator().manual_seed(2)).to(torch.float64)
    x, _ = data(torch.float64)

    def moments(x):
        prediction = model.predict(x, estimator=DeterministicPropagation())
        return prediction.mean, prediction.variance

    recorder = GraphRecorder()
    got = torch.compile(moments, fullgraph=True, backend=recorder)(x)
    for got_value, want_value in zip(got, moments(x)):
        torch.testing.assert_close(got_value, want_value, **TOLERANCE[torch.float64])
    assert recorder.graphs == 1
    assert "relu_family_moments" in recorder.operators, recorder.operators
