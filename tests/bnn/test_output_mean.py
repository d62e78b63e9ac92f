"""``BayesianNetwork.output_mean`` (the deterministic prediction's logits, eq. (42)) through the
prediction operators (moments/predict_ops.py): against a Monte Carlo mean over the Gaussian layers'
weights (an independent path: whole weight matrices sampled, the network run forward), against the
analytic ``output_moments`` (independently tested) for every activation and layout it takes, and the
operations one prediction of the Figure 1 head runs (the CPU profiler)."""

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork, bayesian_head, cached_weights
from cfbnn_cli.bnn.functional import augment
from cfbnn_cli.moments import get_activation

ACTIVATIONS = [
    ("relu", {}),
    ("leaky_relu", {"negative_slope": 0.125}),
    ("leaky_relu", {"negative_slope": -0.5}),
    ("relu_squared", {}),
    ("hard_sigmoid", {}),
    ("identity", {}),
]


def _weight_space_mean(network, x, draws, generator, chunk=4096):
    """The outputs' Monte Carlo mean and standard error, every diagonal Gaussian matrix sampled whole."""
    total = total_sq = 0.0
    for _ in range(draws // chunk):
        h = x.expand(chunk, *x.shape)
        for index, layer in enumerate(network.layers):
            if hasattr(layer, "loc"):
                eps = torch.randn((chunk,) + layer.loc.shape, generator=generator, dtype=x.dtype)
                weights = layer.loc + layer.scale() * eps
                z = (augment(h) if layer.bias else h) @ weights.transpose(-1, -2)
            else:
                z = layer(h)
            h = z if index == len(network.layers) - 1 else network.activation(z)
        total, total_sq = total + h.sum(0), total_sq + h.square().sum(0)
    mean = total / draws
    return mean, ((total_sq / draws - mean.square()) / draws).sqrt()


@pytest.mark.parametrize("name, params", ACTIVATIONS[:4])
def test_output_mean_is_the_weight_space_monte_carlo_mean(name, params):
    torch.manual_seed(0)
    head = bayesian_head(5, [12, 10], 4, activation=get_activation(name, **params), init_scale=0.4).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    with torch.no_grad():
        mean = head.output_mean(x)
        sampled, standard_error = _weight_space_mean(head, x, 2**16, torch.Generator().manual_seed(1))
    assert float(standard_error.min()) > 0  # the posterior is wide: the check has teeth
    z = ((mean - sampled).abs() / standard_error).max()
    assert z < 5, float(z)


def _networks(activation):
    """The layouts output_mean's operator route takes: the Figure 1 head (one point layer), two point
    layers, none (the input itself the hidden layer's), no output bias, one output."""
    torch.manual_seed(0)
    return {
        "head": bayesian_head(5, [9, 11], 4, activation=activation, init_scale=0.5),
        "two_point_layers": BayesianNetwork(5, [9, 8, 7], 3, activation, point_layers=2, init_scale=0.5),
        "no_point_layer": BayesianNetwork(5, [8], 3, activation, init_scale=0.5),
        "no_output_bias": BayesianNetwork(5, [9, 8], 3, activation, point_layers=1, output_bias=False, init_scale=0.5),
        "one_output": BayesianNetwork(5, [9, 8], 1, activation, point_layers=1, init_scale=0.5),
    }


@pytest.mark.parametrize("name, params", ACTIVATIONS)
def test_output_mean_matches_the_analytic_moments_in_float64_and_float32(name, params):
    x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    for label, network in _networks(get_activation(name, **params)).items():
        network = network.double()
        with torch.no_grad():
            want = network.output_moments(x, estimator="analytic")[0]
            got = network.output_mean(x)
            assert got.shape == want.shape == x.shape[:-1] + ((network.output_dim,) if network.output_dim > 1 else ())
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{name} {label} float64")
            single = network.float().output_mean(x.float())
        assert single.dtype == torch.float32
        scale = float(want.abs().max())
        assert float((single.double() - want).abs().max()) <= 2e-6 * max(scale, 1.0), (name, label)


def _top_level_operations(function, x):
    """The operations one call runs, views and shape bookkeeping left out (the CPU profiler)."""
    views = {"aten::transpose", "aten::t", "aten::reshape", "aten::view", "aten::select", "aten::unsqueeze"}
    with torch.profiler.profile() as profile:
        function(x)
    names = [event.name for event in profile.events() if event.cpu_parent is None]
    return [name for name in names if name.startswith(("aten::", "cfbnn::")) and name not in views]


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "relu_squared"])
def test_the_heads_prediction_is_three_products_and_two_passes(name):
    """The point layer's product, the operand's pass, one batched product for the means and the
    variances, the mean's pass, the output product."""
    head = bayesian_head(16, [12, 10], 5, activation=name)
    x = torch.randn(7, 16)
    with torch.no_grad(), cached_weights():
        head.output_mean(x)  # (the stacked weights cached, the library loaded)
        operations = _top_level_operations(head.output_mean, x)
    assert operations == [
        "aten::linear",
        "cfbnn::prediction_operand",
        "aten::bmm",
        "cfbnn::prediction_hidden_mean",
        "aten::matmul",
    ], operations


def test_the_heads_prediction_compiles_to_one_graph_on_the_operators():
    """torch.compile(fullgraph=True) sees the two operators (their fake kernels) and the batched
    product; the compiled logits are the eager ones."""
    targets, graphs = set(), []

    def recorder(graph_module, example_inputs):
        graphs.append(graph_module)
        targets.update(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    head = bayesian_head(16, [12, 10], 5, activation=get_activation("leaky_relu", negative_slope=0.2))
    x = torch.randn(7, 16)
    try:
        got = torch.compile(head.output_mean, fullgraph=True, backend=recorder)(x)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1 and {"cfbnn.prediction_operand", "cfbnn.prediction_hidden_mean"} <= targets, targets
    torch.testing.assert_close(got, head.output_mean(x), rtol=0, atol=0)
