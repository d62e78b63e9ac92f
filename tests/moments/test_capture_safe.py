"""Inside a CUDA graph capture the tail corrections cannot branch on values (reading one waits for
the GPU): moments/gaussian.py then computes every element through the tail formulas and selects.
Here that branchless form runs on the CPU (the capture check patched to say yes) and must give
exactly the values of the branching form, deep tails included, in float32 and float64."""

import pytest
import torch
from reference_kernels import reference_kernels

from cfbnn_cli.moments import gaussian, get_activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["relu", "leaky_relu", "relu_squared"])
def test_the_branchless_tail_equals_the_branching_one(monkeypatch, dtype, name):
    activation = get_activation(name)
    mean = torch.cat([torch.linspace(-60, 60, 241), torch.tensor([-1e3, -38.0, -9.0, -4.0, -0.5, 0.0, 3.0, 1e3])])
    mean = mean.to(dtype)
    std = torch.full_like(mean, 1.3)
    with reference_kernels():  # the torch formulas (the reference kernels a GPU runs where it has no kernel)
        branching = activation.moments(mean, std, return_variance=True)
        monkeypatch.setattr(gaussian, "_capturing", lambda tensor: True)
        branchless = activation.moments(mean, std, return_variance=True)
    for a, b in zip(branching, branchless):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
