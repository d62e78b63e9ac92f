"""What a user's tensors meet at the network's door (cfbnn_cli/bnn/input_checks.py): a wrong shape,
dtype or device is a ValueError naming the argument and the fix; the shapes other PyTorch code
uses (a (N, 1) target column, float64 targets from pandas) give the same values and gradients as
the canonical ones."""

from __future__ import annotations

import contextlib

import pytest
import torch
from reference_kernels import reference_kernels

from cfbnn_cli.bnn import BayesianNetwork, ClosedFormBNN
from cfbnn_cli.bnn.likelihoods import NormalLikelihood


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
    with contextlib.nullcontext() if fast else reference_kernels():
        for target in (y, y.unsqueeze(-1), y.double()):
            network.zero_grad()
            elbo = network.elbo(x, target, num_data=100)
            elbo.backward()
            results.append((elbo.detach(), [p.grad.clone() for p in network.parameters()]))
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


@pytest.mark.parametrize("num_data", [0, -5, 2.5, True, "100"])
def test_num_data_must_be_a_positive_integer(num_data):
    with pytest.raises(ValueError, match=r"`num_data` must be an integer >= 1"):
        _network().elbo(_x(), torch.zeros(10), num_data=num_data)


def test_an_empty_batch_cannot_be_scaled_to_num_data_but_is_fine_without():
    network, empty = _network(), torch.zeros(0, 5)
    with pytest.raises(ValueError, match=r"the batch is empty"):
        network.elbo(empty, torch.zeros(0), num_data=100)
    torch.testing.assert_close(network.elbo(empty, torch.zeros(0)), -network.kl())


@pytest.mark.parametrize(
    "call",
    [
        lambda net, x: net.predict(x, estimator="sampling", num_samples=0),
        lambda net, x: net.predictive_components(x, estimator="sampling", num_samples=-1),
        lambda net, x: net.predictive_components(x, estimator="sampling", chunk=0),
        lambda net, x: net.sample_outputs(x, 0),
        lambda net, x: net.elbo(x, torch.zeros(10), estimator="sampling", num_samples=0),
    ],
    ids=["predict", "components", "chunk", "sample_outputs", "elbo"],
)
def test_sample_counts_must_be_positive_integers(call):
    with pytest.raises(ValueError, match=r"must be an integer >= 1; got (0|-1)"):
        call(_network(), _x())


def test_model_x_passes_num_samples_to_predict():
    network, x = BayesianNetwork(5, [6, 4]), _x()
    draws = [network(x, num_samples=n, generator=torch.Generator().manual_seed(0)) for n in (2, 400)]
    direct = network.predict(x, num_samples=400, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(draws[1].mean, direct.mean)
    assert not torch.allclose(draws[0].mean, draws[1].mean)
    with pytest.raises(ValueError, match="model\\(x\\) predicts"):
        network(x, noise=())


def test_output_mean_of_a_network_with_sampled_layers_names_the_alternatives():
    network, x = BayesianNetwork(5, [6, 4]), _x()
    with pytest.raises(ValueError, match=r"samples this network's first 1 Gaussian layer.*estimator='deterministic'"):
        network.output_mean(x)
    with pytest.raises(ValueError, match=r"`noise` must hold one tensor per sampled layer.*samples 1.*got 0"):
        network.output_moments(x, noise=())


def test_likelihood_and_output_dim_must_agree():
    from cfbnn_cli.bnn.likelihoods import HeteroscedasticNormalLikelihood

    with pytest.raises(ValueError, match=r"`output_dim` must be 2 for HeteroscedasticNormalLikelihood"):
        BayesianNetwork(5, [6], 1, likelihood=HeteroscedasticNormalLikelihood())
    with pytest.raises(ValueError, match=r"must be 2 for HeteroscedasticNormalLikelihood.*got 3"):
        ClosedFormBNN(5, 6, output_dim=3, likelihood="heteroscedastic")
    ClosedFormBNN(5, 6, output_dim=2, likelihood=HeteroscedasticNormalLikelihood())  # the object, as its name
    with pytest.raises(ValueError, match=r"at least 2.*logistic likelihood"):
        ClosedFormBNN(5, 6, output_dim=1, likelihood="softmax")
    with pytest.raises(ValueError, match=r"must be 1 for the logistic likelihood"):
        BayesianNetwork(5, [6], 3, likelihood=ClosedFormBNN(5, 6, likelihood="logistic").likelihood)
    classifier = ClosedFormBNN(5, 6, output_dim=4, likelihood="softmax")
    with pytest.raises(ValueError, match=r"categorical"):
        classifier.predictive_components(_x())


@pytest.mark.parametrize("precision", [float("inf"), float("nan"), 0.0, -1.0])
def test_the_noise_precision_must_be_finite_and_positive(precision):
    with pytest.raises(ValueError, match=r"`precision` must be finite and > 0"):
        NormalLikelihood(precision)
