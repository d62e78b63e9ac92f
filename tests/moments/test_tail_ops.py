"""``cfbnn::relu_tail`` (the last hidden layer's tail pass as an operator): values and gradients
against the float64 reference torch ops (ReLU moments checked against scipy quadrature in
test_ops.py / test_moments_quadrature.py), opcheck, gradcheck, vmap, bad inputs; the Triton
kernels under the interpreter are in triton_check.py."""

import pytest
import torch

from cfbnn_cli.moments import elbo_ops, elbo_reference


def _inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(rows, width, generator=g, dtype=torch.float64) * 3
    variance = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    variance[0, 0] = 0.0  # a zero variance (floored) and a very wide unit
    variance[-1, -1] = 1e6
    weights = [torch.randn(width, generator=g, dtype=torch.float64) for _ in range(3)]
    weights[1], weights[2] = weights[0].square(), torch.rand(width, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (mean, variance, *weights)]


# the ReLU family's (activation, negative_slope): ReLU, leaky ReLU inside and outside [0, 1], ReLU^2
FAMILY = [(0, 0.0), (1, 0.125), (1, -0.5), (2, 0.0)]
FAMILY_IDS = ["relu", "leaky_0.125", "leaky_-0.5", "relu_squared"]


def _reference(tensors, family=(0, 0.0)):
    return elbo_reference.relu_tail(*[t.double() for t in tensors], *family)


@pytest.mark.parametrize("family", FAMILY, ids=FAMILY_IDS)
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
# rows narrower than the kernel's groups of whole rows, a few per group, and one wider than a group
@pytest.mark.parametrize("shape", [(1, 1), (37, 5), (300, 200), (7, 1500)])
def test_cpu_tail_matches_the_reference_ops(dtype, rtol, shape, family):
    tensors = _inputs(*shape, dtype)
    got = torch.ops.cfbnn.relu_tail(*tensors, *family)
    for value, want in zip(got, _reference(tensors, family)):
        assert value.dtype == dtype and value.shape == shape[:1]
        torch.testing.assert_close(value.double(), want, rtol=rtol, atol=rtol * float(want.abs().max()))


@pytest.mark.parametrize("family", FAMILY, ids=FAMILY_IDS)
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("rows, width", [(40, 9), (5, 1500)])
def test_cpu_tail_gradients_match_the_reference_autograd(dtype, rtol, family, rows, width):
    tensors = [t.requires_grad_() for t in _inputs(rows, width, dtype, seed=1)]
    reference = [t.detach().double().requires_grad_() for t in tensors]
    g = torch.Generator().manual_seed(2)
    row_grads = [torch.randn(rows, generator=g, dtype=torch.float64) for _ in range(2)]
    torch.autograd.backward(torch.ops.cfbnn.relu_tail(*tensors, *family), [r.to(dtype) for r in row_grads])
    torch.autograd.backward(elbo_reference.relu_tail(*reference, *family), row_grads)
    for got, want in zip(tensors, reference):
        scale = float(want.grad.abs().max())
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=rtol, atol=rtol * scale)


def test_a_tail_of_width_zero_sums_to_zero():
    """No hidden unit: each row's sums are 0 (empty sums), the gradients empty."""
    mean, variance, weights = torch.zeros(4, 0), torch.ones(4, 0), [torch.zeros(0)] * 3
    for sums in (
        torch.ops.cfbnn.relu_tail(mean, variance, *weights),
        torch.ops.cfbnn.relu_tail_with_gradients(
            mean, variance, *weights, torch.ones(4), torch.ones(1, 1), torch.zeros(1), 1.0, True
        )[:2],
    ):
        assert all(torch.equal(value, torch.zeros(4)) for value in sums)
    grads = torch.ops.cfbnn.relu_tail_backward(mean, variance, *weights, torch.ones(4), torch.ones(4))
    assert [tuple(g.shape) for g in grads] == [(4, 0), (4, 0), (3, 0)]


@pytest.mark.parametrize("family", FAMILY, ids=FAMILY_IDS)
def test_gradcheck_and_double_backward(family):
    tensors = [t.requires_grad_() for t in _inputs(6, 4, torch.float64, seed=3)]
    # away from the floor's kink, and of a size finite differences resolve
    tensors[1] = (tensors[1].detach().clamp(max=4.0) + 0.05).requires_grad_()
    function = lambda *t: torch.ops.cfbnn.relu_tail(*t, *family)  # noqa: E731
    assert torch.autograd.gradcheck(function, tensors)
    assert torch.autograd.gradgradcheck(function, tensors)


@pytest.mark.parametrize("family", FAMILY, ids=FAMILY_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype, family):
    tensors = _inputs(30, 7, dtype, seed=4)
    tensors[1] = tensors[1] + 0.01
    torch.library.opcheck(torch.ops.cfbnn.relu_tail.default, [t.requires_grad_() for t in tensors] + list(family))
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(30, generator=g, dtype=torch.float64).to(dtype) for _ in range(2)]
    arguments = [t.detach() for t in tensors] + rows + list(family)
    torch.library.opcheck(torch.ops.cfbnn.relu_tail_backward.default, arguments)


def test_vmap_with_shared_and_batched_weights():
    batch = [_inputs(8, 5, torch.float64, seed=s) for s in range(3)]
    stacked = [torch.stack(parts) for parts in zip(*batch)]
    shared = torch.func.vmap(torch.ops.cfbnn.relu_tail, in_dims=(0, 0, None, None, None))(*stacked[:2], *batch[0][2:])
    own = torch.func.vmap(torch.ops.cfbnn.relu_tail)(*stacked)
    for index, parts in enumerate(batch):
        for got, want in zip(shared, elbo_reference.relu_tail(*parts[:2], *batch[0][2:])):
            torch.testing.assert_close(got[index], want, rtol=1e-12, atol=1e-12)
        for got, want in zip(own, elbo_reference.relu_tail(*parts)):
            torch.testing.assert_close(got[index], want, rtol=1e-12, atol=1e-12)


def test_bad_inputs_name_the_problem():
    mean, variance, *weights = _inputs(4, 3, torch.float64)
    with pytest.raises(ValueError, match="each weight must be"):
        torch.ops.cfbnn.relu_tail(mean, variance, weights[0][:2], *weights[1:])
    with pytest.raises(ValueError, match=r"must be \(rows, H\)"):
        torch.ops.cfbnn.relu_tail(mean[0], variance[0], *weights)
    with pytest.raises(ValueError, match="one dtype"):
        torch.ops.cfbnn.relu_tail(mean, variance.float(), *weights)
    rows = [torch.zeros(4, dtype=torch.float64)] * 2
    for activation in (3, -1):  # the C++ kernels' check, and the Python reference's (no library needed)
        with pytest.raises(
            ValueError, match=rf"`activation` must be one of the ReLU family's members 0 \.\. 2 .*; got {activation}"
        ):
            torch.ops.cfbnn.relu_tail(mean, variance, *weights, activation)
        with pytest.raises(ValueError, match="`activation` must be"):
            torch.ops.cfbnn.relu_tail_backward(mean, variance, *weights, *rows, activation)
        with pytest.raises(ValueError, match="`activation` must be"):
            elbo_ops._check_tail("relu_tail", mean, variance, *weights, activation=activation)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cuda(dtype):
    tensors = [t.cuda() for t in _inputs(30, 70, dtype, seed=6)]
    tensors[1] = tensors[1] + 0.01
    torch.library.opcheck(torch.ops.cfbnn.relu_tail.default, [t.requires_grad_() for t in tensors])
    rows = [torch.randn(30, dtype=dtype, device="cuda") for _ in range(2)]
    torch.library.opcheck(torch.ops.cfbnn.relu_tail_backward.default, [t.detach() for t in tensors] + rows)
