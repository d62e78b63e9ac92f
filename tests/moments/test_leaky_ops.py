"""``cfbnn::relu_family_moments`` for leaky ReLU (activation 1) and its backward: opcheck, the CPU kernel's values against
quadrature (the independent reference), gradients, broadcast gradients, torch.func. The Triton
kernels are checked against the same references under the interpreter and on CUDA
(triton_check.leaky_errors, through test_ops.py)."""

from __future__ import annotations

import pytest
import torch
from relu_grid import POINTS, _quadrature, worst_error
from triton_check import LEAKY_SLOPES

from cfbnn_cli.moments import extension, get_activation


@pytest.fixture(scope="module", autouse=True)
def _library():
    if not extension.status()["loaded"]:
        pytest.skip("the C++ CPU kernels were not built here")


@pytest.mark.parametrize("slope", LEAKY_SLOPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_operator_matches_quadrature(slope, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    values = torch.ops.cfbnn.relu_family_moments(mean, std, 1, slope, False)
    assert all(v.dtype == dtype for v in values)
    assert worst_error(values, _quadrature(POINTS, "leaky_relu", negative_slope=slope), POINTS, dtype) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    std = (torch.rand(40, 7, generator=g, dtype=dtype) * 2).requires_grad_()
    for slope in LEAKY_SLOPES:
        torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, std, 1, slope, False))
        phi = torch.ops.cfbnn.relu_family_moments(mean.detach(), std.detach(), 1, slope, False)[0]
        grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
        torch.library.opcheck(
            torch.ops.cfbnn.relu_family_moments_backward.default,
            (mean.detach(), std.detach(), phi, *grads, 1, slope, False),
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cuda(dtype):
    mean = (torch.randn(300, 9, dtype=dtype, device="cuda") * 4).requires_grad_()
    std = (torch.rand(300, 9, dtype=dtype, device="cuda") * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, std, 1, -0.5, False))


def test_gradients_match_finite_differences_to_the_second_order():
    g = torch.Generator().manual_seed(1)
    mean = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    std = (torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    for slope in LEAKY_SLOPES:
        assert torch.autograd.gradcheck(
            lambda m, s: torch.ops.cfbnn.relu_family_moments(m, s, 1, slope, False), (mean, std)
        )
        function = lambda m, s: torch.ops.cfbnn.relu_family_moments(*torch.broadcast_tensors(m, s), 1, slope, False)  # noqa: E731
        assert torch.autograd.gradcheck(function, (mean, std))
        assert torch.autograd.gradgradcheck(function, (mean, std))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_reads_broadcast_gradients_as_their_dense_copies(dtype):
    """What ``sum()``'s backward hands over (one value expanded) and an unused output's expanded
    zero: bit for bit the result of their dense copies, on a length with a partial kernel block."""
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(37, 29, generator=g, dtype=dtype) * 3
    std = torch.rand(37, 29, generator=g, dtype=dtype) + 0.05
    phi = torch.ops.cfbnn.relu_family_moments(mean, std, 1, 0.125, False)[0]
    dense = torch.randn(37, 29, generator=g, dtype=dtype)
    for value in (0.0, 1.5):
        broadcast = torch.tensor(value, dtype=dtype).expand(mean.shape)
        for grads in ((broadcast, broadcast, broadcast), (dense, broadcast, dense)):
            got = torch.ops.cfbnn.relu_family_moments_backward(mean, std, phi, *grads, 1, 0.125, False)
            want = torch.ops.cfbnn.relu_family_moments_backward(
                mean, std, phi, *(t.contiguous() for t in grads), 1, 0.125, False
            )
            assert all(torch.equal(a, b) for a, b in zip(got, want)), value


def test_per_draw_gradients_under_vmap_match_the_reference_path():
    """vmap(grad) through the function (its vmap rules, and its backward kernel under
    torch.func.grad) against the reference ops' autograd, draw by draw."""
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(4, 10, generator=g, dtype=torch.float64)
    std = torch.rand(4, 10, generator=g, dtype=torch.float64) + 0.1
    activation = get_activation("leaky_relu", negative_slope=-0.5)

    def total(m, s):
        phi, ups, var = torch.ops.cfbnn.relu_family_moments(*torch.broadcast_tensors(m, s), 1, -0.5, False)
        return (phi + 0.5 * ups - var).sum()

    batched = torch.func.vmap(torch.func.grad(total, argnums=(0, 1)))(mean, std)
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    phi, ups, var = activation.reference_moments(m, s)
    (phi + 0.5 * ups - var).sum().backward()
    torch.testing.assert_close(batched[0], m.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(batched[1], s.grad, rtol=1e-12, atol=1e-14)


def test_bad_inputs_name_the_operator():
    with pytest.raises(ValueError, match="relu_family_moments"):
        torch.ops.cfbnn.relu_family_moments(torch.zeros(3), torch.ones(4), 1, 0.1, False)
    with pytest.raises(ValueError, match="relu_family_moments"):
        torch.ops.cfbnn.relu_family_moments(torch.zeros(3), torch.ones(3, dtype=torch.float64), 1, 0.1, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_cuda_moments_take_the_operator_and_match_the_cpu(dtype, rtol, monkeypatch):
    """On CUDA ``LeakyReLU.moments`` runs cfbnn::relu_family_moments (Triton): the CPU kernels'
    values and gradients."""
    activation = get_activation("leaky_relu", negative_slope=-0.5)
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(300, 9, generator=g, dtype=dtype) * 3
    std = torch.rand(300, 9, generator=g, dtype=dtype) + 0.05
    results = []
    for device in ("cpu", "cuda"):
        # a fresh leaf per device: .to("cpu") of a CPU tensor is the tensor itself, which would make
        # the CUDA copy a non-leaf (no .grad) once the CPU pass has set requires_grad on it
        m, s = (t.detach().to(device, copy=True).requires_grad_() for t in (mean, std))
        phi, ups, var = activation.moments(m, s, return_variance=True)
        (phi.sum() + 0.5 * ups.sum() - var.sum()).backward()
        results.append([t.detach().cpu() for t in (phi, ups, var, m.grad, s.grad)])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
