"""The activations' moments operators' C++ CPU kernels against their reference formulas.

Both are checked against quadrature elsewhere (test_moments_quadrature.py, test_piecewise.py,
which run the operators); here the C++ kernels are held to the *float64 reference formula* (each
activation's ``reference_moments``, differentiated by autograd) on random and extreme inputs, for
values and gradients. The float64 reference is itself accurate to ~1e-10 (quadrature tests), so
float32 results are compared with it at the float32 tolerance and float64 results at a small
multiple of 1e-10.
"""

import math

import pytest
import torch
from torch.func import grad, vmap

from cfbnn_cli.moments import extension, get_activation, piecewise_polynomial

pytestmark = pytest.mark.skipif(not extension.status()["loaded"], reason="the C++ CPU kernels were not built here")

F32_TINY = float(torch.finfo(torch.float32).tiny)


def user_piecewise():
    # discontinuous, a cubic piece, constant tails (also in test_moments_properties.py)
    return piecewise_polynomial([-1.0, 0.5, 2.0], [[1.0], [0.0, -1.0, 0.5], [2.0, 0.0, 0.0, 1.0], [-3.0]])


ACTIVATIONS = [
    get_activation("relu"),
    get_activation("leaky_relu", negative_slope=0.1),
    get_activation("leaky_relu", negative_slope=-0.5),
    get_activation("relu_squared"),
    get_activation("identity"),
    get_activation("hard_sigmoid", alpha=1.0),
    get_activation("hard_sigmoid", alpha=1e-3),
    get_activation("hard_sigmoid", alpha=1e3),
    get_activation("hard_sigmoid", alpha=-0.7),
    user_piecewise(),
    piecewise_polynomial([0.0], [[0.0], [0.0, 0.0, 1.0]]),  # relu^2 through the engine
    piecewise_polynomial([-0.5, 0.5], [[0.0], [1.0], [0.0]]),  # a box: discontinuous, degree 0
    piecewise_polynomial([-1.0, 0.0, 1.0], [[0.0], [1.0, 2.0, 1.0], [1.0, -2.0, 1.0], [0.0]]),  # quadratic bump
    piecewise_polynomial([0.0], [[0.0], [0.0, 1.0, 0.0, 0.0, 0.5]]),  # quartic: the generic (runtime-degree) kernel
]


def random_inputs(dtype, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (6 * torch.rand(n, generator=g, dtype=torch.float64) - 3)  # std in [1e-3, 1e3]
    t = 12 * torch.randn(n, generator=g, dtype=torch.float64)  # mean / std, a wide range
    std = scale
    mean = t * std
    return mean.to(dtype), std.to(dtype)


def extreme_inputs(dtype):
    means = [-1e6, -1e3, -40.0, -13.2, -13.0, -8.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 8.0, 13.0, 13.2, 40.0, 1e3, 1e6]
    stds = [0.0, 1e-30, 1e-4, 0.1, 1.0, 3.0, 1e3]
    mean = torch.tensor([m for m in means for _ in stds], dtype=dtype)
    std = torch.tensor([s for _ in means for s in stds], dtype=dtype)
    if dtype == torch.float32:
        std = torch.where(std == 1e-30, torch.full_like(std, 1e-30), std)
    return mean, std


def reference(activation, mean, std):
    """``(Phi, Upsilon, Var)`` by the activation's reference formula (autograd differentiates it)."""
    return activation.reference_moments(*torch.broadcast_tensors(mean, std))


def reference64(activation, mean, std):
    return reference(activation, mean.double(), std.double())


def assert_close_to_reference(activation, mean, std, tol, what):
    got = activation.moments(mean, std, return_variance=True)
    phi_ref, ups_ref, var_ref = reference64(activation, mean, std)
    phi, ups, var = (v.double() for v in got)
    # below these the results are not normal floats (as test_moments_quadrature.py: only tiny there)
    tiny = (F32_TINY if mean.dtype == torch.float32 else 1e-300) * torch.clamp(std.double() ** 2, min=1.0)
    # Phi crosses zero (odd activations): its scale is the root mean square sqrt(Upsilon)
    checks = [("Phi", phi, phi_ref, ups_ref.sqrt()), ("Upsilon", ups, ups_ref, ups_ref), ("Var", var, var_ref, var_ref)]
    huge = float(torch.finfo(mean.dtype).max)
    for name, value, reference, scale in checks:
        error = (value - reference).abs()
        bad = (error > tol * scale + tiny) & (reference.abs() < huge)  # beyond: overflow is the right answer
        assert not bad.any(), (
            f"{activation!r} {what} {name}: {int(bad.sum())} of {bad.numel()} off; worst at mean="
            f"{mean[bad][0].item()!r} std={std[bad][0].item()!r}: {value[bad][0].item()!r} vs {reference[bad][0].item()!r}"
        )
        assert torch.isfinite(value[reference.abs() < huge]).all()
    assert (var >= 0).all()


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=repr)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)], ids=["f64", "f32"])
def test_fast_values_match_float64_reference(activation, dtype, tol):
    for what, (mean, std) in (("random", random_inputs(dtype)), ("extreme", extreme_inputs(dtype))):
        mean_in = mean.double().to(dtype)
        assert_close_to_reference(activation, mean_in, std, tol, what)


def test_float32_small_tails_on_a_dense_grid():
    """The float32 kernels' fitted tails (0 <= x <= 13.14) and the float64 fix-up beyond, on a
    dense grid of mean/std in [-20, 20] and std from 1e-4 to 1e30 (large std keeps far tails normal)."""
    t = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    for std_value in (1e-4, 1.0, 1e3, 1e30):
        std = torch.full_like(t, std_value)
        mean = (t * std_value).float().double()
        for activation in (
            get_activation("relu"),
            get_activation("relu_squared"),
            get_activation("leaky_relu", negative_slope=0.01),
        ):
            if activation.name == "relu_squared" and std_value > 1e9:
                continue  # std^4 overflows float32
            assert_close_to_reference(activation, mean.float(), std.float(), 1e-5, f"dense std={std_value}")


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_fast_gradients_match_reference(activation, dtype):
    g = torch.Generator().manual_seed(3)
    mean = (4 * torch.randn(500, generator=g, dtype=torch.float64)).to(dtype)
    std = (0.05 + 2 * torch.rand(500, generator=g, dtype=torch.float64)).to(dtype)
    weights = [torch.randn(500, generator=g, dtype=torch.float64) for _ in range(3)]

    def gradients(enabled, m, s):
        m = m.clone().requires_grad_()
        s = s.clone().requires_grad_()
        outputs = activation.moments(m, s, return_variance=True) if enabled else reference(activation, m, s)
        loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights))
        return torch.autograd.grad(loss, (m, s))

    got = gradients(True, mean, std)
    wanted = gradients(False, mean.double(), std.double())
    tol = 1e-8 if dtype == torch.float64 else 2e-4
    for a, b in zip(got, wanted):
        scale = b.abs().max().clamp(min=1e-300)
        assert ((a.double() - b).abs() <= tol * (b.abs() + 1e-3 * scale)).all(), (
            activation,
            dtype,
            (a.double() - b).abs().max(),
        )


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=repr)
def test_gradients_finite_at_extremes(activation):
    for dtype in (torch.float32, torch.float64):
        mean, std = extreme_inputs(dtype)
        if getattr(activation, "degree", 1) > 2:  # |mean| = 1e6: a quartic's Upsilon overflows float32
            keep = mean.abs() <= 1e3
            mean, std = mean[keep], std[keep]
        mean.requires_grad_()
        std.requires_grad_()
        outputs = activation.moments(mean, std, return_variance=True)
        for g in torch.autograd.grad(sum(o.sum() for o in outputs), (mean, std)):
            assert torch.isfinite(g).all()


def test_relu_std_zero_gradient_is_the_one_sided_limit():
    """At std == 0: dPhi/dmean = 1{mean > 0} (relu'), dPhi/dstd = phi(0) at mean == 0 (Phi = std phi(0))."""
    relu = get_activation("relu")
    mean = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
    std = torch.zeros(3, requires_grad=True)
    gm, gs = torch.autograd.grad(relu.moments(mean, std)[0].sum(), (mean, std))
    torch.testing.assert_close(gm, torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(gs, torch.tensor([0.0, 1 / math.sqrt(2 * math.pi), 0.0]))


def test_broadcast_scalar_and_dense_gradients_agree():
    """A broadcast scalar gradient (``.sum().backward()``) is read without materializing it."""
    relu = get_activation("relu")
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(300, generator=g, requires_grad=True)
    std = torch.rand(300, generator=g, requires_grad=True)
    phi, ups, var = relu.moments(mean, std, return_variance=True)
    from_sum = torch.autograd.grad(phi.sum() + 2 * ups.sum() - var.sum(), (mean, std), retain_graph=True)
    ones = torch.ones_like(phi)
    dense = torch.autograd.grad((phi, ups, var), (mean, std), (ones.clone(), 2 * ones, -ones))
    for a, b in zip(from_sum, dense):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_broadcasting_and_non_contiguous_inputs():
    relu = get_activation("hard_sigmoid", alpha=0.5)
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(7, 5, generator=g).t().requires_grad_()  # (5, 7), non-contiguous
    std = (torch.rand(7, generator=g) + 0.1).requires_grad_()  # broadcast along rows
    outputs = relu.moments(mean, std, return_variance=True)
    grads = torch.autograd.grad(sum(o.sum() for o in outputs), (mean, std))
    wanted = reference(relu, mean, std)
    wanted_grads = torch.autograd.grad(sum(o.sum() for o in wanted), (mean, std))
    assert outputs[0].shape == (5, 7) and grads[0].shape == (5, 7) and grads[1].shape == (7,)
    for a, b in zip(outputs + grads, wanted + wanted_grads):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("activation", ACTIVATIONS[:6] + [user_piecewise()], ids=repr)
def test_vmap_of_grad_matches_the_direct_call(activation):
    """The gradient-variance code's pattern: vmap(grad(...)) over the moments."""

    def f(m, s):
        phi, ups, var = activation.moments(m, s, return_variance=True)
        return (phi + 0.3 * ups - 0.7 * var).sum()

    g = torch.Generator().manual_seed(6)
    mean = 2 * torch.randn(4, 9, generator=g)
    std = torch.rand(4, 9, generator=g) + 0.05
    batched = vmap(grad(f, argnums=(0, 1)))(mean, std)
    m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
    f(m, s).backward()
    for a, b in ((batched[0], m.grad), (batched[1], s.grad)):  # float32 rounding of terms up to |b|.max()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    # vmap with an unbatched std (in_dims None) broadcasts
    batched_mean_only = vmap(grad(f), in_dims=(0, None))(mean, std[0])
    assert batched_mean_only.shape == mean.shape


def test_double_backward_goes_through_the_reference():
    """create_graph=True: second derivatives through the operator equal those of the reference formula."""
    hard = get_activation("hard_sigmoid", alpha=0.8)
    g = torch.Generator().manual_seed(7)
    mean = torch.randn(30, generator=g, dtype=torch.float64)
    std = torch.rand(30, generator=g, dtype=torch.float64) + 0.1
    results = []
    for enabled in (True, False):
        m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
        phi, ups, var = hard.moments(m, s, return_variance=True) if enabled else reference(hard, m, s)
        first = torch.autograd.grad((phi * ups).sum() + var.sum(), (m, s), create_graph=True)
        second = torch.autograd.grad(first[0].sum() + 3 * first[1].sum(), (m, s))
        results.append(first + second)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_threads_and_block_positions_give_identical_results():
    relu2 = get_activation("relu_squared")
    hard = get_activation("hard_sigmoid", alpha=0.3)
    g = torch.Generator().manual_seed(8)
    mean = 3 * torch.randn(70001, generator=g)
    std = torch.rand(70001, generator=g)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [relu2.moments(mean, std, return_variance=True), hard.moments(mean, std, return_variance=True)]
        torch.set_num_threads(max(2, previous))
        many = [relu2.moments(mean, std, return_variance=True), hard.moments(mean, std, return_variance=True)]
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, many):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # the same element computes the same numbers in a full block and in the padded last block
    shifted = relu2.moments(mean[5:], std[5:], return_variance=True)
    for x, y in zip(one[0], shifted):
        assert torch.equal(x[5:], y)


@pytest.mark.parametrize("name", ["relu", "hard_sigmoid"])
def test_the_activation_takes_its_operator_and_other_dtypes_compute_in_float32(name):
    """ReLU and the hard sigmoid (a piecewise polynomial: cfbnn::piecewise_moments) take their
    operators, one autograd node each; bfloat16 tensors are computed in float32 and returned in
    bfloat16 (the operators take float32 and float64)."""
    activation = get_activation(name)
    mean, std = torch.randn(10, requires_grad=True), torch.rand(10)
    phi, _ = activation.moments(mean, std)
    assert type(phi.grad_fn).__name__ == "OperatorAutogradBackward"
    low = activation.moments(mean.detach().to(torch.bfloat16), std.to(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in low)
    torch.testing.assert_close(low[0].float(), phi.detach().to(torch.bfloat16).float(), rtol=2e-2, atol=1e-2)


def test_the_loaded_library_is_the_packages():
    status = extension.status()
    assert status["loaded"] and status["path"].endswith(tuple(__import__("importlib").machinery.EXTENSION_SUFFIXES))


def test_validation_counts_negative_std_on_the_fast_path():
    relu = get_activation("relu")
    with pytest.raises(ValueError, match="std"):
        relu.moments(torch.zeros(1000), torch.cat([torch.ones(999), -torch.ones(1)]))
    assert torch.ops.cfbnn.count_negative(torch.tensor([1.0, -0.0, -2.0, float("nan")])) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_sign_count_operator_matches_torch(dtype):
    """cfbnn::count_negative (the argument checks' one pass, the library's C++ kernel) against
    torch's comparison, on blocks that take one thread and several, a transposed view, -0.0,
    NaN and an empty tensor."""
    g = torch.Generator().manual_seed(3)
    for shape in ((7,), (300, 301)):
        x = torch.randn(*shape, generator=g, dtype=dtype)
        x.view(-1)[:3] = torch.tensor([-0.0, float("nan"), float("-inf")], dtype=dtype)
        for given in (x, x.mT if x.dim() == 2 else x):
            assert torch.ops.cfbnn.count_negative(given) == int((given < 0).sum())
    assert torch.ops.cfbnn.count_negative(torch.empty(0, dtype=dtype)) == 0
    with pytest.raises(ValueError, match="count_negative"):
        torch.ops.cfbnn.count_negative(torch.zeros(3, dtype=torch.int64))


def test_float32_hard_sigmoid_on_a_dense_grid():
    """The unrolled float32 hard-sigmoid kernel: every position of the mean relative to both
    kinks, widths from far below std (Gauss-Legendre hand-over) to far above, std up to 1e30.
    (alpha representable in float32, as in test_moments_quadrature.py: float32 arithmetic puts
    the kinks at float32(alpha), and 10 sigma out a 6e-8 shift of a kink moves a tail by 1e-5.)"""
    g = torch.Generator().manual_seed(9)
    for alpha in (2.0**-10, 19 / 64, 1.0, 7.0, 2.0**10, -2.0):
        hard = get_activation("hard_sigmoid", alpha=alpha)
        for std_value in (2.0**-13, 0.05, 1.0, 40.0, 1e30):
            std = torch.full((3000,), std_value, dtype=torch.float64)
            t = torch.cat(
                [
                    torch.linspace(-30, 30, 2000, dtype=torch.float64),
                    30 * torch.randn(1000, generator=g, dtype=torch.float64),
                ]
            )
            mean = (
                (t * std_value + abs(alpha) * torch.sign(torch.randn(3000, generator=g, dtype=torch.float64)))
                .float()
                .double()
            )
            assert_close_to_reference(hard, mean.float(), std.float(), 1e-5, f"dense alpha={alpha} std={std_value}")


@pytest.mark.slow
def test_torch_compile_gives_the_eager_moments():
    """Under torch.compile (inductor) ReLU's moments are the eager ones (the graph calls
    cfbnn::relu_family_moments; the direct kernel calls step aside)."""
    relu = get_activation("relu")
    mean = torch.randn(64, 32, generator=torch.Generator().manual_seed(10))
    std = torch.rand(64, 32, generator=torch.Generator().manual_seed(11)) + 0.1
    compiled = torch.compile(lambda m, s: relu.moments(m, s, return_variance=True))
    for a, b in zip(compiled(mean, std), relu.moments(mean, std, return_variance=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


KERNEL_BACKWARD = [
    get_activation("relu"),
    get_activation("leaky_relu", negative_slope=-0.5),
    get_activation("relu_squared"),
]


@pytest.mark.parametrize("activation", KERNEL_BACKWARD, ids=repr)
@pytest.mark.parametrize("weights", [(1.0, 0.3, -0.7), (0.0, 1.0, 0.0), (1.0, 0.0, 0.0)], ids=["all", "ups", "phi"])
def test_a_backward_that_builds_a_graph_runs_the_kernel_and_its_second_derivatives_are_the_references(
    activation, weights
):
    """create_graph=True (what torch.func.grad always asks for): the first derivative comes from
    the backward kernel (the backward operator, through its own autograd), the second from its
    formula's differentiable ops; both equal the reference formula's autograd, in float64, also
    when only some of (Phi, Upsilon, Var) carry a gradient."""
    calls = []
    g = torch.Generator().manual_seed(11)
    mean = 3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    std = torch.rand(6, 5, generator=g, dtype=torch.float64) + 0.05
    mean[0, :2], std[0, :2] = torch.tensor([-40.0, 40.0], dtype=torch.float64), 1e-3  # far tails
    a, b, c = weights
    results = []
    for enabled in (True, False):
        m, s = mean.clone().requires_grad_(), std.clone().requires_grad_()
        moments = activation.moments(m, s, return_variance=True) if enabled else reference(activation, m, s)
        phi, ups, var = moments[:3]
        total = a * (phi * phi.detach()).sum() + b * ups.sum() + c * (var * torch.linspace(0, 1, 5)).sum()
        first = torch.autograd.grad(total, (m, s), create_graph=True)
        second = torch.autograd.grad((first[0] * first[0].detach()).sum() + 3 * first[1].sum(), (m, s))
        if enabled:  # the backward operator's own node made it
            node = first[0].grad_fn
            calls += [node.operator.name] if getattr(node, "operator", None) is not None else []
        results.append(first + second)
    assert calls == ["relu_family_moments_backward"], "the first derivative did not come from the backward kernel"
    for fast_result, wanted in zip(*results):
        assert torch.isfinite(fast_result).all()
        torch.testing.assert_close(fast_result, wanted, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("activation", KERNEL_BACKWARD, ids=repr)
def test_per_sample_second_derivatives_under_vmap_match_the_direct_call(activation):
    """vmap(grad(grad-sum)): the kernel backward's own vmap rule and its second derivative
    under functorch, against the plain double backward."""

    def f(m, s):
        phi, ups, var = activation.moments(m, s, return_variance=True)
        return (phi + 0.3 * ups - 0.7 * var).sum()

    def first_sum(m, s):
        first_mean, first_std = grad(f, argnums=(0, 1))(m, s)
        return (first_mean * first_mean).sum() + first_std.sum()

    g = torch.Generator().manual_seed(12)
    mean = 2 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    std = torch.rand(9, generator=g, dtype=torch.float64) + 0.05
    batched = vmap(grad(first_sum, argnums=(0, 1)), in_dims=(0, None))(mean, std)
    for row in range(4):
        m, s = mean[row].clone().requires_grad_(), std.clone().requires_grad_()
        first = torch.autograd.grad(f(m, s), (m, s), create_graph=True)
        expected = torch.autograd.grad((first[0] * first[0]).sum() + first[1].sum(), (m, s))
        torch.testing.assert_close(batched[0][row], expected[0], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(batched[1][row], expected[1], rtol=1e-9, atol=1e-12)
