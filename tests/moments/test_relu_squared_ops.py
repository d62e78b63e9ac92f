"""``cfbnn::relu_family_moments`` for ReLU^2 (activation 2) and its backward: opcheck, the CPU kernel's values against
quadrature (the independent reference), gradients to the second order, broadcast gradients,
torch.func, the route ``ReLUSquared.moments`` takes. The Triton kernels are checked against the
same references under the interpreter and on CUDA (triton_check.relu_squared_errors, through
test_ops.py)."""

from __future__ import annotations

import pytest
import torch
from relu_grid import POINTS, _quadrature, worst_error

from cfbnn_cli.moments import extension, get_activation


@pytest.fixture(scope="module", autouse=True)
def _library():
    if not extension.status()["loaded"]:
        pytest.skip("the C++ CPU kernels were not built here")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_operator_matches_quadrature(dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    values = torch.ops.cfbnn.relu_family_moments(mean, std, 2, 0.0, False)
    assert all(v.dtype == dtype for v in values)
    assert worst_error(values, _quadrature(POINTS, "relu_squared"), POINTS, dtype) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    std = (torch.rand(40, 7, generator=g, dtype=dtype) * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, std, 2, 0.0, False))
    phi = torch.ops.cfbnn.relu_family_moments(mean.detach(), std.detach(), 2, 0.0, False)[0]
    grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
    torch.library.opcheck(
        torch.ops.cfbnn.relu_family_moments_backward.default, (mean.detach(), std.detach(), phi, *grads, 2, 0.0, False)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cuda(dtype):
    mean = (torch.randn(300, 9, dtype=dtype, device="cuda") * 4).requires_grad_()
    std = (torch.rand(300, 9, dtype=dtype, device="cuda") * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, std, 2, 0.0, False))


def test_gradients_match_finite_differences_to_the_second_order():
    g = torch.Generator().manual_seed(1)
    mean = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    std = (torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    for function in (
        lambda m, s: torch.ops.cfbnn.relu_family_moments(m, s, 2, 0.0, False),
        lambda m, s: torch.ops.cfbnn.relu_family_moments(*torch.broadcast_tensors(m, s), 2, 0.0, False),
    ):
        assert torch.autograd.gradcheck(function, (mean, std))
        assert torch.autograd.gradgradcheck(function, (mean, std))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_reads_broadcast_gradients_as_their_dense_copies(dtype):
    """What ``sum()``'s backward hands over (one value expanded) and an unused output's expanded
    zero: bit for bit the result of their dense copies, on a length with a partial kernel block."""
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(37, 29, generator=g, dtype=dtype) * 3
    std = torch.rand(37, 29, generator=g, dtype=dtype) + 0.05
    phi = torch.ops.cfbnn.relu_family_moments(mean, std, 2, 0.0, False)[0]
    dense = torch.randn(37, 29, generator=g, dtype=dtype)
    for value in (0.0, 1.5):
        broadcast = torch.tensor(value, dtype=dtype).expand(mean.shape)
        for grads in ((broadcast, broadcast, broadcast), (dense, broadcast, dense)):
            got = torch.ops.cfbnn.relu_family_moments_backward(mean, std, phi, *grads, 2, 0.0, False)
            want = torch.ops.cfbnn.relu_family_moments_backward(
                mean, std, phi, *(t.contiguous() for t in grads), 2, 0.0, False
            )
            assert all(torch.equal(a, b) for a, b in zip(got, want)), value


def test_per_draw_gradients_under_vmap_match_the_reference_path():
    """vmap(grad) through ``ReLUSquared.moments`` (the function's vmap rules, and its backward
    kernel under torch.func.grad) against the reference ops' autograd, draw by draw."""
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(4, 10, generator=g, dtype=torch.float64)
    std = torch.rand(4, 10, generator=g, dtype=torch.float64) + 0.1
    activation = get_activation("relu_squared")

    def total(m, s):
        phi, ups, var = activation.moments(m, s, return_variance=True)
        return (phi + 0.5 * ups - var).sum()

    batched = torch.func.vmap(torch.func.grad(total, argnums=(0, 1)))(mean, std)
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    phi, ups, var = activation.reference_moments(m, s)
    (phi + 0.5 * ups - var).sum().backward()
    torch.testing.assert_close(batched[0], m.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(batched[1], s.grad, rtol=1e-12, atol=1e-14)


def test_the_cpu_moments_take_the_operator_with_the_reference_values():
    """On the CPU ``ReLUSquared.moments`` runs the operator (its C++ kernels): the values and
    gradients of the reference formula's autograd, float32 and float64."""
    activation = get_activation("relu_squared")
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.float64):
        mean = torch.randn(50, 9, generator=g, dtype=dtype) * 3
        std = torch.rand(50, 9, generator=g, dtype=dtype) + 0.05
        results = []
        for through_operator in (True, False):
            m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
            if through_operator:
                outputs = activation.moments(m, s, return_variance=True)
            else:
                outputs = activation.reference_moments(m, s)
            (outputs[0].sum() + 0.5 * outputs[1].sum() - outputs[2].sum()).backward()
            results.append([t.detach() for t in outputs] + [m.grad, s.grad])
        for got, want in zip(*results):
            scale = want.abs().max().item()
            tolerance = 1e-5 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * scale)


def test_bad_inputs_name_the_operator():
    with pytest.raises(ValueError, match="relu_family_moments"):
        torch.ops.cfbnn.relu_family_moments(torch.zeros(3), torch.ones(4), 2, 0.0, False)
    with pytest.raises(ValueError, match="relu_family_moments"):
        torch.ops.cfbnn.relu_family_moments(torch.zeros(3), torch.ones(3, dtype=torch.float64), 2, 0.0, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_cuda_moments_take_the_operator_and_match_the_cpu(dtype, rtol):
    """On CUDA ``ReLUSquared.moments`` runs cfbnn::relu_family_moments (Triton): the CPU
    kernels' values and gradients."""
    activation = get_activation("relu_squared")
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(300, 9, generator=g, dtype=dtype) * 3
    std = torch.rand(300, 9, generator=g, dtype=dtype) + 0.05
    results = []
    for device in ("cpu", "cuda"):
        # a fresh leaf per device: .to("cpu") of a CPU tensor is the tensor itself, which would make
        # the CUDA copy a non-leaf (no .grad) once the CPU pass has set requires_grad on it
        m, s = (t.detach().to(device, copy=True).requires_grad_() for t in (mean, std))
        phi, ups, var = activation.moments(m, s, return_variance=True)
        # the CPU's C++ autograd node; on CUDA the operator's Python autograd registration
        assert ("MomentsAutograd" if device == "cpu" else "cfbnn_relu_family_moments") in phi.grad_fn.name()
        (phi.sum() + 0.5 * ups.sum() - var.sum()).backward()
        results.append([t.detach().cpu() for t in (phi, ups, var, m.grad, s.grad)])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
