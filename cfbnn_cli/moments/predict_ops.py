"""The deterministic prediction's elementwise passes as torch operators: ``torch.ops.cfbnn.prediction_*``.

A mean-field hidden layer's exact output mean (the logits' ``y_hat`` of the deterministic
prediction ``argmax y_hat``, paper eq. (42)) is two matrix products and, besides them, these two
passes (``activation`` numbers the ReLU family as :data:`.relu_family.ACTIVATION_KINDS`: 0 ReLU, 1 leaky
ReLU of slope ``negative_slope``, 2 ReLU^2; ``bias``: a column of ones appended, paper footnote 1):

``cfbnn::prediction_operand(Tensor inputs, int activation=-1, float negative_slope=0.0, bool bias=True) -> Tensor``
    ``(2, rows, D + bias)``: ``[h, 1]`` and ``[h^2, 1]`` for ``h = g(inputs)`` (``-1``: no
    activation, ``h = inputs``), ``inputs`` ``(..., D)`` with its leading dimensions flattened to
    the rows: the operand of the layer's one batched product with its stacked means and variances
    (``stack([M, V])``, :meth:`~cfbnn_cli.bnn.layers.GaussianMatrix.loc_and_variance`), which gives
    ``gamma = [h, 1] M^T`` and ``xi^2 = [h^2, 1] V^T`` (eqs. (11), (12)). The point layer's
    activation is folded in: it reads the point layer's pre-activations.
``cfbnn::prediction_hidden_mean(Tensor moments, int activation=0, float negative_slope=0.0, bool bias=True) -> Tensor``
    ``(rows, H + bias)``: ``[E g(z), 1]``, ``z ~ N(gamma, xi^2)``, from ``moments = stack([gamma,
    xi^2])`` ``(2, rows, H)`` (that product's result): the variance floored at the dtype's smallest
    normal number and its square root taken inside (as ``cfbnn::relu_family_moments`` from the variances), the
    mean alone computed (eq. (20) for ReLU), written as the output layer's product reads it.

float32 or float64. Declared here once (:mod:`.operators`). Kernels: on CUDA the Triton kernels of
:mod:`.triton_predict_kernels` (one launch each); on every other device the default kernels below:
:func:`reference_prediction_operand` in torch ops, and the hidden mean with the activation's mean
through its own ``cfbnn::`` operator (``relu_mean``, ``relu_family_moments``: C++ on the CPU).
Prediction only: a call that needs a gradient raises (differentiate ``BayesianNetwork.output_moments``
instead). Fake implementations for ``torch.compile``; no host synchronization and only
``torch.empty`` allocations, so the launches are captured in CUDA graphs. Tested in
``tests/moments/test_prediction_ops.py`` and, the Triton kernels under the interpreter,
``tests/moments/prediction_check.py``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .moment_ops import slope_operand
from .operators import FLOATS, LazyModule, Operator, define
from .relu_family import RELU, check_activation, pointwise, std_from_variance, variance_floor

__all__ = [
    "NO_ACTIVATION",
    "prediction_hidden_mean",
    "prediction_operand",
    "reference_prediction_operand",
    "triton_prediction_hidden_mean",
    "triton_prediction_operand",
]

triton_kernels = LazyModule(f"{__package__}.triton_kernels")
triton_predict_kernels = LazyModule(f"{__package__}.triton_predict_kernels")

NO_ACTIVATION = -1  # prediction_operand's inputs taken as they are
# ----------------------------------------------------------------------------- checks


def _check_float(name: str, tensor: Tensor, what: str) -> None:
    if tensor.dtype not in FLOATS:
        raise ValueError(f"cfbnn::{name}: `{what}` must be float32 or float64; got {tensor.dtype}")


def _check_operand(inputs: Tensor, activation: int) -> None:
    name = "prediction_operand"
    _check_float(name, inputs, "inputs")
    if activation != NO_ACTIVATION:
        check_activation(name, activation, also=f", or {NO_ACTIVATION} for none")
    if inputs.dim() < 1 or inputs.shape[-1] < 1:
        raise ValueError(f"cfbnn::{name}: `inputs` must be (..., D) with D >= 1; got shape {tuple(inputs.shape)}")


def _check_moments(moments: Tensor, activation: int) -> None:
    name = "prediction_hidden_mean"
    _check_float(name, moments, "moments")
    check_activation(name, activation)
    if moments.dim() != 3 or moments.shape[0] != 2 or moments.shape[-1] < 1:
        raise ValueError(
            f"cfbnn::{name}: `moments` must be (2, rows, H), the means then the variances; got shape "
            f"{tuple(moments.shape)}"
        )


def _rows(inputs: Tensor) -> Tensor:
    """``inputs`` ``(..., D)`` as ``(rows, D)``."""
    return inputs.reshape(math.prod(inputs.shape[:-1]), inputs.shape[-1])


# ----------------------------------------------------------------------------- reference (torch ops)


def activated(inputs: Tensor, activation: int, negative_slope: float) -> Tensor:
    """``g(inputs)`` of :func:`prediction_operand` in torch ops (a NaN stays NaN)."""
    return inputs if activation == NO_ACTIVATION else pointwise(inputs, activation, negative_slope)


def reference_prediction_operand(
    inputs: Tensor, activation: int = NO_ACTIVATION, negative_slope: float = 0.0, bias: bool = True
) -> Tensor:
    """:func:`prediction_operand` in torch ops (the CPU's kernel: each value written once into the
    stacked result)."""
    rows = _rows(inputs)
    width = rows.shape[-1]
    out = rows.new_empty(2, rows.shape[0], width + int(bias))
    values, squares = out[0, :, :width], out[1, :, :width]
    if activation == RELU:
        torch.clamp_min(rows, 0.0, out=values)  # (ReLU written in place: one pass fewer)
    else:
        values.copy_(activated(rows, activation, negative_slope))
    torch.mul(values, values, out=squares)
    if bias:
        out[:, :, width] = 1.0
    return out


def _operator_mean(mean: Tensor, std: Tensor, activation: int, negative_slope: float) -> Tensor:
    """``E g(z)`` through the family's operators (C++ on the CPU): ReLU's mean alone, the others'
    first output."""
    if activation == RELU:
        return torch.ops.cfbnn.relu_mean(mean, std)
    return torch.ops.cfbnn.relu_family_moments(mean, std, activation, float(negative_slope), False)[0]


def _hidden_mean(moments: Tensor, activation: int, negative_slope: float, bias: bool, mean_of) -> Tensor:
    gamma, variance = moments.unbind(0)
    std = std_from_variance(variance)
    rows, width = gamma.shape
    out = moments.new_empty(rows, width + int(bias))
    out[:, :width] = mean_of(gamma, std, activation, negative_slope)
    if bias:
        out[:, width] = 1.0
    return out


# ----------------------------------------------------------------------------- Triton launches


def _launch(kernel, operand: Tensor, out: Tensor, half: int, activation: int, negative_slope: float, bias: bool, **own):
    """``out`` ``(..., rows, width + bias)``, written by one launch of the prediction ``kernel`` over
    its tiles, from ``operand`` (contiguous, ``width`` wide): the ``prediction`` tuple both kernels
    take (``half``: the offset of the second half, an int64 where it must be), the activation and
    bias, then ``own``, the kernel's own constants and launch options; nothing launched for an empty ``out``."""
    count, width = out.shape[-2], operand.shape[-1]
    if out.numel():
        grid, block_r, block_c = triton_predict_kernels.tile(count, width + int(bias))
        kernel[grid](
            (operand, slope_operand(operand, activation, negative_slope), out, count, width, half),
            activation,
            int(bool(bias)),  # (0 or 1: a constexpr the kernels add to the width)
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            **own,
        )
    return out


def triton_prediction_operand(
    inputs: Tensor, activation: int = NO_ACTIVATION, negative_slope: float = 0.0, bias: bool = True
) -> Tensor:
    """The Triton kernel on ``inputs``' device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    rows = _rows(inputs).contiguous()
    out = rows.new_empty(2, rows.shape[0], rows.shape[1] + int(bias))
    squares = out[0].numel()  # (where the squares start in out)
    return _launch(
        triton_predict_kernels.prediction_operand_kernel, rows, out, squares, activation, negative_slope, bias
    )


def triton_prediction_hidden_mean(
    moments: Tensor, activation: int = 0, negative_slope: float = 0.0, bias: bool = True
) -> Tensor:
    """The Triton kernel on ``moments``' device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    moments = moments.contiguous()
    out = moments.new_empty(moments.shape[1], moments.shape[2] + int(bias))
    return _launch(
        triton_predict_kernels.prediction_hidden_mean_kernel,
        moments,
        out,
        moments[0].numel(),  # (where the variances start in moments)
        activation,
        negative_slope,
        bias,
        FLOOR=variance_floor(moments.dtype),
        CF_DEPTH=triton_kernels.cf_depth(moments.dtype),
        # float64's continued fraction at 8 elements a thread (4 warps) spills registers on sm_90a
        num_warps=8 if moments.dtype == torch.float64 else 4,
    )


# ----------------------------------------------------------------------------- the operators


def _declare(name: str, operand: str, default_activation: int, check, kernels, output_shape):
    """``cfbnn::<name>(Tensor <operand>, SymInt activation=<default_activation>, float negative_slope=0.,
    bool bias=True) -> Tensor``: ``check(operand, activation)``, then ``kernels`` ``(default, cuda)``
    with those arguments; the fake an empty tensor of ``output_shape(operand, bias)``; an autograd
    that refuses: the operators serve prediction (``torch.no_grad``), and a call that needs a
    gradient raises at once rather than at the backward pass."""

    def checked(kernel):
        # (the dispatcher passes on only the arguments given: the schema's defaults again here)
        def run(tensor, activation=default_activation, negative_slope=0.0, bias=True):
            check(tensor, activation)
            return kernel(tensor, activation, negative_slope, bias)

        return run

    def refuse_gradient(ctx, inputs, output):
        raise RuntimeError(
            f"cfbnn::{name} has no derivative: it serves prediction under torch.no_grad() "
            "(BayesianNetwork.output_mean); for gradients differentiate BayesianNetwork.output_moments(x) instead"
        )

    schema = (
        f"{name}(Tensor {operand}, SymInt activation={default_activation}, float negative_slope=0., bool bias=True)"
    )
    return define(
        Operator(
            schema + " -> Tensor",
            checked(kernels[0]),
            lambda tensor, activation=default_activation, negative_slope=0.0, bias=True: tensor.new_empty(
                output_shape(tensor, bias)
            ),
            cuda=checked(kernels[1]),
            setup_context=refuse_gradient,
            backward=lambda ctx, grad: None,
        )
    )


def _operator_hidden_mean(moments, activation, negative_slope, bias):
    # the activation's mean through its own operator (the C++ kernel on the CPU)
    return _hidden_mean(moments, activation, negative_slope, bias, _operator_mean)


prediction_operand = _declare(
    "prediction_operand",
    "inputs",
    NO_ACTIVATION,
    _check_operand,
    (reference_prediction_operand, triton_prediction_operand),
    lambda inputs, bias: (2, math.prod(inputs.shape[:-1]), inputs.shape[-1] + int(bias)),
)
prediction_hidden_mean = _declare(
    "prediction_hidden_mean",
    "moments",
    0,
    _check_moments,
    (_operator_hidden_mean, triton_prediction_hidden_mean),
    lambda moments, bias: (moments.shape[1], moments.shape[2] + int(bias)),
)
