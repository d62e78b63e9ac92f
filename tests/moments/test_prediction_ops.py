"""``cfbnn::prediction_operand`` and ``cfbnn::prediction_hidden_mean`` (moments/predict_ops.py), the
deterministic prediction's two passes: the CPU's kernels against the independent references of
prediction_check.py (quadrature, the float64 reference ops, the activations' own functions), opcheck,
the refusal of a call that needs a gradient, bad inputs; the Triton kernels against the same
references under the interpreter run in triton_check.py (through test_ops.py)."""

from __future__ import annotations

import pytest
import torch
from prediction_check import FAMILY, assert_prediction_tolerances, prediction_errors
from reference_kernels import reference_kernels

operand = torch.ops.cfbnn.prediction_operand
hidden_mean = torch.ops.cfbnn.prediction_hidden_mean


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_kernels_match_the_references(dtype):
    errors = prediction_errors(operand, hidden_mean, dtype, torch.Generator().manual_seed(0))
    assert_prediction_tolerances(errors, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_reference_kernels_match_the_references(dtype):
    """Where the C++ library does not serve: the operators' reference kernels."""
    with reference_kernels():
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
    with pytest.raises(ValueError, match=r"cfbnn::prediction_operand.*activation.*, or -1 for none; got 3"):
        operand(torch.zeros(2, 3), 3, 0.0, True)
    with pytest.raises(ValueError, match="cfbnn::prediction_operand.*float32 or float64"):
        operand(torch.zeros(2, 3, dtype=torch.int64), 0, 0.0, True)
    with pytest.raises(ValueError, match="cfbnn::prediction_hidden_mean.*activation"):
        hidden_mean(torch.zeros(2, 2, 3), -1, 0.0, True)
    with pytest.raises(ValueError, match=r"cfbnn::prediction_hidden_mean.*\(2, rows, H\)"):
        hidden_mean(torch.zeros(3, 2, 3), 0, 0.0, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_operators_match_the_references_and_opcheck(dtype):
    def on_cuda(operator):
        return lambda tensor, *numbers: operator(tensor.cuda(), *numbers)

    errors = prediction_errors(on_cuda(operand), on_cuda(hidden_mean), dtype, torch.Generator().manual_seed(0))
    assert_prediction_tolerances(errors, dtype)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(3, 4, 9, generator=g, dtype=dtype).cuda()
    moments = torch.stack([torch.randn(12, 9, generator=g), torch.rand(12, 9, generator=g)]).to("cuda", dtype)
    for _, code, params in FAMILY:
        torch.library.opcheck(operand.default, (inputs, code, params.get("negative_slope", 0.0), True))
        torch.library.opcheck(hidden_mean.default, (moments, code, params.get("negative_slope", 0.0), True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "relu_squared"])
def test_cuda_prediction_is_captured_in_a_cuda_graph(activation):
    """The head's deterministic prediction as imagenet-predict runs it: a CUDA graph (no host
    synchronization, no capture-breaking allocation), the weights cached; replays equal the eager
    call and the CPU's float64 prediction."""
    from cfbnn_cli.bnn import bayesian_head, cached_weights
    from cfbnn_cli.runtime.cuda_graphs import GraphedCall

    torch.manual_seed(0)
    head = bayesian_head(64, [128, 96], 10, activation=activation, init_scale=0.3).double()
    x = torch.randn(256, 64, dtype=torch.float64)
    with torch.no_grad():
        reference = head.output_mean(x)
        for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            on_gpu = head.to("cuda", dtype)
            graphed = GraphedCall(on_gpu.output_mean, "cuda", label="deterministic prediction")
            features = x.to("cuda", dtype)
            with cached_weights():
                eager = on_gpu.output_mean(features)
                replays = [graphed(features) for _ in range(3)]  # eager warm-up, capture, replay
            assert graphed.failure is None and graphed.graphs, graphed.failure
            for logits in replays:
                torch.testing.assert_close(logits, eager, rtol=0, atol=0)
            torch.testing.assert_close(eager.cpu().double(), reference, rtol=tolerance, atol=tolerance)
            head = head.to("cpu", torch.float64)
