"""What a network costs, counted before it is built (cfbnn_cli/bnn/footprint.py): the layer shapes
and parameter counts computed from the arguments alone must be the network's own, for every kind
of layer (diagonal, full and low-rank covariance, point layers, no output bias); the byte
estimates grow as documented."""

import pytest

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.footprint import (
    layer_shapes,
    parameter_count,
    per_row_floats,
    prediction_bytes,
    rows_at_once,
    training_bytes,
)

ARCHITECTURES = [
    dict(input_dim=3, hidden_sizes=[5], output_dim=1),
    dict(input_dim=4, hidden_sizes=[5, 6, 7], output_dim=3, covariance=["full", "lowrank", "diagonal"], rank=3,
         point_layers=1),
    dict(input_dim=2, hidden_sizes=[4, 3], output_dim=2, covariance=["lowrank", "full", "full"], rank=2),
    dict(input_dim=6, hidden_sizes=[2], output_dim=4, output_bias=False),
    dict(input_dim=5, hidden_sizes=[3, 3], output_dim=1, point_layers=3, covariance=[]),
]  # fmt: skip


@pytest.mark.parametrize("arguments", ARCHITECTURES)
def test_the_counted_shapes_are_the_networks_own(arguments):
    network = BayesianNetwork(
        arguments["input_dim"],
        arguments["hidden_sizes"],
        arguments["output_dim"],
        covariance=arguments.get("covariance", "diagonal"),
        rank=arguments.get("rank", 10),
        point_layers=arguments.get("point_layers", 0),
        output_bias=arguments.get("output_bias", True),
    )
    built = {name: tuple(value.shape) for name, value in network.state_dict().items() if name.startswith("layers.")}
    assert layer_shapes(**arguments) == built
    layers = [module for name, module in network.named_children() if name == "layers"][0]
    held = sum(p.numel() for p in layers.parameters()) + sum(b.numel() for b in layers.buffers())
    assert parameter_count(**arguments) == held  # a full layer's mask buffer included


def test_a_full_covariance_counts_its_factors():
    """The bound a model file is held to counts the (out, in + 1, in + 1) factors: 2,000 inputs and
    1,000 hidden units are 4 billion numbers, not the 4 million of the means and scales."""
    diagonal = parameter_count(2000, [1000], 1, "diagonal")
    full = parameter_count(2000, [1000], 1, ["full", "full"])
    assert diagonal == 2 * (1000 * 2001 + 1001)
    hidden = 2 * 1000 * 2001 + 1000 * 2001**2 + 2001**2  # means, scales, factors, the mask
    output = 2 * 1001 + 1001**2 + 1001**2
    assert full == hidden + output > 1000 * diagonal


def test_the_byte_estimates_grow_with_rows_units_and_optimizer_state():
    parameters, floats = parameter_count(64, [1000], 10), per_row_floats(64, [1000], 10)
    assert floats == 1010
    small, large = training_bytes(parameters, 100, floats), training_bytes(parameters, 10_000, floats)
    assert large - small == 4 * 9_900 * floats * 8  # float32 activations with their gradients, per row
    assert training_bytes(parameters, 100, floats, "adam") < small  # no L-BFGS history
    assert prediction_bytes(parameters, 100, floats) < training_bytes(parameters, 100, floats, "adam")
    assert per_row_floats(3, [4], 1, ["full", "full"]) == 4 * (1 + 4) + 1 * (1 + 5)  # each unit's (in + 1) too


@pytest.mark.parametrize(
    "train, refit, expected",
    [(1600, 1800, (1800, "lbfgs")), (30_000, 0, (32, "adam")), (19_000, 21_000, (19_000, "lbfgs"))],
)
def test_rows_at_once_follow_the_fits_optimizer(train, refit, expected):
    assert rows_at_once(train, 20_000, 32, refit) == expected
