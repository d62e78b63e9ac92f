"""The pipelines' Adam (cfbnn_cli.train.optimizers.adam): torch's fused implementation where it
applies, the same update as torch's default implementation (a separate code path: a Python loop
of tensor operations), and the default where the fused kernel does not take the parameters."""

from __future__ import annotations

import pytest
import torch

from cfbnn_cli.bnn import ClosedFormBNN
from cfbnn_cli.train.optimizers import adam


def _train(optimizer_factory, dtype, steps=25):
    """``steps`` Adam steps of a closed-form 6-9-1 network on a fixed regression batch."""
    torch.manual_seed(0)
    model = ClosedFormBNN(6, 9).to(dtype)
    optimizer = optimizer_factory(model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=g, dtype=dtype)
    y = torch.randn(40, generator=g, dtype=dtype)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        (-model.elbo(x, y, num_data=400)).backward()
        optimizer.step()
    return optimizer, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_adam_takes_the_steps_of_the_default_implementation(dtype, rtol):
    fused, got = _train(lambda params: adam(params, lr=0.05), dtype)
    assert fused.param_groups[0]["fused"] is True
    _, want = _train(lambda params: torch.optim.Adam(params, lr=0.05), dtype)
    _, start = _train(lambda params: torch.optim.Adam(params, lr=0.05), dtype, steps=0)
    moved = max(float((a - b).abs().max()) for a, b in zip(want, start))
    assert moved > 0.1  # the steps moved the parameters: the comparison below is not of untouched values
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


def test_param_groups_are_taken_as_torch_takes_them():
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = adam([{"params": [first]}, {"params": second, "lr": 0.5}], lr=0.1)
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.5]
    assert all(group["fused"] for group in optimizer.param_groups)


def test_parameters_the_fused_kernel_does_not_take_get_the_default():
    """Complex parameters (not floating point) and parameters on two devices: the default Adam,
    which still trains them."""
    complex_parameter = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))
    optimizer = adam([complex_parameter], lr=0.1)
    assert not optimizer.param_groups[0]["fused"]
    complex_parameter.grad = torch.ones(3, dtype=torch.complex64)
    optimizer.step()
    assert torch.all(complex_parameter.real < 1.0)
    meta = torch.nn.Parameter(torch.ones(2, device="meta"))
    assert not adam([torch.nn.Parameter(torch.ones(2)), meta], lr=0.1).param_groups[0]["fused"]
