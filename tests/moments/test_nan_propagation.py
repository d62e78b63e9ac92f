"""A NaN in goes out as a NaN: the moments of ``N(NaN, s^2)`` or ``N(m, NaN)`` are NaN for every
activation, dtype and kernel, and a NaN in a network's input makes its ELBO and that row's
prediction NaN. (The C++ kernels' distance clamp and tail selects once turned a NaN into a
finite far-tail value: a NaN input gave a finite ELBO with NaN gradients; on a GPU, Triton's
maximum / minimum would do the same.) Elements without a NaN keep their values."""

from __future__ import annotations

import pytest
import torch
from reference_kernels import reference_kernels

from cfbnn_cli.bnn import BayesianNetwork, ClosedFormBNN
from cfbnn_cli.moments import get_activation

ACTIVATIONS = ["relu", "leaky_relu", "relu_squared", "hard_sigmoid", "identity"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _operands(dtype, device):
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(6, 40, generator=g, dtype=dtype) * 3
    std = torch.rand(6, 40, generator=g, dtype=dtype) + 0.1
    mean[1, 3] = float("nan")
    std[4, 7] = float("nan")
    return mean.to(device), std.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_moments_of_a_nan_are_nan_and_the_rest_unchanged(name, dtype, device):
    activation = get_activation(name)
    mean, std = _operands(dtype, device)
    bad = mean.isnan() | std.isnan()
    clean_mean, clean_std = mean.masked_fill(mean.isnan(), 0.0), std.masked_fill(std.isnan(), 1.0)
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            outputs = activation.moments(mean, std, return_variance=True)
            clean = activation.moments(clean_mean, clean_std, return_variance=True)
            for index, (value, reference) in enumerate(zip(outputs, clean)):
                nan = bad
                if name == "identity":  # Phi = mean, Var = std^2: each NaN only with its own input
                    nan = {0: mean.isnan(), 1: bad, 2: std.isnan()}[index]
                assert value[nan].isnan().all(), (name, dtype, index, value[nan])
                torch.testing.assert_close(value[~nan], reference[~nan], rtol=0.0, atol=0.0)
            if not grad_mode:
                phi = activation.mean(mean, std)
                nan = mean.isnan() if name == "identity" else bad
                assert phi[nan].isnan().all() and torch.equal(phi[~nan], clean[0][~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_the_reference_formulas_keep_a_nan_too(name, dtype):
    """The torch formulas (a GPU's route for the piecewise polynomials, every device's without
    kernels): a NaN std once read as std 0 there, g(mean) for the hard sigmoid."""
    activation = get_activation(name)
    mean, std = _operands(dtype, "cpu")
    with reference_kernels():
        outputs = activation.moments(mean, std, return_variance=True)
    nan = mean.isnan() if name == "identity" else mean.isnan() | std.isnan()
    assert outputs[0][nan].isnan().all() and outputs[1][mean.isnan() | std.isnan()].isnan().all()
    assert not outputs[0][~(mean.isnan() | std.isnan())].isnan().any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_variance_operators_and_the_tail_pass_keep_a_nan(dtype, device):
    mean, std = _operands(dtype, device)
    variance = std.square()
    bad = mean.isnan() | std.isnan()
    for value in torch.ops.cfbnn.relu_family_moments(mean, variance, 0, 0.0, True):
        assert value[bad].isnan().all() and value[~bad].isfinite().all()
    grads = torch.ops.cfbnn.relu_family_moments_backward(mean, variance, *(torch.ones_like(mean),) * 4, 0, 0.0, True)
    for value in grads:
        assert value[bad].isnan().all() and value[~bad].isfinite().all()
    weights = torch.ones(40, dtype=dtype, device=device)
    for family in ((0, 0.0), (1, 0.1), (2, 0.0)):
        mean_sum, spread_sum = torch.ops.cfbnn.relu_tail(mean, variance, weights, weights, weights, *family)
        rows = bad.any(-1)
        assert mean_sum[rows].isnan().all() and spread_sum[rows].isnan().all(), family
        assert mean_sum[~rows].isfinite().all() and spread_sum[~rows].isfinite().all(), family


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["relu", "relu_squared", "leaky_relu"])
def test_a_nan_input_makes_the_elbo_and_its_rows_prediction_nan(activation, dtype, device):
    torch.manual_seed(0)
    x, y = torch.randn(50, 3, dtype=dtype, device=device), torch.randn(50, dtype=dtype, device=device)
    x[7, 1] = float("nan")
    one_hidden = ClosedFormBNN(3, 10, activation=activation).to(device, dtype)
    deeper = BayesianNetwork(3, [6, 5], activation=activation).to(device, dtype)
    for network, estimator in ((one_hidden, "analytic"), (deeper, "deterministic"), (deeper, "analytic")):
        assert network.elbo(x, y, num_data=100, estimator=estimator).isnan(), (activation, estimator)
    with torch.no_grad():
        prediction = one_hidden.predict(x)
        mean = one_hidden.output_mean(x)
    assert prediction.mean[7].isnan() and prediction.variance[7].isnan() and mean[7].isnan()
    keep = torch.arange(50, device=device) != 7
    assert prediction.mean[keep].isfinite().all() and mean[keep].isfinite().all()
