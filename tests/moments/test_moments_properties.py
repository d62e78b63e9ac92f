"""Limits, std -> 0, dtype/device/broadcasting, gradients and bad input."""

import math

import pytest
import torch
from conftest import requires_cuda
from torch.autograd import gradcheck, gradgradcheck

from cfbnn_cli.moments import (
    abs_moment,
    get_activation,
    piecewise_polynomial,
    positive_part_moments,
)

NAMED = [
    ("relu", {}),
    ("leaky_relu", {"negative_slope": 0.2}),
    ("relu_squared", {}),
    ("identity", {}),
    ("hard_sigmoid", {"alpha": 0.7}),
]


def user_piecewise():
    # discontinuous, cubic piece, constant tails
    return piecewise_polynomial([-1.0, 0.5, 2.0], [[1.0], [0.0, -1.0, 0.5], [2.0, 0.0, 0.0, 1.0], [-3.0]])


ALL = [get_activation(n, **p) for n, p in NAMED] + [user_piecewise()]


@pytest.mark.parametrize("activation", ALL, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_std_zero_is_deterministic(activation, dtype):
    mean = torch.tensor([-3.0, -1.0, -0.2, 0.0, 0.3, 1.0, 2.5, 7.0], dtype=dtype)
    phi, ups, var = activation.moments(mean, torch.zeros_like(mean), return_variance=True)
    expected = activation(mean)
    assert torch.equal(phi, expected)
    torch.testing.assert_close(ups, expected * expected, rtol=0, atol=0)
    assert torch.equal(var, torch.zeros_like(var))


@pytest.mark.parametrize("name,params", NAMED[:3], ids=str)
def test_std_to_zero_limit_is_continuous(name, params):
    activation = get_activation(name, **params)
    mean = torch.tensor([-2.0, -0.5, 0.5, 2.0], dtype=torch.float64)
    for std in [1e-3, 1e-6, 1e-9]:
        phi, ups = activation.moments(mean, torch.full_like(mean, std))
        torch.testing.assert_close(phi, activation(mean), rtol=0, atol=10 * std)
        torch.testing.assert_close(ups, activation(mean) ** 2, rtol=0, atol=50 * std)


def test_large_ratio_limits():
    """gamma/xi -> +inf: Phi -> gamma, Upsilon -> gamma^2 + xi^2; -> -inf: both -> 0 (paper)."""
    relu = get_activation("relu")
    std = torch.tensor(1.0, dtype=torch.float64)
    for t in [50.0, 1e3, 1e6]:
        phi, ups = relu.moments(torch.tensor(t, dtype=torch.float64), std)
        assert phi.item() == pytest.approx(t, rel=1e-15)
        assert ups.item() == pytest.approx(t * t + 1, rel=1e-15)
        phi, ups = relu.moments(torch.tensor(-t, dtype=torch.float64), std)
        assert phi.item() == 0.0 and ups.item() == 0.0
    hard = get_activation("hard_sigmoid", alpha=1.0)
    # alpha -> infinity: identity
    big = get_activation("hard_sigmoid", alpha=1e6)
    phi, ups, var = big.moments(torch.tensor(0.3, dtype=torch.float64), std, return_variance=True)
    assert phi.item() == pytest.approx(0.3, rel=1e-14) and var.item() == pytest.approx(1.0, rel=1e-12)
    # alpha -> 0: alpha * sign(z); Var -> alpha^2 (1 - (2 Phi_N(t) - 1)^2)
    small = get_activation("hard_sigmoid", alpha=1e-6)
    phi, ups, var = small.moments(torch.tensor(0.3, dtype=torch.float64), std, return_variance=True)
    p = 0.5 * (1 + math.erf(0.3 / math.sqrt(2)))
    assert phi.item() == pytest.approx(1e-6 * (2 * p - 1), rel=1e-5)
    assert var.item() == pytest.approx(1e-12 * (1 - (2 * p - 1) ** 2), rel=1e-5)
    del hard


@pytest.mark.parametrize("activation", ALL, ids=repr)
def test_float32_extremes_are_finite_with_finite_gradients(activation):
    means = [-1e6, -1e3, -40.0, -1.0, 0.0, 1.0, 40.0, 1e3, 1e6]
    stds = [0.0, 1e-30, 1e-4, 1.0, 1e3]
    mean = torch.tensor([m for m in means for _ in stds], dtype=torch.float32, requires_grad=True)
    std = torch.tensor([s for _ in means for s in stds], dtype=torch.float32, requires_grad=True)
    phi, ups, var = activation.moments(mean, std, return_variance=True)
    for value in (phi, ups, var):
        assert torch.isfinite(value).all()
    assert (var >= 0).all() and (ups >= 0).all()
    (phi.sum() + ups.sum() + var.sum()).backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(std.grad).all()


@pytest.mark.parametrize("activation", ALL, ids=repr)
def test_gradcheck_float64(activation):
    generator = torch.Generator().manual_seed(1)
    mean = (2 * torch.randn(12, generator=generator, dtype=torch.float64)).requires_grad_()
    std = (0.1 + torch.rand(12, generator=generator, dtype=torch.float64)).requires_grad_()
    fn = lambda m, s: activation.moments(m, s, return_variance=True)
    assert gradcheck(fn, (mean, std))
    assert gradgradcheck(fn, (mean, std))


@pytest.mark.parametrize("fast", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("activation", ALL, ids=repr)
def test_gradients_at_a_zero_mean_are_the_values_central_differences(activation, fast):
    """At ``mean = 0`` exactly (a zero-initialized layer's pre-activations), where the moments are
    smooth but the reference formulas switch branch: float64 gradients of Phi, Upsilon and
    Var against central differences of the values (gradcheck), on the C++ kernels and on the
    reference kernels."""
    import contextlib

    from reference_kernels import reference_kernels

    mean = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    std = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64, requires_grad=True)
    with contextlib.nullcontext() if fast else reference_kernels():
        assert gradcheck(lambda m, s: activation.moments(m, s, return_variance=True), (mean, std))


def test_the_operators_torch_references_have_the_central_difference_gradients_at_a_zero_mean():
    """The family operator's reference function for ReLU (the fallback without a compiler and the
    double backward's formula: :func:`.relu_family.reference_family_moments`), autograd
    straight through their torch ops at ``mean = 0`` exactly, against central differences; and
    second derivatives (gradgradcheck) there."""
    from cfbnn_cli.moments.relu_family import reference_family_moments

    mean = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    spread = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64, requires_grad=True)
    for from_variance in (False, True):
        function = lambda m, s: reference_family_moments(m, s, 0, 0.0, from_variance)  # noqa: E731
        assert gradcheck(function, (mean, spread))
        assert gradgradcheck(function, (mean, spread))


def test_gradcheck_kernels():
    generator = torch.Generator().manual_seed(2)
    mean = (3 * torch.randn(10, generator=generator, dtype=torch.float64)).requires_grad_()
    std = (0.1 + torch.rand(10, generator=generator, dtype=torch.float64)).requires_grad_()
    assert gradcheck(lambda m, s: positive_part_moments(6, m, s), (mean, std))
    assert gradgradcheck(lambda m, s: positive_part_moments(3, m, s), (mean, std))
    assert gradcheck(lambda m, s: abs_moment(4, m, s), (mean, std))


def test_gradient_matches_monte_carlo():
    """d/dmean E[g] = E[g'(z)], d/dstd E[g] = E[g'(z) s] (pathwise), by Monte Carlo."""
    relu = get_activation("relu_squared")
    mean = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    std = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    relu.moments(mean, std)[0].backward()
    eps = torch.randn(1_000_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    z = 0.3 + 0.8 * eps
    g_mean = 2 * z.clamp(min=0)
    g_std = g_mean * eps
    for grad, samples in ((mean.grad, g_mean), (std.grad, g_std)):
        se = samples.std().item() / math.sqrt(samples.numel())
        assert abs(grad.item() - samples.mean().item()) <= 5 * se


def test_broadcasting_dtype_device_preserved():
    relu = get_activation("relu")
    mean = torch.zeros(3, 1, dtype=torch.float64)
    std = torch.ones(4, dtype=torch.float64)
    phi, ups = relu.moments(mean, std)
    assert phi.shape == (3, 4) and phi.dtype == torch.float64
    phi, ups = relu.moments(torch.zeros(5), 1.0)
    assert phi.dtype == torch.float32 and phi.shape == (5,)
    phi16 = relu.moments(torch.zeros(5, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16))[0]
    assert phi16.dtype == torch.bfloat16


def test_torch_func_vmap_of_grad():
    from torch.func import grad, vmap

    hard = get_activation("hard_sigmoid", alpha=0.5)
    for activation in (get_activation("relu"), hard):
        f = lambda m, s: activation.moments(m, s)[1].sum()
        mean = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
        std = torch.rand(6, 5, generator=torch.Generator().manual_seed(5)) + 0.1
        batched = vmap(grad(f, argnums=(0, 1)))(mean, std)
        m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
        f(m, s).backward()
        torch.testing.assert_close(batched[0], m.grad)
        torch.testing.assert_close(batched[1], s.grad)


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda: get_activation("relu").moments(torch.zeros(3), torch.tensor([1.0, -1.0, 1.0])), "std"),
        (lambda: get_activation("relu").moments(torch.zeros(3), torch.ones(4)), "mean"),
        (lambda: get_activation("swish"), "name"),
        (lambda: piecewise_polynomial([1.0, 0.0], [[0.0], [1.0], [2.0]]), "breakpoints"),
        (lambda: piecewise_polynomial([0.0], [[0.0]]), "coefficients"),
        (lambda: abs_moment(-1, 0.0, 1.0), "n"),
        (lambda: positive_part_moments(1.5, 0.0, 1.0), "order"),
        (lambda: get_activation("hard_sigmoid", alpha=float("nan")), "alpha"),
        (lambda: get_activation("leaky_relu", slope=0.1), "leaky_relu"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


@requires_cuda
def test_cuda_matches_cpu():
    for activation in ALL:
        mean = torch.randn(1000, generator=torch.Generator().manual_seed(6)) * 3
        std = torch.rand(1000, generator=torch.Generator().manual_seed(7))
        cpu = activation.moments(mean, std, return_variance=True)
        gpu = activation.moments(mean.cuda(), std.cuda(), return_variance=True)
        for a, b in zip(cpu, gpu):
            assert b.device.type == "cuda"
            torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)


def test_float32_relu_fast_path_gradients_match_float64():
    """The float32 ReLU path saves its Gaussian factors for the backward pass; first and
    second derivatives must agree with the (independent) float64 kernel path."""
    relu = get_activation("relu")
    generator = torch.Generator().manual_seed(8)
    mean32 = (2 * torch.randn(40, generator=generator)).requires_grad_()
    std32 = (0.1 + torch.rand(40, generator=generator)).requires_grad_()
    mean64 = mean32.detach().double().requires_grad_()
    std64 = std32.detach().double().requires_grad_()
    totals = []
    for m, s in ((mean32, std32), (mean64, std64)):
        out = relu.moments(m, s, return_variance=True)
        first = torch.autograd.grad(sum(o.sum() for o in out), (m, s), create_graph=True)
        second = torch.autograd.grad(first[0].sum() + first[1].sum(), (m, s))
        totals.append([t.double() for t in first + second])
    for a, b in zip(*totals):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_relu_mean_without_autograd_under_vmap_matches_the_direct_call():
    """Prediction's mean-only ReLU kernel under ``torch.func.vmap`` (no in-place op without a
    batching rule: a fallback would warn), including inputs larger than one CPU block."""
    import warnings

    relu = get_activation("relu")
    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 70000, generator=generator) * 4
    std = torch.rand(3, 70000, generator=generator) * 2
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        batched = torch.func.vmap(relu.mean)(mean, std)
        direct = relu.mean(mean, std)
    torch.testing.assert_close(batched, direct, rtol=0, atol=0)
    torch.testing.assert_close(direct, relu.moments(mean, std)[0], rtol=0, atol=0)
