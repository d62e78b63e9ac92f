"""``cfbnn::relu_mean`` (moments/moment_ops.py): ReLU's mean alone, what a prediction takes.
Values against scipy quadrature on the ReLU grid at the tolerances of test_moments_quadrature.py
(the Triton kernel too, under the interpreter: tests/moments/triton_check.py), gradients against
the float64 reference formula's autograd, opcheck, vmap, and what ReLU.mean calls."""

from __future__ import annotations

import pytest
import torch
from relu_grid import POINTS, _quadrature, worst_error

from cfbnn_cli.moments import get_activation
from cfbnn_cli.moments.relu_family import reference_moments

relu_mean = torch.ops.cfbnn.relu_mean


@pytest.fixture(scope="module")
def quadrature():
    return _quadrature(POINTS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_operator_matches_quadrature(quadrature, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    phi = relu_mean(mean, std)
    assert phi.dtype == dtype and phi.shape == mean.shape
    assert worst_error([phi], quadrature, POINTS, dtype) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    std = (torch.rand(40, 7, generator=g, dtype=dtype) * 2 + 0.05).requires_grad_()
    torch.library.opcheck(relu_mean.default, (mean, std))


def test_gradients_match_the_float64_reference_and_vmap_matches_the_loop():
    g = torch.Generator().manual_seed(1)
    mean = (torch.randn(30, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    std = (torch.rand(30, 5, generator=g, dtype=torch.float64) + 0.1).requires_grad_()
    weights = torch.randn(30, 5, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((relu_mean(mean, std) * weights).sum(), (mean, std))
    reference_mean, reference_std = (t.detach().clone().requires_grad_() for t in (mean, std))
    phi = reference_moments(reference_mean, reference_std, 0)[0]
    want = torch.autograd.grad((phi * weights).sum(), (reference_mean, reference_std))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(relu_mean, (mean, std))
    batched = torch.func.vmap(relu_mean)(mean.detach(), std.detach())
    torch.testing.assert_close(batched, torch.stack([relu_mean(m, s) for m, s in zip(mean.detach(), std.detach())]))


def test_relu_mean_takes_the_operator_and_matches_the_moments():
    """What a prediction calls: one cfbnn::relu_mean (broadcast operands too), its values those
    of the moments operator's Phi."""
    relu = get_activation("relu")
    g = torch.Generator().manual_seed(2)
    mean, std = torch.randn(200, 30, generator=g) * 3, torch.rand(1, 30, generator=g) + 0.01
    with torch.no_grad(), torch.profiler.profile() as profile:
        phi = relu.mean(mean, std)
    names = [event.key for event in profile.key_averages()]
    assert "cfbnn::relu_mean" in names and "cfbnn::relu_family_moments" not in names
    with torch.no_grad():
        torch.testing.assert_close(phi, relu.moments(mean, std.expand_as(mean))[0], rtol=1e-6, atol=1e-7)


def test_bad_inputs_name_the_operator():
    with pytest.raises(ValueError, match="cfbnn::relu_mean"):
        relu_mean(torch.zeros(3), torch.ones(4))
    with pytest.raises(ValueError, match="cfbnn::relu_mean"):
        relu_mean(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_operator_matches_quadrature_and_opcheck(quadrature, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype, device="cuda")
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype, device="cuda")
    assert worst_error([relu_mean(mean, std).cpu()], quadrature, POINTS, dtype) <= 1.0
    g = torch.Generator().manual_seed(3)
    m = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).cuda().requires_grad_()
    s = (torch.rand(40, 7, generator=g, dtype=dtype) * 2 + 0.05).cuda().requires_grad_()
    torch.library.opcheck(relu_mean.default, (m, s))
