"""What a user's tensors meet at the network's door (cfbnn_cli/bnn/input_checks.py): a wrong shape,
dtype or device is a ValueError naming the argument and the fix; the shapes other PyTorch code
uses (a (N, 1) target column, float64 targets from pandas) give the same values and gradients as
the canonical ones."""

from __future__ import annotations

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork, ClosedFormBNN
from cfbnn_cli.bnn.likelihoods import NormalLikelihood
from cfbnn_cli.moments import set_fast_path


def _network(**options):
    return ClosedFormBNN(5, 7, generator=torch.Generator().manual_seed(0), **options)


def _x(*lead, rows=10):
    return torch.randn(*lead, rows, 5, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.randn(10, 6), r"\(\.\.\., N, 5\).*input_dim=5.*got \(10, 6\)"),
        (torch.randn(5), r"got \(5,\); for one point pass x\.unsqueeze\(0\)"),
        (torch.ones(10, 5, dtype=torch.long), r"must be a float tensor.*torch\.int64"),
        (torch.randn(10, 5, dtype=torch.float64), r"torch\.float64 but the network's parameters are torch\.float32"),
        ([[0.0] * 5], r"must be a torch\.Tensor"),
    ],
)
@pytest.mark.parametrize("method", ["elbo", "predict", "output_moments", "output_mean"])
def test_a_wrong_input_is_a_value_error_naming_x(x, message, method):
    network = _network()
    call = {
        "elbo": lambda: network.elbo(x, torch.zeros(10), num_data=100),
        "predict": lambda: network.predict(x),
        "output_moments": lambda: network.output_moments(x),
        "output_mean": lambda: network.output_mean(x),
    }[method]
    with pytest.raises(ValueError, match="`x`.*" + message):
        call()


@pytest.mark.parametrize("fast", [True, False], ids=["operators", "reference"])
def test_a_target_column_and_float64_targets_give_the_canonical_elbo_and_gradients(fast):
    network, x = _network(), _x()
    y = torch.randn(10, generator=torch.Generator().manual_seed(2))
    results = []
    set_fast_path(fast)
    try:
        for target in (y, y.unsqueeze(-1), y.double()):
            network.zero_grad()
            elbo = network.elbo(x, target, num_data=100)
            elbo.backward()
            results.append((elbo.detach(), [p.grad.clone() for p in network.parameters()]))
    finally:
        set_fast_path(True)
    (reference, reference_grads), *others = results
    assert reference.dtype == torch.float32
    for value, grads in others:
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=0.0)
        for grad, expected in zip(grads, reference_grads):
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)


def test_targets_for_sampled_inputs_broadcast_over_their_leading_dims():
    network, x = _network(), _x(3)
    y = torch.randn(10, generator=torch.Generator().manual_seed(2))
    each = torch.stack([network.expected_log_likelihood(x[s], y) for s in range(3)])
    torch.testing.assert_close(network.expected_log_likelihood(x, y), each)
    torch.testing.assert_close(network.expected_log_likelihood(x, y.expand(3, 10).unsqueeze(-1)), each)


@pytest.mark.parametrize(
    "output_dim, y_shape, message",
    [
        (1, (9,), r"\(N,\) or \(N, 1\) with N = 10.*got \(9,\)"),
        (1, (10, 2), r"\(N,\) or \(N, 1\) with N = 10.*got \(10, 2\)"),
        (1, (2, 10), r".*to match x of shape \(10, 5\); got \(2, 10\)"),
        (2, (10,), r"\(N, 2\) with N = 10.*got \(10,\)"),
        (2, (10, 1), r"\(N, 2\) with N = 10.*got \(10, 1\)"),
    ],
)
def test_a_target_of_the_wrong_shape_is_a_value_error_naming_y(output_dim, y_shape, message):
    network = _network(output_dim=output_dim)
    with pytest.raises(ValueError, match="`y` must have shape " + message):
        network.elbo(_x(), torch.zeros(y_shape), num_data=100)


def test_labels_are_checked_for_dtype_and_range_and_a_label_column_is_accepted():
    network, x = _network(output_dim=3, likelihood="softmax"), _x()
    labels = torch.arange(10) % 3
    torch.testing.assert_close(network.elbo(x, labels.unsqueeze(-1)), network.elbo(x, labels))
    with pytest.raises(ValueError, match=r"`labels` must be an integer tensor"):
        network.elbo(x, labels.float())
    for bad, shown in ((labels + 1, "from 1 to 3"), (labels - 1, "from -1 to 1")):
        with pytest.raises(ValueError, match=r"class indices in \[0, 3\).*" + shown):
            network.elbo(x, bad)
    logistic = _network(likelihood="logistic")
    logistic.elbo(x, labels.clamp(max=1))  # one logit, two classes
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        logistic.elbo(x, labels)


def test_a_likelihood_without_check_targets_gets_the_targets_as_given():
    seen = []

    class Recording(NormalLikelihood):
        check_targets = None  # a user's likelihood that declares no target shapes

        def expected_log_likelihood(self, y, *args, **kwargs):
            seen.append(tuple(y.shape))
            return super().expected_log_likelihood(y, *args, **kwargs)

    network = BayesianNetwork(5, [7], likelihood=Recording())
    network.expected_log_likelihood(_x(), torch.zeros(10), estimator="sampling")
    assert seen == [(10,)]
