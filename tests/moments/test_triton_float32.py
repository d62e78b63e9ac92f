"""The Triton kernels' float32 arithmetic for float32 inputs (issue #46): every kernel of the
ReLU family's moments -- the moments, from the variances, the mean alone, leaky ReLU, ReLU^2, the
tail pass -- and their backward passes, under Triton's interpreter (``TRITON_INTERPRET=1``, set in
a subprocess before Triton is imported, as test_ops.py does), on a grid of extremes: ``t =
mean/std`` from -40 to 40 (the ratios not all exact in float32, and ``|t|`` around 12-13, where
``exp(-t^2/2)`` is about to leave float32's normal range), ``std`` from 1e-6 to 1e3, and ``std =
0``. Against the reference ops in float64 on the same (float32) inputs, in the units of
triton_check.py's tolerances: values relative to ``E|g|``, ``Upsilon`` and ``Var`` (a value whose
true size is below the dtype's normal range need only be tiny, as relu_grid.worst_error), 1e-5 for
float32; gradients ``|got - want| / max(|want|, 1)``, 1e-5. Float64 inputs keep float64's
arithmetic: 1e-12 there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}

T_GRID = [0.0, 1e-3, 0.25, 0.5, 0.999, 1.0, 1.001, 1.5, 1.999, 2.0, 3.0, 5.0, 8.0, 12.0, 12.5, 13.0, 13.3, 20.0, 40.0]
STD_GRID = [1e-6, 1.2e-4, 0.37, 1.0, 3.3, 1e3]
SLOPES = (0.125, -0.5)


def grid(dtype):
    """``(mean, std)`` in ``dtype``: the grid on both sides of 0, a few ratios at random, ``std = 0``."""
    g = torch.Generator().manual_seed(46)
    ts = torch.tensor(T_GRID + [-t for t in T_GRID if t > 0], dtype=torch.float64)
    ts = torch.cat([ts, (torch.rand(40, generator=g, dtype=torch.float64) - 0.5) * 30])
    stds = torch.tensor(STD_GRID, dtype=torch.float64)
    mean = (ts[:, None] * stds[None, :]).flatten()
    std = stds.repeat(len(ts))
    mean = torch.cat([mean, torch.tensor([2.0, -2.0, 0.0, 1e-3], dtype=torch.float64)])
    std = torch.cat([std, torch.zeros(4, dtype=torch.float64)])
    return mean.to(dtype), std.to(dtype)


def value_error(got, want, scale, std, dtype) -> float:
    """Largest ``|got - want| / scale`` over the tolerance; where ``scale`` is below ``tiny *
    max(1, std^2)``, 0 for a tiny ``got`` and ``inf`` otherwise (relu_grid.worst_error's rule)."""
    floor = torch.finfo(dtype).tiny * std.double().square().clamp_min(1.0)
    got, want, scale = got.double(), want.double(), scale.double()
    small = scale < floor
    errors = torch.where(small, torch.zeros_like(got), (got - want).abs() / scale.where(~small, 1.0))
    errors = torch.where(small & (got.abs() > 1e3 * floor), math.inf, errors)
    return float(errors.max()) / TOLERANCE[dtype]


def grad_error(got, want, keep, dtype) -> float:
    got, want = got.double()[keep], want[keep]
    return float(((got - want).abs() / want.abs().clamp_min(1.0)).max()) / TOLERANCE[dtype]


def leaf(t):
    """A fresh float64 leaf of ``t``'s values."""
    return t.detach().to(torch.float64, copy=True).requires_grad_()


def small_tail_reference(mean, std):
    """ReLU's ``(Phi, Upsilon, Var)`` in float64 from the small tail (leaky ReLU's reference ops at
    slope 0), without autograd."""
    from cfbnn_cli.moments.relu_family import reference_moments

    with torch.no_grad():
        return reference_moments(mean.detach().double(), std.detach().double(), 1, 0.0)


def elementwise_errors(dtype) -> dict:
    """Each elementwise kernel's worst value and gradient errors on the grid, in tolerances."""
    from cfbnn_cli.moments import moment_ops
    from cfbnn_cli.moments.relu_family import reference_moments

    mean, std = grid(dtype)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(len(mean), generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
    keep = std > 0  # (the references' autograd has no gradient at std = 0)
    every = torch.ones_like(keep)
    out = {}

    def record(name, got, want, backward, leaves, values=None, scales=None, value_rows=every, grad_rows=keep):
        """Values against ``values`` (default ``want``) relative to ``scales`` (default the values),
        gradients against ``want``'s autograd."""
        torch.autograd.backward(list(want), [t.double() for t in grads])
        values = [t.detach() for t in (want if values is None else values)]
        scales = values if scales is None else scales
        worst = max(
            value_error(a[value_rows], b[value_rows], c[value_rows], std[value_rows], dtype)
            for a, b, c in zip(got, values, scales)
        )
        gradients = max(grad_error(a, b.grad, grad_rows, dtype) for a, b in zip(backward, leaves))
        out[name] = {"values": worst, "grads": gradients}

    # ReLU's values against the small-tail reference (leaky ReLU's at slope 0: it keeps float64's
    # digits out in the tail), the gradients against ReLU's float64 reference formula's autograd
    m64, s64 = (leaf(t) for t in (mean, std))
    got = moment_ops.triton_family_moments(mean, std, 0, 0.0, False)
    backward = moment_ops.triton_family_moments_backward(mean, std, got[0], *grads, 0, 0.0, False)
    values = small_tail_reference(m64, s64)
    record("relu", got, reference_moments(m64, s64, 0), backward, (m64, s64), values)
    alone = moment_ops.triton_relu_mean(mean, std)
    out["relu_mean"] = {"values": value_error(alone, values[0], values[0], std, dtype)}

    variance = std.double().square().to(dtype)
    m64, v64 = (leaf(t) for t in (mean, variance))
    got = moment_ops.triton_family_moments(mean, variance, 0, 0.0, True)
    backward = moment_ops.triton_family_moments_backward(mean, variance, got[0], *grads, 0, 0.0, True)
    want = reference_moments(m64, v64.sqrt(), 0)
    values = small_tail_reference(m64, v64.sqrt())
    positive = variance > 0  # (a variance of 0 is floored)
    record("relu_from_variance", got, want, backward, (m64, v64), values, None, positive, positive)

    for slope in SLOPES:
        m64, s64 = (leaf(t) for t in (mean, std))
        # the reference's slope as the kernels read it (float32 inputs: the float32 slope)
        want = reference_moments(m64, s64, 1, float(torch.tensor(slope, dtype=dtype)))
        got = moment_ops.triton_family_moments(mean, std, 1, slope, False)
        backward = moment_ops.triton_family_moments_backward(mean, std, got[0], *grads, 1, slope, False)
        m, s = mean.double(), std.double()
        e_abs = (
            small_tail_reference(m, s)[0]
            + abs(float(torch.tensor(slope, dtype=dtype))) * small_tail_reference(-m, s)[0]
        )
        record(f"leaky_{slope}", got, want, backward, (m64, s64), None, [e_abs, want[1].detach(), want[2].detach()])

    m64, s64 = (leaf(t) for t in (mean, std))
    want = reference_moments(m64, s64, 2)
    got = moment_ops.triton_family_moments(mean, std, 2, 0.0, False)
    backward = moment_ops.triton_family_moments_backward(mean, std, got[0], *grads, 2, 0.0, False)
    record("relu_squared", got, want, backward, (m64, s64))
    return out


def scaled(got, want) -> float:
    """triton_check._scaled: sums that may cancel, against their largest."""
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0))


def tail_errors(dtype) -> dict:
    """The tail pass on the grid laid out as (rows, 150): the two row sums and the five gradients
    against the float64 reference ops' autograd, per member of the ReLU family."""
    from cfbnn_cli.moments import elbo_ops, elbo_reference

    mean, std = grid(dtype)
    n = len(mean) - len(mean) % 150
    g = torch.Generator().manual_seed(11)
    mean, variance = mean[:n].reshape(-1, 150), std[:n].double().square().to(dtype).reshape(-1, 150)
    w_phi = torch.randn(150, generator=g, dtype=torch.float64)
    tensors = [mean, variance] + [
        w.to(dtype) for w in (w_phi, w_phi.square(), torch.rand(150, generator=g, dtype=torch.float64))
    ]
    rows = [torch.randn(mean.shape[0], generator=g, dtype=torch.float64) for _ in range(2)]
    out = {}
    for family in ((0, 0.0), (1, 0.125), (1, -0.5), (2, 0.0)):
        reference = [leaf(t) for t in tensors]
        slope = float(torch.tensor(family[1], dtype=dtype))
        want = elbo_reference.relu_tail(*reference, family[0], slope)
        torch.autograd.backward(want, rows)
        got = elbo_ops.triton_relu_tail(*tensors, *family)
        grads = elbo_ops.triton_relu_tail_backward(*tensors, *[r.to(dtype) for r in rows], *family)
        want_grads = [reference[0].grad, reference[1].grad] + [reference[2 + i].grad for i in range(3)]
        got_grads = [grads[0], grads[1]] + [grads[2][i] for i in range(3)]
        positive = variance > 0
        out[f"tail_{family[0]}_{family[1]}"] = {
            "values": max(scaled(a, b.detach()) for a, b in zip(got, want)) / TOLERANCE[dtype],
            "grads": max(
                scaled(got_grads[0], want_grads[0]),
                scaled(got_grads[1][positive], want_grads[1][positive]),
                *(scaled(a, b) for a, b in zip(got_grads[2:], want_grads[2:])),
            )
            / TOLERANCE[dtype],
        }
    return out


def errors() -> dict:
    return {str(dtype): {**elementwise_errors(dtype), **tail_errors(dtype)} for dtype in (torch.float32, torch.float64)}


CHECK = """
import json, sys
sys.path.insert(0, {here!r})
from test_triton_float32 import errors
print("RESULT", json.dumps(errors()))
"""


def _interpreted(code: str):
    """``python -c code`` started under Triton's interpreter; ``_finished`` waits for it."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finished(process):
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def interpreted():
    """Both interpreter checks of this module (``extremes``, ``opcheck``), started at once."""
    opcheck = OPCHECK.replace("{tests!r}", repr(str(HERE.parent)))
    return {"extremes": _interpreted(CHECK.format(here=str(HERE))), "opcheck": _interpreted(opcheck)}


def test_float32_kernels_match_float64_references_on_extremes(interpreted):
    result = _finished(interpreted["extremes"])
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    for dtype, kernels in out.items():
        for name, measured in kernels.items():
            for what, error in measured.items():
                assert error <= 1.0, (dtype, name, what, error, out)  # (NaN fails too)


def test_kernels_compute_in_the_inputs_dtype():
    """The depth handed to the kernels tells float32 from float64 (the launchers pass
    ``cf_depth(dtype)``), and the two depths differ."""
    from cfbnn_cli.moments import triton_kernels

    assert triton_kernels.cf_depth(torch.float32) == triton_kernels.F32_DEPTH.value
    assert triton_kernels.cf_depth(torch.float64) == triton_kernels.CF_DEPTH != triton_kernels.F32_DEPTH.value


OPCHECK = """
import json, torch
import sys
sys.path.insert(0, {tests!r})
import cfbnn_cli.moments  # noqa: F401 (declares the operators)
from cuda_twin import cuda_twin

g = torch.Generator().manual_seed(0)
mean = torch.randn(3, 70, generator=g) * 4
std = torch.rand(3, 70, generator=g) + 0.05
weights = [torch.randn(70, generator=g), torch.rand(70, generator=g), torch.rand(70, generator=g)]
cfbnn = torch.ops.cfbnn
cases = [
    (cfbnn.relu_family_moments.default, (mean, std, 0, 0.0, False)),
    (cfbnn.relu_family_moments.default, (mean, std.square(), 0, 0.0, True)),
    (cfbnn.relu_mean.default, (mean, std)),
    (cfbnn.relu_family_moments.default, (mean, std, 1, 0.125, False)),
    (cfbnn.relu_family_moments.default, (mean, std, 2, 0.0, False)),
]
phi, rows = mean.clamp_min(0.0) + std, [torch.randn(3, generator=g), torch.randn(3, generator=g)]
grads = [torch.randn(3, 70, generator=g) for _ in range(3)]
cases += [
    (cfbnn.relu_family_moments_backward.default, (mean, std, phi, *grads, 0, 0.0, False)),
    (cfbnn.relu_family_moments_backward.default, (mean, std.square(), phi, *grads, 0, 0.0, True)),
    (cfbnn.relu_family_moments_backward.default, (mean, std, phi, *grads, 1, -0.5, False)),
    (cfbnn.relu_family_moments_backward.default, (mean, std, phi, *grads, 2, 0.0, False)),
]
for a, s in ((0, 0.0), (1, -0.5), (2, 0.0)):
    cases.append((cfbnn.relu_tail.default, (mean, std.square(), *weights, a, s)))
    cases.append((cfbnn.relu_tail_backward.default, (mean, std.square(), *weights, *rows, a, s)))
with cuda_twin() as calls:
    for operator, arguments in cases:
        torch.library.opcheck(operator, arguments)
print("RESULT", json.dumps(dict(calls)))
"""


def test_opcheck_float32_under_the_twin(interpreted):
    """``torch.library.opcheck`` of the affected operators for float32 inputs, their CUDA kernels
    (the float32 Triton kernels, interpreted) standing in for the CPU's (tests/cuda_twin.py)."""
    result = _finished(interpreted["opcheck"])
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    calls = json.loads(line[len("RESULT ") :])
    names = ["relu_family_moments", "relu_family_moments_backward", "relu_mean", "relu_tail", "relu_tail_backward"]
    assert all(calls.get(name, 0) > 0 for name in names), calls
