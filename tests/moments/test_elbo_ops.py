"""The ELBO's step operators (:mod:`cfbnn_cli.moments.elbo_ops`): each one's C++ CPU kernel (and its
reference kernel, :mod:`cfbnn_cli.moments.elbo_reference`) against
torch's own distributions and autograd in float64 (the definitions, not the kernels' formulas
re-typed), and ``torch.library.opcheck`` on the CPU and, where there is one, on CUDA. Their Triton
kernels run under the interpreter in tests/bnn/test_operator_elbo.py, where the whole ELBO they
make is held to the reference path."""

import math

import pytest
import torch

import cfbnn_cli.moments  # noqa: F401 - registers the operators
from cfbnn_cli.moments import elbo_ops, elbo_reference
from cfbnn_cli.moments.operators import OPERATORS

C = torch.ops.cfbnn
ROWS, WIDTH = 37, 11


def _tensors(seed: int, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype=dtype, device=device)

    return {
        "x": draw(ROWS, 5, scale=2.0),
        "loc": draw(1, WIDTH + 1),
        "log_scale": draw(1, WIDTH + 1, scale=0.5, shift=-1.5),
        "mean_sum": draw(ROWS),
        "spread_sum": draw(ROWS).abs(),
        "y": draw(ROWS),
        "log_precision": draw(1, shift=0.3).reshape(()),
        "row_grad": draw(ROWS),
        "columns": draw(3, WIDTH).double(),
        "matrix_loc": draw(6, 4),
        "matrix_log_scale": draw(6, 4, scale=0.5, shift=-1.0),
        "gradients": (draw(6, 4), draw(6, 4)),
    }


def _kl(loc, log_scale, prior_variance):
    q = torch.distributions.Normal(loc, log_scale.exp())
    p = torch.distributions.Normal(torch.zeros_like(loc), torch.full_like(loc, math.sqrt(prior_variance)))
    return torch.distributions.kl_divergence(q, p).sum()


def _ell(t, bias: bool):
    """E_q[log N(y | mean_sum + b, 1/tau)] per row with the spread and Var b added: the definition."""
    width = t["loc"].shape[1] - int(bias)
    mean = t["mean_sum"] + (t["loc"][0, width] if bias else 0.0)
    spread = t["spread_sum"] + (torch.exp(2 * t["log_scale"][0, width]) if bias else 0.0)
    tau = t["log_precision"].exp()
    normal = torch.distributions.Normal(mean, tau.rsqrt())
    return normal.log_prob(t["y"]) - 0.5 * tau * spread


class _ReferenceKernels:
    """The reference kernels (:mod:`cfbnn_cli.moments.elbo_reference`) under the operators' names: the
    torch formulas that run where the C++ library did not build, held to the same definitions."""

    def __getattr__(self, name):
        return OPERATORS[name].reference


@pytest.fixture(params=["operator", "reference"])
def kernels(request):
    return C if request.param == "operator" else _ReferenceKernels()


@pytest.mark.parametrize("bias", [True, False])
def test_augment_pair(bias, kernels):
    x = _tensors(0)["x"]
    inputs, squares = kernels.augment_pair(x, bias)
    want = torch.cat([x, torch.ones(ROWS, 1, dtype=x.dtype)], 1) if bias else x
    assert torch.equal(inputs, want) and torch.equal(squares, want * want)


@pytest.mark.parametrize("loc_square", [True, False])
def test_diagonal_kl_pass(loc_square, kernels):
    t = _tensors(1)
    kl, variance, square = kernels.diagonal_kl_pass(t["matrix_loc"], t["matrix_log_scale"], 0.7, loc_square)
    torch.testing.assert_close(kl, _kl(t["matrix_loc"], t["matrix_log_scale"], 0.7), rtol=1e-13, atol=0)
    torch.testing.assert_close(variance, torch.exp(2 * t["matrix_log_scale"]), rtol=1e-15, atol=0)
    assert square.shape == ((6, 4) if loc_square else (0,))
    if loc_square:
        torch.testing.assert_close(square, t["matrix_loc"] ** 2)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hidden_shape", [(6, 4), (40, 77)], ids=["one_block", "four_blocks"])
def test_outer_layers_pass(bias, hidden_shape, kernels):
    """Both layers' variances, the output layer's loc^2, [x, 1] and [x^2, 1], and a KL sums table
    whose rows add up to both layers' KL (torch.distributions) and, block by block, to each block's
    own sums (the first layer's blocks first, the last one partial)."""
    t = _tensors(9)
    g = torch.Generator().manual_seed(9)
    loc = torch.randn(*hidden_shape, generator=g, dtype=torch.float64)
    log_scale = torch.randn(*hidden_shape, generator=g, dtype=torch.float64) * 0.5 - 1.0
    result = kernels.outer_layers_pass(t["x"], loc, log_scale, t["loc"], t["log_scale"], bias)
    inputs, squares, variance, output_variance, output_loc_square, kl_sums = result
    want = torch.cat([t["x"], torch.ones(ROWS, 1, dtype=torch.float64)], 1) if bias else t["x"]
    assert torch.equal(inputs, want) and torch.equal(squares, want * want)
    torch.testing.assert_close(variance, torch.exp(2 * log_scale), rtol=1e-15, atol=0)
    torch.testing.assert_close(output_variance, torch.exp(2 * t["log_scale"]), rtol=1e-15, atol=0)
    torch.testing.assert_close(output_loc_square, t["loc"] ** 2)
    blocks = -(-loc.numel() // 1024)
    assert kl_sums.dtype == torch.float64 and kl_sums.shape == (blocks + 1, 3)
    for index, start in enumerate(range(0, loc.numel(), 1024)):  # the first layer's blocks, in memory order
        part = slice(start, start + 1024)
        l, s = loc.reshape(-1)[part], log_scale.reshape(-1)[part]
        row = torch.stack([(torch.exp(2 * s) + l * l).sum(), s.sum(), torch.tensor(float(l.numel()))])
        torch.testing.assert_close(kl_sums[index], row.double(), rtol=1e-13, atol=1e-13)
    total = _kl(loc, log_scale, 0.7) + _kl(t["loc"], t["log_scale"], 0.7)
    torch.testing.assert_close(elbo_reference.kl_from_table(kl_sums, 0.7), total, rtol=1e-13, atol=0)


def test_outer_layers_pass_float32_against_float64():
    """float32 inputs: float32 outputs, the KL sums table in float64 from the float32 values."""
    t = _tensors(10)
    g = torch.Generator().manual_seed(10)
    loc, log_scale = torch.randn(30, 50, generator=g), torch.randn(30, 50, generator=g) * 0.5 - 1.0
    args = [t["x"].float(), loc, log_scale, t["loc"].float(), t["log_scale"].float(), True]
    got = C.outer_layers_pass(*args)
    want = elbo_reference.outer_layers_pass(*[a.double() if torch.is_tensor(a) else a for a in args])
    assert [g.dtype for g in got] == [torch.float32] * 5 + [torch.float64]
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.double(), w, rtol=2e-7, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_rows_and_the_elbo(bias, kernels):
    t = _tensors(2)
    loc, log_scale = (t[k][:, : WIDTH + int(bias)] for k in ("loc", "log_scale"))
    common = (t["mean_sum"], t["spread_sum"], t["y"], loc, log_scale, t["log_precision"])
    residual, squares, ell = kernels.normal_ell_rows(*common, bias)
    case = dict(t, loc=loc, log_scale=log_scale)
    torch.testing.assert_close(ell, _ell(case, bias), rtol=1e-13, atol=1e-13)
    b = loc[0, WIDTH] if bias else 0.0
    torch.testing.assert_close(residual, t["y"] - t["mean_sum"] - b)
    # the KL of two layers from their KL sums table (finished by the rows), and another layer's KL
    layers = [(t["matrix_loc"], t["matrix_log_scale"]), (loc, log_scale)]
    kl_sums = torch.cat([elbo_reference.kl_block_sums(*layer) for layer in layers])
    kl = _kl(*layers[0], 0.7) + _kl(*layers[1], 0.7)
    other = torch.tensor(0.5, dtype=torch.float64)
    for extra in (None, other):
        _, got_squares, elbo = kernels.normal_elbo_rows(*common, kl_sums, extra, 0.7, 3.0, bias)
        want = 3.0 * _ell(case, bias).sum() - kl - (0.0 if extra is None else 0.5)
        torch.testing.assert_close(elbo, want, rtol=1e-13, atol=0)
        assert torch.equal(squares, got_squares)


@pytest.mark.parametrize("row_grads", [True, False])
def test_rows_backward_is_the_gradient_of_the_rows(row_grads, kernels):
    t = _tensors(3)
    leaves = {k: t[k].clone().requires_grad_() for k in ("mean_sum", "spread_sum", "log_precision")}
    ell = _ell(dict(t, **leaves), True)
    grad = t["row_grad"] if row_grads else torch.tensor(0.8, dtype=torch.float64)
    weights = 2.5 * (grad if row_grads else grad.expand(ROWS))
    want = torch.autograd.grad((weights * ell).sum(), list(leaves.values()))
    residual, squares, _ = kernels.normal_ell_rows(
        t["mean_sum"], t["spread_sum"], t["y"], t["loc"], t["log_scale"], t["log_precision"], True
    )
    row_u, row_k, sums, grad_log_precision = kernels.normal_rows_backward(
        grad, residual, squares, t["log_precision"], 2.5, row_grads
    )
    # dL/d mean_sum and dL/d spread_sum per row; their sums are the bias column's (d b = u, d Var b = k)
    torch.testing.assert_close(row_u, want[0], rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(row_k, want[1], rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(sums[:2], torch.stack([want[0].sum(), want[1].sum()]), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grad_log_precision, want[2], rtol=1e-12, atol=1e-13)
    assert sums.dtype == torch.float64 and float(sums[2]) == float(grad_log_precision)


@pytest.mark.parametrize("bias, kl_sign, data_scale", [(True, -1.0, None), (False, 1.0, 0.6), (True, 0.0, -2.5)])
def test_output_layer_gradients_fold_the_kl(bias, kl_sign, data_scale, kernels):
    t = _tensors(4)
    width = WIDTH
    loc, log_scale = (t[k][:, : width + int(bias)].clone().requires_grad_() for k in ("loc", "log_scale"))
    sums = torch.tensor([0.3, -0.7, 0.0], dtype=torch.float64)
    kl_grad = torch.tensor(1.7, dtype=torch.float64)
    columns = t["columns"]
    variance = torch.exp(2 * log_scale)
    # the data term whose gradients the tail pass's column sums are: sum_c (col0 loc + col1 loc^2 + col2 Var)
    data = (columns[0] * loc[0, :width] + columns[1] * loc[0, :width] ** 2 + columns[2] * variance[0, :width]).sum()
    if data_scale is not None:  # column sums taken at a unit upstream gradient: the data term times the real one
        data = data * data_scale
        data_scale = torch.tensor(data_scale, dtype=torch.float64)
    if bias:
        data = data + sums[0] * loc[0, width] + sums[1] * variance[0, width]
    objective = data + kl_sign * kl_grad * _kl(loc, log_scale, 0.6)
    want = torch.autograd.grad(objective, [loc, log_scale])
    got = kernels.output_layer_gradients(
        columns, sums, loc.detach(), log_scale.detach(), kl_grad, kl_sign, 0.6, bias, data_scale
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("data_scale", [None, 1.7])
def test_finish_diagonal_gradients_in_place(data_scale, kernels):
    t = _tensors(5)
    loc, log_scale = (t[k].clone().requires_grad_() for k in ("matrix_loc", "matrix_log_scale"))
    grad_loc, grad_variance = (g.clone() for g in t["gradients"])
    kl_grad = torch.tensor(-0.9, dtype=torch.float64)
    objective = (grad_loc * loc).sum() + (grad_variance * torch.exp(2 * log_scale)).sum()
    if data_scale is not None:  # the data term's gradients taken at a unit upstream gradient
        objective = objective * data_scale
        data_scale = torch.tensor(data_scale, dtype=torch.float64)
    want = torch.autograd.grad(objective - kl_grad * _kl(loc, log_scale, 1.3), [loc, log_scale])
    variance = torch.exp(2 * t["matrix_log_scale"])
    result = kernels.finish_diagonal_gradients(
        grad_loc, grad_variance, t["matrix_loc"], variance, kl_grad, -1.0, 1.3, data_scale
    )
    assert result is None  # (in place: the two gradients are now d/d loc and d/d log_scale)
    torch.testing.assert_close(grad_loc, want[0], rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(grad_variance, want[1], rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.finish_diagonal_gradients(
            grad_loc.t(), grad_variance.t(), loc.detach().t(), variance.t(), kl_grad, -1.0, 1.3
        )


@pytest.mark.parametrize("activation, slope", [(0, 0.0), (1, 0.15), (2, 0.0)])
@pytest.mark.parametrize("bias", [True, False])
def test_tail_with_gradients_is_the_tail_and_the_gradient_of_the_scaled_ell(activation, slope, bias, kernels):
    """``cfbnn::relu_tail_with_gradients``: the tail pass's row sums, and the gradients of ``scale
    sum_r ELL_r`` (the definition: torch's Normal log density, autograd through the reference tail
    pass) with respect to the pre-activations' means and variances and to the three weights."""
    from cfbnn_cli.moments.elbo_reference import relu_tail as reference_relu_tail

    t = _tensors(9)
    g = torch.Generator().manual_seed(9)
    mean = (torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64) * 2).requires_grad_()
    variance = (torch.rand(ROWS, WIDTH, generator=g, dtype=torch.float64) + 0.05).requires_grad_()
    loc = t["loc"][:, : WIDTH + int(bias)]
    weights = [w.clone().requires_grad_() for w in (loc[0, :WIDTH], loc[0, :WIDTH] ** 2, torch.exp(t["log_scale"][0]))]
    weights[2] = weights[2][:WIDTH].detach().requires_grad_()
    mean_sum, spread_sum = reference_relu_tail(mean, variance, *weights, activation, slope)
    ell = _ell(dict(t, loc=loc, mean_sum=mean_sum, spread_sum=spread_sum), bias)
    want = torch.autograd.grad(2.5 * ell.sum(), [mean, variance, *weights])
    got = kernels.relu_tail_with_gradients(
        mean.detach(), variance.detach(), *(w.detach() for w in weights), t["y"], loc, t["log_precision"], 2.5, bias,
        activation, slope,
    )  # fmt: skip
    torch.testing.assert_close(got[0], mean_sum.detach(), rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(got[1], spread_sum.detach(), rtol=1e-13, atol=1e-14)
    for g_, w in zip((*got[2:4], *got[4]), want):
        torch.testing.assert_close(g_, w, rtol=1e-11, atol=1e-12)
    assert got[4].dtype == torch.float64


def _opcheck_arguments(t):
    residual, squares, _ = C.normal_ell_rows(
        t["mean_sum"], t["spread_sum"], t["y"], t["loc"], t["log_scale"], t["log_precision"], True
    )
    kl = t["log_precision"] * 0 + 0.25
    kl_sums = elbo_reference.kl_block_sums(t["matrix_loc"], t["matrix_log_scale"])
    return {
        "augment_pair": (t["x"], True),
        "outer_layers_pass": (t["x"], t["matrix_loc"], t["matrix_log_scale"], t["loc"], t["log_scale"], True),
        "diagonal_kl_pass": (t["matrix_loc"], t["matrix_log_scale"], 0.8, True),
        "normal_ell_rows": (t["mean_sum"], t["spread_sum"], t["y"], t["loc"], t["log_scale"], t["log_precision"], True),
        "normal_elbo_rows": (
            *(t[k] for k in ("mean_sum", "spread_sum", "y", "loc", "log_scale", "log_precision")),
            kl_sums,
            kl,
            0.8,
            2.0,
            True,
        ),
        "normal_rows_backward": (t["row_grad"], residual, squares, t["log_precision"], 2.0, True),
        "output_layer_gradients": (
            t["columns"],
            torch.ones(3, dtype=torch.float64, device=t["x"].device),
            t["loc"],
            t["log_scale"],
            kl,
            -1.0,
            0.8,
            True,
        ),
        "finish_diagonal_gradients": (
            *(g.clone() for g in t["gradients"]),
            t["matrix_loc"],
            torch.exp(2 * t["matrix_log_scale"]),
            kl,
            -1.0,
            0.8,
            kl,
        ),
        "relu_tail_with_gradients": (
            t["x"][:, :4],
            t["x"][:, 1:5].abs() + 0.1,
            *(t["loc"][0, :4] * k for k in (1.0, 0.5, 0.25)),
            t["y"],
            t["loc"][:, :5],
            t["log_precision"],
            2.0,
            True,
            1,
            0.2,
        ),
    }


# the steps are not differentiable (the nodes' backward passes call the backward steps): the
# checks that need an autograd registration are left out
_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck_cpu(dtype):
    arguments = _opcheck_arguments(_tensors(6, dtype))
    assert set(arguments) == set(elbo_ops.STEPS)
    for name, args in arguments.items():
        torch.library.opcheck(getattr(C, name).default, args, test_utils=_UTILS)
    rows = arguments["normal_elbo_rows"]  # (and without a further layer's KL)
    torch.library.opcheck(C.normal_elbo_rows.default, (*rows[:7], None, *rows[8:]), test_utils=_UTILS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck_cuda_and_the_cpu_agree(dtype):
    cpu, cuda = _opcheck_arguments(_tensors(7, dtype)), _opcheck_arguments(_tensors(7, dtype, "cuda"))
    for name, args in cuda.items():
        torch.library.opcheck(getattr(C, name).default, args, test_utils=_UTILS)
        want, got = getattr(C, name)(*cpu[name]), getattr(C, name)(*args)
        if name == "finish_diagonal_gradients":
            want, got = cpu[name][:2], args[:2]
        tolerance = 1e-12 if dtype == torch.float64 else 2e-6
        for w, g in zip(want, got):
            torch.testing.assert_close(g.cpu(), w, rtol=tolerance, atol=tolerance)


def test_the_cpu_kernels_are_the_cpp_librarys():
    """The CPU kernels of every cfbnn:: operator (moments, KL, tail pass, the steps) are registered in C++ by the kernel
    library (csrc/moment_ops.cpp, csrc/elbo_ops.cpp): the dispatcher's active CPU kernel comes from those files."""
    from cfbnn_cli.moments import extension

    if not extension.status()["loaded"]:
        pytest.skip("the C++ CPU kernels were not built here")
    registered = ("relu_family_moments", "diagonal_kl", "relu_tail", *elbo_ops.STEPS)
    for name in (*registered, *(f"{name}_backward" for name in registered[:3])):
        active = [line for line in torch._C._dispatch_dump(f"cfbnn::{name}").splitlines() if line.startswith("CPU:")]
        assert len(active) == 1 and ("elbo_ops.cpp" in active[0] or "moment_ops.cpp" in active[0]), (name, active)


def test_the_cpu_kernels_refuse_mixed_dtypes_and_wrong_shapes():
    """Typed tensors, not raw pointers: what would have read the wrong memory raises, naming the op."""
    t = _tensors(8)
    rows = [t[k] for k in ("mean_sum", "spread_sum", "y", "loc", "log_scale", "log_precision")]
    mixed = [rows[0].float(), *rows[1:]]
    with pytest.raises(ValueError, match="cfbnn::normal_ell_rows: every tensor must have one dtype"):
        C.normal_ell_rows(*mixed, True)
    short = [*rows[:2], rows[2][:5], *rows[3:]]
    with pytest.raises(ValueError, match=f"cfbnn::normal_ell_rows: `y` must have {ROWS} elements"):
        C.normal_ell_rows(*short, True)
    with pytest.raises(ValueError, match="cfbnn::diagonal_kl_pass: `log_scale` must have 24 elements"):
        C.diagonal_kl_pass(t["matrix_loc"], t["matrix_log_scale"][:, :3], 0.8, False)
    mean, variance = t["x"], t["x"].abs()
    weights = [torch.ones(mean.shape[1], dtype=mean.dtype)] * 2 + [torch.ones(3, dtype=mean.dtype)]
    with pytest.raises(ValueError, match="cfbnn::relu_tail: each weight must be"):
        C.relu_tail(mean, variance, *weights)
    with pytest.raises(ValueError, match="float32 or float64"):
        C.augment_pair(t["x"].to(torch.int64), True)
    # the tail pass with its gradients: the rows' targets, the output row with its bias column, dtypes
    tail = (mean[:, :4], variance[:, :4], *(w[:4] for w in weights[:2]), weights[0][:4])
    rest = (t["log_precision"], 1.0, True)
    with pytest.raises(ValueError, match=f"cfbnn::relu_tail_with_gradients: `y` must have {ROWS} elements"):
        C.relu_tail_with_gradients(*tail, t["y"][:5], t["loc"][:, :5], *rest)
    with pytest.raises(ValueError, match="cfbnn::relu_tail_with_gradients: `loc` must have 5 elements"):
        C.relu_tail_with_gradients(*tail, t["y"], t["loc"][:, :4], *rest)
    with pytest.raises(ValueError, match="cfbnn::relu_tail_with_gradients: every tensor must have one dtype"):
        C.relu_tail_with_gradients(*tail, t["y"].float(), t["loc"][:, :5], *rest)
