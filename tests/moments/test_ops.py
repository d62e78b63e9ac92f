"""The ``cfbnn::`` torch operators: opcheck, values against quadrature (the independent
reference) on CPU and on the Triton kernels, gradients, torch.func, torch.compile.

The Triton kernels run here on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
set in a subprocess before Triton is imported), against the same quadrature references and
tolerances as the CPU kernels; on a machine with CUDA they run compiled as well."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import activation_reference

from cfbnn_cli.moments import get_activation, ops

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# (mean, std): the grid of test_moments_quadrature.py (t = mean/std from -40 to 40, std from
# 1.2e-4 to 1e3), plus std = 0 on either side of the kink and at it
T_GRID = [-40.0, -20.0, -8.0, -3.0, -1.0, -0.25, 0.0, 0.25, 1.0, 3.0, 8.0, 20.0, 40.0]
STD_GRID = [2.0**-13, 1.0, 2.0**10]
POINTS = [(float(np.float32(t * s)), s) for s in STD_GRID for t in T_GRID] + [(2.0, 0.0), (-2.0, 0.0), (0.0, 0.0)]
# the tolerances of test_moments_quadrature.py, relative to E|g| (Phi), Upsilon and Var; a value
# whose true size is below the dtype's normal range need only be tiny
TOLERANCE = {torch.float64: (1e-10, 1e-300), torch.float32: (1e-5, float(torch.finfo(torch.float32).tiny))}


def _quadrature(points):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quad's roundoff notes at the extreme points
        return [activation_reference("relu", m, s) for m, s in points]


def worst_error(values, references, points, dtype) -> float:
    """The largest error of ``(phi, ups, var)`` against quadrature, in units of the tolerance's
    scale (as test_moments_quadrature._check); ``inf`` for a result that should underflow but
    does not."""
    tolerance, underflow = TOLERANCE[dtype]
    worst = 0.0
    for index, ((_mean, std), (phi_ref, var_ref, ups_ref, abs_ref)) in enumerate(zip(points, references)):
        floor = underflow * max(1.0, std * std)
        for value, reference, scale in (
            (values[0], phi_ref, abs_ref),
            (values[1], ups_ref, ups_ref),
            (values[2], var_ref, var_ref),
        ):
            got = float(value[index])
            if scale < floor:
                worst = max(worst, 0.0 if abs(got) <= 1e3 * floor else math.inf)
            else:
                worst = max(worst, abs(got - reference) / scale / tolerance)
    return worst


@pytest.fixture(scope="module")
def quadrature():
    return _quadrature(POINTS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_operator_matches_quadrature(quadrature, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    values = torch.ops.cfbnn.relu_moments(mean, std)
    assert all(v.dtype == dtype for v in values)
    assert worst_error(values, quadrature, POINTS, dtype) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    std = (torch.rand(40, 7, generator=g, dtype=dtype) * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_moments.default, (mean, std))
    phi = torch.ops.cfbnn.relu_moments(mean.detach(), std.detach())[0]
    grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
    torch.library.opcheck(torch.ops.cfbnn.relu_moments_backward.default, (mean.detach(), std.detach(), phi, *grads))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_from_variance_operator_matches_quadrature(quadrature, dtype):
    """cfbnn::relu_moments_from_variance on the variances std^2 of the same grid, against the same
    quadrature and tolerances; a variance of 0 is floored at the dtype's smallest normal number,
    so there the moments are those at std = sqrt(floor) (what keeps the gradient finite)."""
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    variance = torch.tensor([p[1] for p in POINTS], dtype=torch.float64).square().to(dtype)
    values = torch.ops.cfbnn.relu_moments_from_variance(mean, variance)
    assert all(v.dtype == dtype for v in values)
    positive = [i for i, p in enumerate(POINTS) if p[1] > 0]
    assert (
        worst_error(
            [v[positive] for v in values], [quadrature[i] for i in positive], [POINTS[i] for i in positive], dtype
        )
        <= 1.0
    )
    zero = [i for i, p in enumerate(POINTS) if p[1] == 0]
    floored = torch.full((len(zero),), torch.finfo(dtype).tiny, dtype=dtype).sqrt()
    for got, want in zip(values, torch.ops.cfbnn.relu_moments(mean[zero], floored)):
        torch.testing.assert_close(got[zero], want, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu_from_variance(dtype):
    g = torch.Generator().manual_seed(4)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    variance = (torch.rand(40, 7, generator=g, dtype=dtype) * 3 + 0.01).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_moments_from_variance.default, (mean, variance))
    grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
    torch.library.opcheck(
        torch.ops.cfbnn.relu_moments_from_variance_backward.default, (mean.detach(), variance.detach(), *grads)
    )


def test_from_variance_gradients_match_finite_differences_and_the_std_operator():
    g = torch.Generator().manual_seed(5)
    mean = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    variance = (torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    assert torch.autograd.gradcheck(torch.ops.cfbnn.relu_moments_from_variance, (mean, variance))
    assert torch.autograd.gradgradcheck(torch.ops.cfbnn.relu_moments_from_variance, (mean, variance))
    # the same values as relu_moments at std = sqrt(variance)
    for got, want in zip(
        torch.ops.cfbnn.relu_moments_from_variance(mean, variance), torch.ops.cfbnn.relu_moments(mean, variance.sqrt())
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)  # (sqrt taken in or out of the kernel)


def _kl_reference(loc, log_scale, prior_variance):
    """The independent reference: torch.distributions' Normal KL, summed over the matrix (float64)."""
    q = torch.distributions.Normal(loc.double(), log_scale.double().exp())
    p = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), math.sqrt(prior_variance))
    return torch.distributions.kl_divergence(q, p).sum()


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(3, 5), (200, 301)])  # shorter and longer than a kernel block
def test_cpu_diagonal_kl_matches_torch_distributions(dtype, rtol, shape):
    g = torch.Generator().manual_seed(7)
    loc = (torch.randn(*shape, generator=g, dtype=dtype) * 2).requires_grad_()
    log_scale = (torch.randn(*shape, generator=g, dtype=dtype) - 2).requires_grad_()
    kl = torch.ops.cfbnn.diagonal_kl(loc, log_scale, 0.7)
    assert kl.dtype == dtype and kl.shape == ()
    reference = _kl_reference(loc, log_scale, 0.7)
    torch.testing.assert_close(kl.double(), reference, rtol=rtol, atol=0.0)
    got = torch.autograd.grad(kl, (loc, log_scale))
    want = torch.autograd.grad(reference, (loc, log_scale))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(dtype), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu_diagonal_kl(dtype):
    g = torch.Generator().manual_seed(8)
    loc = torch.randn(40, 7, generator=g, dtype=dtype).requires_grad_()
    log_scale = (torch.randn(40, 7, generator=g, dtype=dtype) - 1).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.diagonal_kl.default, (loc, log_scale, 0.5))
    grad = torch.tensor(1.3, dtype=dtype)
    torch.library.opcheck(torch.ops.cfbnn.diagonal_kl_backward.default, (loc.detach(), log_scale.detach(), grad, 0.5))
    assert torch.autograd.gradcheck(
        lambda a, b: torch.ops.cfbnn.diagonal_kl(a, b, 0.5),
        (loc.double().detach().requires_grad_(), log_scale.double().detach().requires_grad_()),
    )
    # vmap: one KL per batch entry
    batched = torch.func.vmap(lambda a, b: torch.ops.cfbnn.diagonal_kl(a, b, 0.5))(loc.detach(), log_scale.detach())
    looped = torch.stack([_kl_reference(loc[i], log_scale[i], 0.5) for i in range(40)])
    torch.testing.assert_close(batched.double(), looped, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0.0)


def test_bad_kl_inputs_name_the_problem():
    with pytest.raises(ValueError, match="prior_variance"):
        torch.ops.cfbnn.diagonal_kl(torch.zeros(3), torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match="shape"):
        torch.ops.cfbnn.diagonal_kl(torch.zeros(3), torch.zeros(4), 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cuda(dtype):
    mean = (torch.randn(300, 9, dtype=dtype, device="cuda") * 4).requires_grad_()
    std = (torch.rand(300, 9, dtype=dtype, device="cuda") * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_moments.default, (mean, std))


def test_gradients_match_finite_differences_and_double_backward():
    g = torch.Generator().manual_seed(1)
    mean = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    std = (torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    assert torch.autograd.gradcheck(torch.ops.cfbnn.relu_moments, (mean, std))
    assert torch.autograd.gradgradcheck(torch.ops.cfbnn.relu_moments, (mean, std))
    assert torch.autograd.gradcheck(ops.relu_moments_function, (mean, std))


def test_torch_func_grad_and_vmap_through_the_function():
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(4, 10, generator=g, dtype=torch.float64)
    std = torch.rand(4, 10, generator=g, dtype=torch.float64) + 0.1

    def total(m, s):
        phi, ups, var = ops.relu_moments_function(m, s)
        return (phi + 0.5 * ups - var).sum()

    batched = torch.func.vmap(torch.func.grad(total, argnums=(0, 1)))(mean, std)
    looped = [torch.func.grad(total, argnums=(0, 1))(mean[i], std[i]) for i in range(4)]
    for got, want in zip(batched, zip(*looped)):
        torch.testing.assert_close(got, torch.stack(want))
    # and the same numbers as the reference path's autograd
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    phi, ups, var = get_activation("relu")._reference_moments(m, s)
    (phi + 0.5 * ups - var).sum().backward()
    torch.testing.assert_close(batched[0], m.grad)
    torch.testing.assert_close(batched[1], s.grad)


def test_operators_compile_without_graph_breaks():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(m, s):
        phi, ups, _ = torch.ops.cfbnn.relu_moments(m, s)
        return (phi * ups).sum()

    m = torch.randn(30, requires_grad=True)
    s = torch.rand(30) + 0.1
    f(m, s).backward()
    expected_m = m.detach().clone().requires_grad_()
    phi, ups, _ = get_activation("relu")._reference_moments(expected_m, s)
    (phi * ups).sum().backward()
    torch.testing.assert_close(m.grad, expected_m.grad)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="shape"):
        torch.ops.cfbnn.relu_moments(torch.zeros(3), torch.ones(4))
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.cfbnn.relu_moments(torch.zeros(3, dtype=torch.float64), torch.ones(3))


# ----------------------------------------------------------------------------- Triton, interpreted

TRITON_CHECK = """
    import json, sys, torch
    sys.path.insert(0, {here!r})
    from test_ops import POINTS, _quadrature, worst_error
    from cfbnn_cli.moments import ops
    from cfbnn_cli.moments.relu_reference import ReLUMomentsReference
    references = _quadrature(POINTS)
    out = {{}}
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
        std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
        phi, ups, var = ops.triton_relu_moments(mean, std)
        assert phi.dtype == dtype
        # the backward against the reference path's analytic backward (float64 oracle)
        g = torch.Generator().manual_seed(3)
        grads = [torch.randn(len(POINTS), generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
        m64, s64 = mean.double().requires_grad_(), std.double().requires_grad_()
        rphi, rups, rvar, *_ = ReLUMomentsReference.apply(m64, s64)
        torch.autograd.backward([rphi, rups, rvar], [t.double() for t in grads])
        gm, gs = ops.triton_relu_moments_backward(mean, std, phi, *grads)
        scale = lambda t: t.abs().clamp_min(1.0)
        grad_error = max(
            float(((gm.double() - m64.grad).abs() / scale(m64.grad)).max()),
            float(((gs.double() - s64.grad).abs() / scale(s64.grad)).max()),
        )
        out[name] = {{"values": worst_error((phi, ups, var), references, POINTS, dtype), "grads": grad_error}}
        # from the variances: the same references; the gradients where std > 0 (at 0 sqrt has none)
        mean, std = mean.detach(), std.detach()
        variance = std.double().square().to(dtype)
        values = ops.triton_relu_moments_from_variance(mean, variance)
        positive = std > 0
        v64 = variance.double().clone().requires_grad_()  # fresh leaves (not the tensors above)
        m64 = mean.double().clone().requires_grad_()
        rphi, rups, rvar, *_ = ReLUMomentsReference.apply(m64, v64.sqrt())
        torch.autograd.backward([rphi, rups, rvar], [t.double() for t in grads])
        gm, gv = ops.triton_relu_moments_from_variance_backward(mean, variance, *grads)
        grad_error = max(
            float(((gm.double() - m64.grad).abs() / scale(m64.grad))[positive].max()),
            float(((gv.double() - v64.grad).abs() / scale(v64.grad))[positive].max()),
        )
        keep = [i for i, p in enumerate(POINTS) if p[1] > 0]  # (a variance of 0 is floored)
        out[name + "_from_variance"] = {{
            "values": worst_error(
                [v[keep] for v in values], [references[i] for i in keep], [POINTS[i] for i in keep], dtype
            ),
            "grads": grad_error,
        }}
        # the KL of a mean-field matrix (3 x 1500: two blocks, the last one partial)
        loc = torch.randn(3, 1500, generator=g, dtype=torch.float64).to(dtype)
        log_scale = (torch.randn(3, 1500, generator=g, dtype=torch.float64) - 2).to(dtype)
        l64, s64 = loc.double().clone().requires_grad_(), log_scale.double().clone().requires_grad_()
        q = torch.distributions.Normal(l64, s64.exp())
        p = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), 0.8 ** 0.5)
        reference = torch.distributions.kl_divergence(q, p).sum()
        reference.backward()
        kl = ops.triton_diagonal_kl(loc, log_scale, 0.8)
        grad = torch.tensor(1.0, dtype=dtype)
        gl, gs = ops.triton_diagonal_kl_backward(loc, log_scale, grad, 0.8)
        out[name + "_kl"] = {{
            "value": abs(float(kl) - float(reference)) / abs(float(reference)),
            "grads": max(
                float(((gl.double() - l64.grad).abs() / l64.grad.abs().clamp_min(1.0)).max()),
                float(((gs.double() - s64.grad).abs() / s64.grad.abs().clamp_min(1.0)).max()),
            ),
        }}
    print("RESULT", json.dumps(out))
"""


def test_triton_kernels_match_quadrature_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = textwrap.dedent(TRITON_CHECK.format(here=str(HERE)))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    errors = json.loads(line[len("RESULT ") :])
    # the tolerances of the CPU kernels (test_cpu_operator_matches_quadrature)
    assert errors["float64"]["values"] <= 1.0, errors
    assert errors["float32"]["values"] <= 1.0, errors
    assert errors["float64"]["grads"] < 1e-10, errors
    assert errors["float32"]["grads"] < 1e-5, errors
    assert errors["float64_from_variance"]["values"] <= 1.0, errors
    assert errors["float32_from_variance"]["values"] <= 1.0, errors
    assert errors["float64_from_variance"]["grads"] < 1e-10, errors
    assert errors["float32_from_variance"]["grads"] < 1e-5, errors
    assert errors["float64_kl"]["value"] < 1e-12 and errors["float64_kl"]["grads"] < 1e-12, errors
    assert errors["float32_kl"]["value"] < 1e-5 and errors["float32_kl"]["grads"] < 1e-5, errors
    assert all(math.isfinite(v) for d in errors.values() for v in d.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_operator_matches_quadrature(quadrature, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype, device="cuda")
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype, device="cuda")
    values = [v.cpu() for v in torch.ops.cfbnn.relu_moments(mean, std)]
    assert worst_error(values, quadrature, POINTS, dtype) <= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_from_variance_operator_matches_the_cpu_kernels(dtype):
    g = torch.Generator().manual_seed(6)
    mean = torch.randn(500, 200, generator=g, dtype=dtype) * 4
    variance = torch.rand(500, 200, generator=g, dtype=dtype) * 3
    grads = [torch.randn(500, 200, generator=g, dtype=dtype) for _ in range(3)]
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in zip(
        torch.ops.cfbnn.relu_moments_from_variance(mean.cuda(), variance.cuda()),
        torch.ops.cfbnn.relu_moments_from_variance(mean, variance),
    ):
        torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=1e-30)
    for got, want in zip(
        torch.ops.cfbnn.relu_moments_from_variance_backward(mean.cuda(), variance.cuda(), *[t.cuda() for t in grads]),
        torch.ops.cfbnn.relu_moments_from_variance_backward(mean, variance, *grads),
    ):
        torch.testing.assert_close(got.cpu(), want, rtol=100 * rtol, atol=1e-30)
    m = mean[:50].cuda().requires_grad_()
    v = (variance[:50] + 0.01).cuda().requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_moments_from_variance.default, (m, v))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cuda_diagonal_kl_matches_the_cpu_kernels(dtype, rtol):
    g = torch.Generator().manual_seed(9)
    loc = torch.randn(1000, 2049, generator=g, dtype=dtype)
    log_scale = torch.randn(1000, 2049, generator=g, dtype=dtype) - 2
    torch.testing.assert_close(
        torch.ops.cfbnn.diagonal_kl(loc.cuda(), log_scale.cuda(), 0.5).cpu(),
        torch.ops.cfbnn.diagonal_kl(loc, log_scale, 0.5),
        rtol=rtol,
        atol=0.0,
    )
    grad = torch.tensor(0.7, dtype=dtype)
    for got, want in zip(
        torch.ops.cfbnn.diagonal_kl_backward(loc.cuda(), log_scale.cuda(), grad.cuda(), 0.5),
        torch.ops.cfbnn.diagonal_kl_backward(loc, log_scale, grad, 0.5),
    ):
        torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=rtol)
    small = [t[:40, :7].cuda().requires_grad_() for t in (loc, log_scale)]
    torch.library.opcheck(torch.ops.cfbnn.diagonal_kl.default, (*small, 0.5))
