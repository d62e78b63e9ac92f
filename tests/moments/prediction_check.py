"""The prediction operators' kernels (``moments/predict_ops.py``) against independent references, on
one device: the CPU's kernels (test_prediction_ops.py), the Triton kernels under the interpreter
(triton_check.py's subprocess, through test_ops.py) or compiled on CUDA.

References: for ``cfbnn::prediction_hidden_mean`` scipy quadrature on the ReLU grid (the moments'
tolerances, relu_grid.worst_error) and the float64 reference ops on means and variances that reach
the extremes (a zero, a tiny and a huge variance, means far out on either side); for
``cfbnn::prediction_operand`` the activation object's own function and ``bnn.functional.augment``.
:func:`assert_prediction_tolerances` holds the tolerances every caller asserts."""

from __future__ import annotations

import math

import torch
from relu_grid import POINTS, _quadrature, worst_error

from cfbnn_cli.bnn.functional import augment
from cfbnn_cli.moments import get_activation
from cfbnn_cli.moments.predict_ops import NO_ACTIVATION
from cfbnn_cli.moments.relu_family import reference_moments, std_from_variance

# (name, activation code, parameters): the ReLU family at test_moments_quadrature.py's slopes
FAMILY = (
    ("relu", 0, {}),
    ("leaky_relu", 1, {"negative_slope": 0.125}),
    ("leaky_relu", 1, {"negative_slope": -0.5}),
    ("relu_squared", 2, {}),
)


def operand_inputs(dtype, generator) -> torch.Tensor:
    """``(3, 5, 150)`` pre-activations (two column tiles, the last partial): both signs, zeros,
    values whose squares overflow float32, infinities and a NaN."""
    z = torch.randn(3, 5, 150, generator=generator, dtype=torch.float64) * 3
    z[0, 0, :6] = torch.tensor([0.0, -0.0, 1e20, -1e20, math.inf, -math.inf])
    z[1, 2, 7] = math.nan
    return z.to(dtype)


def operand_errors(operand, dtype, generator) -> dict:
    """``operand(inputs, activation, negative_slope, bias)`` (a kernel of cfbnn::prediction_operand)
    against ``stack([[g(z), 1], [g(z)^2, 1]])`` from the activation objects and augment: whether
    every value is the same (NaN where the reference is NaN), for every member, no activation, and
    with and without the bias column; no rows, no values."""
    z = operand_inputs(dtype, generator)
    rows = z.reshape(-1, z.shape[-1])
    same = True
    cases = [("identity", NO_ACTIVATION, {})] + list(FAMILY)
    for name, code, params in cases:
        h = get_activation(name, **params)(rows)
        for bias in (True, False):
            want = torch.stack([augment(h), augment(h * h)]) if bias else torch.stack([h, h * h])
            got = operand(z, code, params.get("negative_slope", 0.0), bias).cpu()
            same &= got.shape == want.shape and got.dtype == dtype
            same &= bool(torch.equal(got.isnan(), want.isnan()) and (got == want)[~want.isnan()].all())
    same &= operand(z[:0], 0, 0.0, True).shape == (2, 0, z.shape[-1] + 1)  # no rows: nothing launched
    return {"same": same}


def mean_inputs(dtype, generator) -> torch.Tensor:
    """``(2, 37, 150)`` means and variances (partial tiles both ways) reaching the extremes: a zero
    variance (floored), a tiny and a huge one, means 40 standard deviations out on either side."""
    mean = torch.randn(37, 150, generator=generator, dtype=torch.float64) * 3
    variance = torch.rand(37, 150, generator=generator, dtype=torch.float64) * 4
    mean[0, :6] = torch.tensor([2.0, -2.0, 0.0, 40.0, -40.0, -1e3])
    variance[0, :6] = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1e3])
    mean[1, :3], variance[1, :3] = torch.tensor([-3.0, 1.0, -1e4]), torch.tensor([1e-30, 1e30, 1e6])
    return torch.stack([mean, variance]).to(dtype)


def _relative(got, want) -> float:
    """Largest ``|got - want| / max(|want|, 1)``."""
    return float(((got.cpu().double() - want).abs() / want.abs().clamp_min(1.0)).max())


def hidden_mean_errors(hidden_mean, dtype, generator) -> dict:
    """``hidden_mean(moments, activation, negative_slope, bias)`` (a kernel of
    cfbnn::prediction_hidden_mean): ``values`` against quadrature on the ReLU grid (the variance
    the squared grid std; worst_error's units), ``extremes`` against the float64 reference ops on
    :func:`mean_inputs` (relative to ``max(|want|, 1)``), ``ones`` whether the bias column is
    exactly 1 and absent without bias (no rows: none), ``nan`` whether a NaN mean or variance gives NaN."""
    keep = [p for p in POINTS if p[1] > 0]  # (a zero variance is floored: the extremes check it)
    mean = torch.tensor([p[0] for p in keep], dtype=dtype)
    variance = torch.tensor([p[1] for p in keep], dtype=torch.float64).square().to(dtype)
    grid = torch.stack([mean, variance]).reshape(2, 1, -1)
    moments = mean_inputs(dtype, generator)
    values = extremes = 0.0
    ones = nan = True
    for name, code, params in FAMILY:
        slope = params.get("negative_slope", 0.0)
        phi = hidden_mean(grid, code, slope, False).cpu()
        values = max(values, worst_error([phi[0]], _quadrature(keep, name, **params), keep, dtype))
        got = hidden_mean(moments, code, slope, True)
        want = reference_hidden_mean(moments.double(), code, slope, True)  # (slopes exact in float32)
        extremes = max(extremes, _relative(got, want))
        ones &= got.shape == (37, 151) and bool((got[:, -1] == 1).all())
        ones &= hidden_mean(moments, code, slope, False).shape == (37, 150)
        ones &= hidden_mean(moments[:, :0], code, slope, True).shape == (0, 151)
        poisoned = moments.clone()
        poisoned[0, 3, 4], poisoned[1, 5, 6] = math.nan, math.nan
        out = hidden_mean(poisoned, code, slope, True).cpu()
        nan &= bool(out[3, 4].isnan() and out[5, 6].isnan() and out[3, 5].isfinite() and out[5, 7].isfinite())
    return {"values": values, "extremes": extremes, "ones": ones, "nan": nan}


def reference_hidden_mean(moments, activation: int, negative_slope: float, bias: bool) -> torch.Tensor:
    """``cfbnn::prediction_hidden_mean`` by the moments' reference formula (:func:`.relu_family.reference_moments`)."""
    gamma, variance = moments.unbind(0)
    phi = reference_moments(gamma, std_from_variance(variance), activation, negative_slope)[0]
    return augment(phi) if bias else phi


def prediction_errors(operand, hidden_mean, dtype, generator) -> dict:
    """Both kernels' errors (:func:`operand_errors`, :func:`hidden_mean_errors`)."""
    return {**operand_errors(operand, dtype, generator), **hidden_mean_errors(hidden_mean, dtype, generator)}


def assert_prediction_tolerances(errors: dict, dtype) -> None:
    """The moments kernels' tolerances: quadrature at worst_error <= 1; against the float64
    reference ops 1e-10 (float64) and 1e-5 (float32) of ``max(|value|, 1)``; the operand exact."""
    assert errors["same"] and errors["ones"] and errors["nan"], errors
    assert errors["values"] <= 1.0, errors
    assert errors["extremes"] < (1e-10 if dtype == torch.float64 else 1e-5), errors
