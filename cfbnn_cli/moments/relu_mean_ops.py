"""ReLU's mean alone as a torch operator: ``torch.ops.cfbnn.relu_mean``.

``cfbnn::relu_mean(Tensor mean, Tensor std) -> Tensor``
    ``E[max(z, 0)]``, ``z ~ N(mean, std^2)``, elementwise (the Phi of paper eq. (20));
    ``mean`` and ``std`` of one shape, dtype float32 or float64.

What a prediction needs (:meth:`~cfbnn_cli.moments.activations.ReLU.mean` without autograd, the
deterministic prediction ``argmax E[y]`` of eq. (42)): one output written, not ``cfbnn::relu_family_moments``'
three and its saved Gaussian factors. Kernels: on the CPU the C++ ``relu_mean`` (``csrc/cfbnn_ops.cpp``,
registered when the library loads; before that, and without a compiler, the reference ops); on
CUDA the Triton :func:`~.triton_kernels.relu_mean_kernel`, one launch. Its gradient is Phi's
through ``cfbnn::relu_family_moments_backward``; fake and vmap registrations. Tested against the
quadrature references and with ``opcheck`` (``tests/moments/test_relu_mean_ops.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .operator_registration import (
    absent_gradient,
    check_operands,
    elementwise_vmap,
)
from .ops import HAVE_TRITON, relu_family_moments_backward, triton_kernels
from .relu_family import RELU, reference_moments

__all__ = ["relu_mean", "triton_relu_mean"]


def triton_relu_mean(mean: Tensor, std: Tensor) -> Tensor:
    """The Triton kernel on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    mean, std = mean.contiguous(), std.contiguous()
    phi = torch.empty_like(mean)
    n = mean.numel()
    triton_kernels.relu_mean_kernel[triton_kernels.grid(n)](
        mean, std, phi, n, triton_kernels.BLOCK, triton_kernels.cf_depth(mean.dtype)
    )
    return phi


@torch.library.custom_op("cfbnn::relu_mean", mutates_args=())
def relu_mean(mean: Tensor, std: Tensor) -> Tensor:
    # the default kernel (every device without its own: the C++ library registers the CPU's)
    check_operands("relu_mean", mean, std)
    return reference_moments(mean, std, RELU)[0].clone()


if HAVE_TRITON:

    @relu_mean.register_kernel("cuda")
    def _relu_mean_cuda(mean: Tensor, std: Tensor) -> Tensor:
        check_operands("relu_mean", mean, std)
        return triton_relu_mean(mean, std)


@relu_mean.register_fake
def _(mean, std):
    return torch.empty_like(mean)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output)


def _backward(ctx, grad_phi):
    mean, std, phi = ctx.saved_tensors
    unused = absent_gradient(mean)
    return relu_family_moments_backward(mean, std, phi, grad_phi, unused, unused, RELU, 0.0, False)


relu_mean.register_autograd(_backward, setup_context=_setup_context)


relu_mean.register_vmap(elementwise_vmap(relu_mean, 1))
