"""``cfbnn::prediction_operand`` and ``cfbnn::prediction_hidden_mean`` (moments/predict_ops.py), the
deterministic prediction's two passes: the CPU's kernels against the independent references of
prediction_check.py (quadrature, the float64 reference ops, the activations' own functions), opcheck,
the refusal of a call that needs a gradient, bad inputs; the Triton kernels against the same
references under the interpreter run in triton_check.py (through test_ops.py)."""

from __future__ import annotations

import pytest
import torch
from prediction_check import FAMILY, assert_prediction_tolerances, prediction_errors

from cfbnn_cli.moments import fast_path
from cfbnn_cli.moments.predict_ops import prediction_route

operand = torch.ops.cfbnn.prediction_operand
hidden_mean = torch.ops.cfbnn.prediction_hidden_mean


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_kernels_match_the_references(dtype):
    errors = prediction_errors(operand, hidden_mean, dtype, torch.Generator().manual_seed(0))
    assert_prediction_tolerances(errors, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_reference_kernels_match_the_references(dtype):
    """Where the C++ library does not serve (the reference path chosen): the reference ops."""
    with fast_path(False):
        errors = prediction_errors(operand, hidden_mean, dtype, torch.Generator().manual_seed(0))
    assert_prediction_tolerances(errors, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype):
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(3, 4, 9, generator=g, dtype=dtype)
    moments = torch.stack([torch.randn(12, 9, generator=g), torch.rand(12, 9, generator=g)]).to(dtype)
    for _, code, params in FAMILY:
        slope = params.get("negative_slope", 0.0)
        for bias in (True, False):
            torch.library.opcheck(operand.default, (inputs, code, slope, bias))
            torch.library.opcheck(hidden_mean.default, (moments, code, slope, bias))
    torch.library.opcheck(operand.default, (inputs, -1, 0.0, True))


def test_a_call_that_needs_a_gradient_is_refused_at_once():
    inputs = torch.randn(4, 3, requires_grad=True)
    moments = torch.stack([torch.randn(4, 3), torch.rand(4, 3)]).requires_grad_()
    with pytest.raises(RuntimeError, match="no derivative.*output_moments"):
        operand(inputs, 0, 0.0, True)
    with pytest.raises(RuntimeError, match="no derivative.*output_moments"):
        hidden_mean(moments, 0, 0.0, True)
    with torch.no_grad():  # as prediction calls them
        assert operand(inputs, 0, 0.0, True).shape == (2, 4, 4) and hidden_mean(moments, 0, 0.0, True).shape == (4, 4)


def test_bad_inputs_name_the_operator():
    with pytest.raises(ValueError, match="cfbnn::prediction_operand.*activation"):
        operand(torch.zeros(2, 3), 3, 0.0, True)
    with pytest.raises(ValueError, match="cfbnn::prediction_operand.*float32 or float64"):
        operand(torch.zeros(2, 3, dtype=torch.int64), 0, 0.0, True)
    with pytest.raises(ValueError, match="cfbnn::prediction_hidden_mean.*activation"):
        hidden_mean(torch.zeros(2, 2, 3), -1, 0.0, True)
    with pytest.raises(ValueError, match=r"cfbnn::prediction_hidden_mean.*\(2, rows, H\)"):
        hidden_mean(torch.zeros(3, 2, 3), 0, 0.0, True)


def test_the_route_follows_the_fast_path_switch():
    like = torch.zeros(2)
    assert prediction_route(like) and not prediction_route(like.to(torch.float16))
    with fast_path(False):
        assert not prediction_route(like)
