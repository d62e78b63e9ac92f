"""The ``cfbnn::`` torch operators: opcheck, values against quadrature (the independent
reference) on CPU and on the Triton kernels, gradients, torch.func, torch.compile.

The Triton kernels run here on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
set in a subprocess before Triton is imported), against the same quadrature references and
tolerances as the CPU kernels; on a machine with CUDA they run compiled as well."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from relu_grid import POINTS, _quadrature, worst_error
from triton_check import assert_within_tolerances, triton_errors

from cfbnn_cli.moments import get_activation, moment_ops

REPO = Path(__file__).resolve().parents[2]


def relu_moments_function(mean, std):
    """ReLU's moments through the family operator, broadcast first (its autograd serves torch.func too)."""
    return torch.ops.cfbnn.relu_family_moments(*torch.broadcast_tensors(mean, std), 0, 0.0, False)


HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def quadrature():
    return _quadrature(POINTS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_operator_matches_quadrature(quadrature, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    values = torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)
    assert all(v.dtype == dtype for v in values)
    assert worst_error(values, quadrature, POINTS, dtype) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    std = (torch.rand(40, 7, generator=g, dtype=dtype) * 2).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, std, 0, 0.0, False))
    phi = torch.ops.cfbnn.relu_family_moments(mean.detach(), std.detach(), 0, 0.0, False)[0]
    grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
    torch.library.opcheck(
        torch.ops.cfbnn.relu_family_moments_backward.default, (mean.detach(), std.detach(), phi, *grads, 0, 0.0, False)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_from_variance_operator_matches_quadrature(quadrature, dtype):
    """cfbnn::relu_family_moments from_variance (ReLU) on the variances std^2 of the same grid, against the same
    quadrature and tolerances; a variance of 0 is floored at the dtype's smallest normal number,
    so there the moments are those at std = sqrt(floor) (what keeps the gradient finite)."""
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    variance = torch.tensor([p[1] for p in POINTS], dtype=torch.float64).square().to(dtype)
    values = torch.ops.cfbnn.relu_family_moments(mean, variance, 0, 0.0, True)
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
    for got, want in zip(values, torch.ops.cfbnn.relu_family_moments(mean[zero], floored, 0, 0.0, False)):
        torch.testing.assert_close(got[zero], want, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu_from_variance(dtype):
    g = torch.Generator().manual_seed(4)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).requires_grad_()
    variance = (torch.rand(40, 7, generator=g, dtype=dtype) * 3 + 0.01).requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, variance, 0, 0.0, True))
    grads = [torch.randn(40, 7, generator=g, dtype=dtype) for _ in range(3)]
    torch.library.opcheck(
        torch.ops.cfbnn.relu_family_moments_backward.default,
        (
            mean.detach(),
            variance.detach(),
            torch.ops.cfbnn.relu_family_moments(mean, variance, 0, 0.0, True)[0].detach(),
            *grads,
            0,
            0.0,
            True,
        ),
    )


def test_from_variance_gradients_match_finite_differences_and_the_std_operator():
    g = torch.Generator().manual_seed(5)
    mean = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    variance = (torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda m, v: torch.ops.cfbnn.relu_family_moments(m, v, 0, 0.0, True), (mean, variance)
    )
    assert torch.autograd.gradgradcheck(
        lambda m, v: torch.ops.cfbnn.relu_family_moments(m, v, 0, 0.0, True), (mean, variance)
    )
    # the same values as from the standard deviations std = sqrt(variance)
    for got, want in zip(
        torch.ops.cfbnn.relu_family_moments(mean, variance, 0, 0.0, True),
        torch.ops.cfbnn.relu_family_moments(mean, variance.sqrt(), 0, 0.0, False),
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
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, std, 0, 0.0, False))


def test_gradients_match_finite_differences_and_double_backward():
    g = torch.Generator().manual_seed(1)
    mean = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    std = (torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    assert torch.autograd.gradcheck(lambda m, s: torch.ops.cfbnn.relu_family_moments(m, s, 0, 0.0, False), (mean, std))
    assert torch.autograd.gradgradcheck(
        lambda m, s: torch.ops.cfbnn.relu_family_moments(m, s, 0, 0.0, False), (mean, std)
    )
    assert torch.autograd.gradcheck(relu_moments_function, (mean, std))
    # its backward under create_graph is the backward operator, differentiable again through its formula
    assert torch.autograd.gradgradcheck(relu_moments_function, (mean, std))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_operator_reads_broadcast_gradients_as_their_dense_copies(dtype):
    """``cfbnn::relu_family_moments_backward`` takes a gradient expanded from one value (what ``sum()``'s
    backward hands over; an expanded zero for an unused output) without materializing it: the
    result must be bit for bit what the dense copies give, 0 and -0 and a non-zero value alike, on
    a length that leaves a partial kernel block."""
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(37, 29, generator=g, dtype=dtype) * 3
    std = torch.rand(37, 29, generator=g, dtype=dtype) + 0.05
    phi = torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)[0]
    dense = torch.randn(37, 29, generator=g, dtype=dtype)
    for value in (0.0, -0.0, 1.5):
        broadcast = torch.tensor(value, dtype=dtype).expand(mean.shape)
        for grads in ((broadcast, broadcast, broadcast), (dense, broadcast, broadcast), (broadcast, dense, dense)):
            got = torch.ops.cfbnn.relu_family_moments_backward(mean, std, phi, *grads, 0, 0.0, False)
            want = torch.ops.cfbnn.relu_family_moments_backward(
                mean, std, phi, *(t.contiguous() for t in grads), 0, 0.0, False
            )
            for a, b in zip(got, want):
                assert torch.equal(a, b), (value, [t.stride() for t in grads])


def test_unused_outputs_take_no_gradient_and_match_the_reference():
    """Only Phi used (Upsilon and Var left out of the loss), through the operator's own autograd and
    through the torch.func-ready function: the gradients of the reference path's autograd."""
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(50, 8, generator=g, dtype=torch.float64) * 2
    std = torch.rand(50, 8, generator=g, dtype=torch.float64) + 0.1
    m0, s0 = mean.clone().requires_grad_(), std.clone().requires_grad_()
    get_activation("relu").reference_moments(m0, s0)[0].sum().backward()
    for function in (lambda m, s: torch.ops.cfbnn.relu_family_moments(m, s, 0, 0.0, False), relu_moments_function):
        m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
        function(m, s)[0].sum().backward()
        torch.testing.assert_close(m.grad, m0.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(s.grad, s0.grad, rtol=1e-12, atol=1e-14)


def _from_variance(activation, slope):
    """The reference path's moments of the member from the variances (autograd through the root)."""
    return lambda m, v: get_activation(*activation, **slope).reference_moments(m, v.sqrt())


MOMENTS_OPERATORS = {  # the operator's (activation, negative_slope, from_variance), the reference path's moments
    "relu": ((0, 0.0, False), get_activation("relu").reference_moments),
    "leaky_relu": ((1, 0.1, False), get_activation("leaky_relu", negative_slope=0.1).reference_moments),
    "relu_squared": ((2, 0.0, False), get_activation("relu_squared").reference_moments),
    "relu_from_variance": ((0, 0.0, True), _from_variance(("relu",), {})),
    "leaky_relu_from_variance": ((1, -0.3, True), _from_variance(("leaky_relu",), {"negative_slope": -0.3})),
    "relu_squared_from_variance": ((2, 0.0, True), _from_variance(("relu_squared",), {})),
}


@pytest.mark.parametrize("name", sorted(MOMENTS_OPERATORS))
def test_the_operators_autograd_is_one_node_with_the_reference_gradients(name):
    """The family operator's autograd, for each member and either spread (the C++ kernels on the
    CPU): one node (operators.OperatorAutograd), whose gradients -- every output used or one, far
    tails included -- and second derivatives (create_graph through the backward operator's own
    derivative) are those of the reference formula differentiated by autograd, float64."""
    operator = torch.ops.cfbnn.relu_family_moments
    extra, reference = MOMENTS_OPERATORS[name]
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(30, 6, generator=g, dtype=torch.float64) * 3
    spread = torch.rand(30, 6, generator=g, dtype=torch.float64) + 0.05
    mean[0, :3] = torch.tensor([-40.0, 40.0, 0.0], dtype=torch.float64)
    weights = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)
    for used in ((0, 1, 2), (1,), (2,)):
        results = []
        for function in (lambda m, s: operator(m, s, *extra), reference):
            m, s = mean.clone().requires_grad_(), spread.clone().requires_grad_()
            outputs = function(m, s)
            if function is not reference:
                assert "OperatorAutograd" in outputs[0].grad_fn.name()
            total = sum(((k + 1) * outputs[k] * weights).sum() for k in used)
            first = torch.autograd.grad(total, (m, s), create_graph=True)
            second = torch.autograd.grad((first[0] * first[0].detach()).sum() + first[1].sum(), (m, s))
            results.append(first + second)
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    m = mean[1:].clone().requires_grad_()
    s = spread[1:].clone().requires_grad_()
    torch.library.opcheck(operator.default, (m, s, *extra))
    assert torch.autograd.gradgradcheck(lambda m, s: operator(m, s, *extra), (m[:4], s[:4]))


def test_torch_func_grad_and_vmap_through_the_function():
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(4, 10, generator=g, dtype=torch.float64)
    std = torch.rand(4, 10, generator=g, dtype=torch.float64) + 0.1

    def total(m, s):
        phi, ups, var = relu_moments_function(m, s)
        return (phi + 0.5 * ups - var).sum()

    batched = torch.func.vmap(torch.func.grad(total, argnums=(0, 1)))(mean, std)
    looped = [torch.func.grad(total, argnums=(0, 1))(mean[i], std[i]) for i in range(4)]
    for got, want in zip(batched, zip(*looped)):
        torch.testing.assert_close(got, torch.stack(want))
    # and the same numbers as the reference path's autograd
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    phi, ups, var = get_activation("relu").reference_moments(m, s)
    (phi + 0.5 * ups - var).sum().backward()
    torch.testing.assert_close(batched[0], m.grad)
    torch.testing.assert_close(batched[1], s.grad)


def test_operators_compile_without_graph_breaks():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(m, s):
        phi, ups, _ = torch.ops.cfbnn.relu_family_moments(m, s, 0, 0.0, False)
        return (phi * ups).sum()

    m = torch.randn(30, requires_grad=True)
    s = torch.rand(30) + 0.1
    f(m, s).backward()
    expected_m = m.detach().clone().requires_grad_()
    phi, ups, _ = get_activation("relu").reference_moments(expected_m, s)
    (phi * ups).sum().backward()
    torch.testing.assert_close(m.grad, expected_m.grad)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="shape"):
        torch.ops.cfbnn.relu_family_moments(torch.zeros(3), torch.ones(4), 0, 0.0, False)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.cfbnn.relu_family_moments(torch.zeros(3, dtype=torch.float64), torch.ones(3), 0, 0.0, False)


# ----------------------------------------------------------------------------- Triton, interpreted

TRITON_CHECK = """
import json, sys
sys.path.insert(0, {here!r})
from triton_check import triton_errors
print("RESULT", json.dumps(triton_errors("cpu", sys.argv[1:])))
"""


def test_triton_kernels_match_quadrature_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = TRITON_CHECK.format(here=str(HERE))
    # each dtype's checks in a process of its own, both started at once
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, dtype], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for dtype in ("float64", "float32")
    ]
    errors = {}
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
        errors.update(json.loads(line[len("RESULT ") :]))
    assert_within_tolerances(errors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_kernels_match_the_same_references():
    """The compiled kernels against the interpreter test's references and tolerances."""
    assert_within_tolerances(triton_errors("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_operator_matches_quadrature(quadrature, dtype):
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype, device="cuda")
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype, device="cuda")
    values = [v.cpu() for v in torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)]
    assert worst_error(values, quadrature, POINTS, dtype) <= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cuda_from_variance(dtype):
    g = torch.Generator().manual_seed(6)
    mean = (torch.randn(40, 7, generator=g, dtype=dtype) * 4).cuda().requires_grad_()
    variance = (torch.rand(40, 7, generator=g, dtype=dtype) * 3 + 0.01).cuda().requires_grad_()
    torch.library.opcheck(torch.ops.cfbnn.relu_family_moments.default, (mean, variance, 0, 0.0, True))
    grads = [torch.randn(40, 7, generator=g, dtype=dtype).cuda() for _ in range(3)]
    torch.library.opcheck(
        torch.ops.cfbnn.relu_family_moments_backward.default,
        (
            mean.detach(),
            variance.detach(),
            torch.ops.cfbnn.relu_family_moments(mean, variance, 0, 0.0, True)[0].detach(),
            *grads,
            0,
            0.0,
            True,
        ),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cuda_diagonal_kl_matches_the_cpu_kernels(dtype, rtol):
    g = torch.Generator().manual_seed(9)
    loc = torch.randn(1000, 2049, generator=g, dtype=dtype)
    log_scale = torch.randn(1000, 2049, generator=g, dtype=dtype) - 2
    torch.testing.assert_close(
        torch.ops.cfbnn.diagonal_kl(loc.cuda(), log_scale.cuda(), 0.8).cpu(),
        torch.ops.cfbnn.diagonal_kl(loc, log_scale, 0.8),
        rtol=rtol,
        atol=0.0,
    )
    grad = torch.tensor(0.7, dtype=dtype)
    for got, want in zip(
        torch.ops.cfbnn.diagonal_kl_backward(loc.cuda(), log_scale.cuda(), grad.cuda(), 0.8),
        torch.ops.cfbnn.diagonal_kl_backward(loc, log_scale, grad, 0.8),
    ):
        torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=rtol)
    small = [t[:40, :7].cuda().requires_grad_() for t in (loc, log_scale)]
    torch.library.opcheck(torch.ops.cfbnn.diagonal_kl.default, (*small, 0.5))


@pytest.mark.parametrize("activation", [3, -1])
def test_an_unknown_member_is_refused_by_every_kernel(activation):
    """An ``activation`` outside the family is a ValueError naming the operator and the members, from
    the C++ kernel, the reference kernel and the Triton launch alike (checked before any launch)."""
    from cfbnn_cli.moments.relu_family import reference_family_moments

    mean, std = torch.zeros(4), torch.ones(4)
    message = (
        rf"relu_family_moments.*`activation` must be one of the ReLU family's members 0 \.\. 2 .*; got {activation}"
    )
    calls = [
        lambda: torch.ops.cfbnn.relu_family_moments(mean, std, activation, 0.0, False),
        lambda: torch.ops.cfbnn.relu_family_moments_backward(mean, std, mean, mean, mean, mean, activation, 0.0, True),
        lambda: reference_family_moments(mean, std, activation, 0.0, False),
        lambda: moment_ops.triton_family_moments(mean, std, activation, 0.0, False),
        lambda: moment_ops.triton_family_moments_backward(mean, std, mean, mean, mean, mean, activation, 0.0, False),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
