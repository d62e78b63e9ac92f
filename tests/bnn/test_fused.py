"""bnn/fused: the fused nodes' hand-written backward passes (``cfbnn::diagonal_preactivation``,
``cfbnn::propagated_preactivation``, ``cfbnn::normal_ell``, the whole-ELBO nodes) against autograd of
the plain torch formulas (bnn/functional.py) and against finite differences (gradcheck), in float64."""

import pytest
import torch
from torch.func import grad, vmap

from cfbnn_cli.bnn import fused
from cfbnn_cli.bnn.functional import augment, kl_normal_rows, output_moments_given_hidden, preactivation_moments
from cfbnn_cli.moments.activations import family_of

DT = torch.float64


def diagonal_preactivation(h, loc, log_scale, bias=True, variance_output=False):
    """``(gamma, xi)`` (``xi^2`` with ``variance_output``) of ``cfbnn::diagonal_preactivation``."""
    return torch.ops.cfbnn.diagonal_preactivation(h, loc, log_scale, bias, variance_output, None)[:2]


def propagated_preactivation(phi, variance, loc, log_scale, bias=True, second_moment=None, variance_output=False):
    """``(gamma, xi)`` (``xi^2`` with ``variance_output``) of ``cfbnn::propagated_preactivation``."""
    return torch.ops.cfbnn.propagated_preactivation(
        phi, variance, second_moment, loc, log_scale, bias, variance_output, None
    )[:2]


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("rows", [6, 3])  # wider than the inputs ([h, 1] built once) and narrower (bias added)
def test_diagonal_preactivation_matches_the_functional_form_and_gradcheck(bias, lead, rows):
    g = _generator()
    h = torch.randn(*lead, 5, 4, generator=g, dtype=DT, requires_grad=True)
    loc = torch.randn(rows, 4 + bias, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.3 * torch.randn(rows, 4 + bias, generator=g, dtype=DT) - 1.0).requires_grad_()
    gamma, xi = diagonal_preactivation(h, loc, log_scale, bias)
    reference = preactivation_moments(augment(h) if bias else h, loc, log_scale.exp())
    torch.testing.assert_close(gamma, reference[0])
    torch.testing.assert_close(xi, reference[1])
    torch.autograd.gradcheck(lambda *a: diagonal_preactivation(*a, bias), (h, loc, log_scale))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_propagated_preactivation_matches_the_unfused_moments_and_gradcheck(bias, lead):
    """Against the full-covariance layer's unfused path (eq. (12) at h = phi plus the inputs'
    spread) with a diagonal Cholesky factor: the same q, a different code path."""
    from cfbnn_cli.bnn.network import GaussianMatrix

    g = _generator(1)
    phi = torch.rand(*lead, 5, 4, generator=g, dtype=DT).requires_grad_()
    variance = (0.5 * torch.rand(*lead, 5, 4, generator=g, dtype=DT)).requires_grad_()
    loc = torch.randn(6, 4 + bias, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.3 * torch.randn(6, 4 + bias, generator=g, dtype=DT) - 1.0).requires_grad_()
    gamma, xi = propagated_preactivation(phi, variance, loc, log_scale, bias)
    full = GaussianMatrix(6, 4 + bias, "full", bias=bias).double()
    with torch.no_grad():
        full.loc.copy_(loc)
        full.log_scale.copy_(log_scale)
    reference = full.propagated_preactivation_moments(phi, variance)
    torch.testing.assert_close(gamma, reference[0])
    torch.testing.assert_close(xi, reference[1])
    torch.autograd.gradcheck(lambda *a: propagated_preactivation(*a, bias), (phi, variance, loc, log_scale))


@pytest.mark.parametrize("prior_variance", [1.0, 0.3])
def test_diagonal_kl_matches_the_torch_formula_and_gradcheck(prior_variance):
    """cfbnn::diagonal_kl (a layer's KL under a fixed prior) against bnn.functional's formula."""
    g = _generator(1)
    loc = torch.randn(4, 3, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.5 * torch.randn(4, 3, generator=g, dtype=DT)).requires_grad_()
    torch.testing.assert_close(
        torch.ops.cfbnn.diagonal_kl(loc, log_scale, prior_variance),
        kl_normal_rows(loc, log_scale.exp(), prior_variance**0.5),
    )
    torch.autograd.gradcheck(lambda m, s: torch.ops.cfbnn.diagonal_kl(m, s, prior_variance), (loc, log_scale))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("outputs, lead", [(1, ()), (3, ()), (2, (4,))])
def test_normal_ell_given_hidden_matches_the_functional_form_and_gradcheck(bias, outputs, lead):
    g = _generator(2)
    phi = torch.rand(*lead, 5, 6, generator=g, dtype=DT, requires_grad=True)
    variance = (0.2 * torch.rand(*lead, 5, 6, generator=g, dtype=DT)).requires_grad_()
    loc = torch.randn(outputs, 6 + bias, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.3 * torch.randn(outputs, 6 + bias, generator=g, dtype=DT) - 1).requires_grad_()
    y = torch.randn(*lead, 5, outputs, generator=g, dtype=DT)
    log_precision = torch.tensor(0.4, dtype=DT, requires_grad=True)
    ell = fused.normal_ell_given_hidden(phi, variance, loc, log_scale, y, log_precision, bias)
    hidden_phi = augment(phi) if bias else phi
    hidden_var = torch.cat([variance, torch.zeros_like(variance[..., :1])], -1) if bias else variance
    mean, var_a, var_b = output_moments_given_hidden(hidden_phi, hidden_var, loc, log_scale.exp())
    beta = log_precision.exp()
    reference = (
        -0.5 * beta * ((y - mean) ** 2 + var_a + var_b)
        + 0.5 * (log_precision - torch.log(torch.tensor(2 * torch.pi, dtype=DT)))
    ).sum(-1)
    torch.testing.assert_close(ell, reference)
    torch.autograd.gradcheck(
        lambda *a: fused.normal_ell_given_hidden(*a[:4], y, a[4], bias), (phi, variance, loc, log_scale, log_precision)
    )


def test_the_fused_functions_work_under_vmap_of_grad():
    """The gradient-variance measurement draws per-sample gradients with vmap(grad(...))."""
    g = _generator(3)
    h = torch.randn(5, 4, generator=g, dtype=DT)
    loc = torch.randn(6, 5, generator=g, dtype=DT)
    log_scale = torch.full((6, 5), -1.0, dtype=DT)
    out_loc, out_log_scale = torch.randn(1, 7, generator=g, dtype=DT), torch.full((1, 7), -1.0, dtype=DT)
    y = torch.randn(5, 1, generator=g, dtype=DT)
    noise = torch.randn(8, 5, 6, generator=g, dtype=DT)

    def loss(loc, eps):
        gamma, xi = diagonal_preactivation(h, loc, log_scale)
        z = torch.relu(gamma + xi * eps)
        ell = fused.normal_ell_given_hidden(
            z, torch.zeros_like(z), out_loc, out_log_scale, y, torch.tensor(0.0, dtype=DT)
        )
        return ell.sum() - kl_normal_rows(loc, log_scale.exp(), 1.0)

    batched = vmap(grad(loss), in_dims=(None, 0))(loc, noise)
    one_by_one = torch.stack([grad(loss)(loc, noise[i]) for i in range(8)])
    torch.testing.assert_close(batched, one_by_one)


# --------------------------------------------------------------------------- the fused tail and variance forms


def _tail_case(dtype, bias, lead=(), rows=23, width=37, seed=4):
    g = _generator(seed)
    gamma = (2.0 * torch.randn(*lead, rows, width, generator=g, dtype=dtype)).requires_grad_()
    xi2 = (torch.rand(*lead, rows, width, generator=g, dtype=dtype) + 0.05).square().requires_grad_()
    loc = torch.randn(1, width + bias, generator=g, dtype=dtype, requires_grad=True)
    log_scale = (0.3 * torch.randn(1, width + bias, generator=g, dtype=dtype) - 1.0).requires_grad_()
    y = torch.randn(*lead, rows, 1, generator=g, dtype=dtype)
    log_precision = torch.tensor(0.3, dtype=dtype, requires_grad=True)
    return gamma, xi2, loc, log_scale, y, log_precision


def _tail_ell(activation, gamma, xi2, loc, log_scale, y, log_precision, bias=True):
    """The ELL per point through the tail node of the ReLU family (``cfbnn::normal_ell``, on the rows
    of any leading dimensions)."""
    kind, slope = family_of(activation)
    width = gamma.shape[-1]
    ell, _ = torch.ops.cfbnn.normal_ell(
        gamma.reshape(-1, width), xi2.reshape(-1, width), loc, log_scale, y.reshape(-1), log_precision, bias, None,
        kind, slope, False,
    )  # fmt: skip
    return ell.reshape(gamma.shape[:-1])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "relu_squared"])
@pytest.mark.parametrize("bias, lead", [(True, ()), (False, ()), (True, (3,))])
def test_the_fused_tail_matches_the_reference_moments_and_output_layer(dtype, tolerance, activation, bias, lead):
    """The tail node (cfbnn::relu_tail: moments of g, output layer, Normal ELL in one pass) against
    the reference torch moments (the formula the operators are declared with) fed to the unfused
    output layer: values and every gradient."""
    from cfbnn_cli.moments import get_activation

    g_act = get_activation(activation)
    inputs = _tail_case(dtype, bias, lead)
    gamma, xi2, loc, log_scale, y, log_precision = inputs
    ell = _tail_ell(g_act, gamma, xi2, loc, log_scale, y, log_precision, bias)
    loss = ell.sum() + 0.01 * ell.square().sum()  # a non-uniform upstream gradient
    grads = torch.autograd.grad(loss, [gamma, xi2, loc, log_scale, log_precision])
    phi, _, variance = g_act.reference_moments(gamma, xi2.sqrt())
    reference = fused.normal_ell_given_hidden(phi, variance, loc, log_scale, y, log_precision, bias)
    reference_loss = reference.sum() + 0.01 * reference.square().sum()
    reference_grads = torch.autograd.grad(reference_loss, [gamma, xi2, loc, log_scale, log_precision])
    assert ell.shape == lead + (gamma.shape[-2],)
    torch.testing.assert_close(ell, reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())
    for found, expected in zip(grads, reference_grads):
        scale = expected.abs().max().item()
        torch.testing.assert_close(found, expected, rtol=tolerance, atol=tolerance * scale)


def test_the_fused_tail_passes_gradcheck():
    from cfbnn_cli.moments import get_activation

    gamma, xi2, loc, log_scale, y, log_precision = _tail_case(DT, True, rows=5, width=4)
    relu = get_activation("relu")
    torch.autograd.gradcheck(
        lambda *a: _tail_ell(relu, a[0], a[1], a[2], a[3], y, a[4]),
        (gamma, xi2, loc, log_scale, log_precision),
    )


def test_the_fused_tail_is_finite_at_the_extremes_in_float32():
    """Means at +-1e3 and variances from 0 to 1e6: values and gradients stay finite."""
    from cfbnn_cli.moments import get_activation

    gamma, xi2, loc, log_scale, y, log_precision = _tail_case(torch.float32, True, rows=4, width=6)
    with torch.no_grad():
        gamma.copy_(torch.tensor([-1e3, -30.0, 0.0, 1e-3, 30.0, 1e3]).expand(4, 6))
        xi2.copy_(torch.tensor([0.0, 1e-30, 1e-6, 1.0, 1e6]).repeat(5)[:24].reshape(4, 6))
    ell = _tail_ell(get_activation("relu"), gamma, xi2, loc, log_scale, y, log_precision)
    grads = torch.autograd.grad(ell.sum(), [gamma, xi2, loc, log_scale, log_precision])
    assert torch.isfinite(ell).all()
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_the_fused_tail_takes_a_precision_beyond_float64_as_the_reference_path_does():
    """An L-BFGS line search can probe log beta = 800 (exp overflows float64): the fused tail
    must give the reference path's -inf ELL, not raise OverflowError (seen on a 2,000-column
    CSV)."""
    from cfbnn_cli.moments import get_activation

    g_act = get_activation("relu")
    gamma, xi2, loc, log_scale, y, _ = _tail_case(DT, True, rows=5, width=4)
    for log_beta in (700.0, 800.0, 1e6):
        log_precision = torch.tensor(log_beta, dtype=DT)
        ell = _tail_ell(g_act, gamma, xi2, loc, log_scale, y, log_precision)
        phi, _, variance = g_act.reference_moments(gamma, xi2.sqrt())
        reference = fused.normal_ell_given_hidden(phi, variance, loc, log_scale, y, log_precision)
        torch.testing.assert_close(ell, reference)
        assert (ell < -1e100).all()


@pytest.mark.parametrize("bias", [True, False])
def test_the_variance_forms_are_the_squared_standard_deviations_and_pass_gradcheck(bias):
    g = _generator(5)
    h = torch.randn(5, 4, generator=g, dtype=DT, requires_grad=True)
    phi = torch.rand(5, 4, generator=g, dtype=DT).requires_grad_()
    variance = (0.5 * torch.rand(5, 4, generator=g, dtype=DT)).requires_grad_()
    second = (phi.detach() ** 2 + variance.detach()).requires_grad_()
    loc = torch.randn(6, 4 + bias, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.3 * torch.randn(6, 4 + bias, generator=g, dtype=DT) - 1.0).requires_grad_()
    gamma, xi = diagonal_preactivation(h, loc, log_scale, bias)
    gamma2, xi2 = diagonal_preactivation(h, loc, log_scale, bias, True)
    torch.testing.assert_close(gamma2, gamma)
    torch.testing.assert_close(xi2, xi.square())
    torch.autograd.gradcheck(lambda *a: diagonal_preactivation(*a, bias, True), (h, loc, log_scale))
    gamma, xi = propagated_preactivation(phi, variance, loc, log_scale, bias)
    gamma2, xi2 = propagated_preactivation(phi, variance, loc, log_scale, bias, None, True)
    torch.testing.assert_close(gamma2, gamma)
    torch.testing.assert_close(xi2, xi.square())
    torch.autograd.gradcheck(lambda *a: propagated_preactivation(*a, bias, None, True), (phi, variance, loc, log_scale))
    # E[h^2] given: the same moments, and its own gradient
    gamma3, xi3 = propagated_preactivation(phi, variance, loc, log_scale, bias, second_moment=second)
    torch.testing.assert_close(gamma3, gamma)
    torch.testing.assert_close(xi3, xi)
    torch.autograd.gradcheck(
        lambda p, v, s, l, ls: propagated_preactivation(p, v, l, ls, bias, s),
        (phi, variance, second, loc, log_scale),
    )


@pytest.mark.parametrize("outputs", [1, 3])
def test_normal_ell_given_hidden_takes_the_second_moment(outputs):
    g = _generator(6)
    phi = torch.rand(5, 6, generator=g, dtype=DT, requires_grad=True)
    variance = (0.2 * torch.rand(5, 6, generator=g, dtype=DT)).requires_grad_()
    second = (phi.detach() ** 2 + variance.detach()).requires_grad_()
    loc = torch.randn(outputs, 7, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.3 * torch.randn(outputs, 7, generator=g, dtype=DT) - 1).requires_grad_()
    y = torch.randn(5, outputs, generator=g, dtype=DT)
    log_precision = torch.tensor(0.4, dtype=DT, requires_grad=True)
    torch.testing.assert_close(
        fused.normal_ell_given_hidden(phi, variance, loc, log_scale, y, log_precision, True, second),
        fused.normal_ell_given_hidden(phi, variance, loc, log_scale, y, log_precision, True),
    )
    torch.autograd.gradcheck(
        lambda p, v, s, l, ls, lp: fused.normal_ell_given_hidden(p, v, l, ls, y, lp, True, s),
        (phi, variance, second, loc, log_scale, log_precision),
    )


def test_a_layers_kl_under_a_learned_prior_is_differentiable_in_it():
    """Empirical Bayes: a mean-field layer's KL at a prior scale that is a tensor (the reference
    formula from log_scale) against bnn.functional's formula, value and gradients, the prior's too."""
    from cfbnn_cli.bnn.layers import GaussianMatrix

    torch.manual_seed(4)
    layer = GaussianMatrix(6, 5, "diagonal").double()
    with torch.no_grad():
        layer.log_scale.uniform_(-3.0, 0.5)
    prior = torch.tensor(0.7, dtype=DT, requires_grad=True)
    found = layer.kl(prior)
    expected = kl_normal_rows(layer.loc, layer.log_scale.exp(), prior)
    torch.testing.assert_close(found, expected)
    inputs = [prior, layer.loc, layer.log_scale]
    for got, want in zip(torch.autograd.grad(found, inputs), torch.autograd.grad(expected, inputs)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_kl_operator_matches_the_torch_formula_on_a_wide_layer(dtype, tolerance):
    """One pass for the KL's three sums and one for its gradients (the C++ kernels, more than one
    16k chunk) against bnn.functional's formula through autograd."""
    g = _generator(7)
    loc = torch.randn(300, 70, generator=g, dtype=dtype, requires_grad=True)
    log_scale = (0.5 * torch.randn(300, 70, generator=g, dtype=dtype) - 2.0).requires_grad_()
    kl = torch.ops.cfbnn.diagonal_kl(loc, log_scale, 0.7)
    grads = torch.autograd.grad(3.0 * kl, [loc, log_scale])
    reference = kl_normal_rows(loc.double(), log_scale.double().exp(), 0.7**0.5)
    reference_grads = torch.autograd.grad(3.0 * reference, [loc, log_scale])
    torch.testing.assert_close(kl, reference.to(dtype), rtol=tolerance, atol=0.0)
    for found, expected in zip(grads, reference_grads):
        torch.testing.assert_close(found, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize(
    "estimator, prior_scale",
    [("analytic", 1.0), ("deterministic", 1.0), ("deterministic", 0.3), ("integrate_output_layer", 0.3)],
)
def test_the_network_elbo_is_the_same_on_the_fused_nodes_and_layer_by_layer_on_the_reference_kernels(
    estimator, prior_scale
):
    """The fused nodes (variance-form pre-activations, the tail node, the KLs folded into the
    layers' functions, sampled layers included) against the estimator's objective layer by layer
    on the operators' reference kernels, through the whole network, float64."""
    from reference_kernels import reference_kernels

    from cfbnn_cli.bnn.estimators import make_estimator
    from cfbnn_cli.bnn.network import BayesianNetwork

    torch.manual_seed(0)
    network = BayesianNetwork(5, [12, 9], 1, prior_scale=prior_scale).double()
    g = _generator(8)
    x, y = torch.randn(40, 5, generator=g, dtype=DT), torch.randn(40, generator=g, dtype=DT)
    noise = network.sample_noise(40, estimator=estimator, generator=g)
    values = []
    elbo = network.elbo(x, y, num_data=400, estimator=estimator, noise=noise)
    values.append((elbo, torch.autograd.grad(elbo, list(network.parameters()))))
    with reference_kernels():
        elbo = make_estimator(estimator).bind(network, fused=False).elbo(x, y, num_data=400, noise=noise)
        values.append((elbo, torch.autograd.grad(elbo, list(network.parameters()))))
    torch.testing.assert_close(values[0][0], values[1][0], rtol=1e-11, atol=0.0)
    for found, expected in zip(values[0][1], values[1][1]):
        torch.testing.assert_close(found, expected, rtol=1e-9, atol=1e-9 * expected.abs().max().item())


@pytest.mark.parametrize(
    "member", [("relu", 0, {}), ("leaky_relu", 1, {"negative_slope": -0.2}), ("relu_squared", 2, {})]
)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_hidden_moments_from_variances_match_the_reference_moments(dtype, tolerance, member):
    """The deterministic estimator's hidden-layer operator (cfbnn::relu_family_moments from the
    variances: square root inside, d/d variance out) for each member of the family against the
    reference torch moments of (mean, sqrt(variance))."""
    from cfbnn_cli.moments import get_activation

    name, kind, parameters = member
    g_act = get_activation(name, **parameters)
    slope = parameters.get("negative_slope", 0.0)
    from_variance = lambda m, v: torch.ops.cfbnn.relu_family_moments(m, v, kind, slope, True)  # noqa: E731
    gamma, xi2, *_ = _tail_case(dtype, True, lead=(2,), rows=9, width=41)
    weights = [torch.randn(gamma.shape, generator=_generator(9), dtype=dtype) for _ in range(3)]
    found = from_variance(gamma, xi2)
    reference = g_act.reference_moments(gamma, xi2.sqrt())
    for value, expected in zip(found, reference):
        torch.testing.assert_close(value, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    grads = torch.autograd.grad(sum((w * v).sum() for w, v in zip(weights, found)), [gamma, xi2])
    expected_grads = torch.autograd.grad(sum((w * v).sum() for w, v in zip(weights, reference)), [gamma, xi2])
    for found_grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(found_grad, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    # a gradient for one output only (the others None) is the same as zeros for them
    only_phi = torch.autograd.grad((weights[0] * from_variance(gamma, xi2)[0]).sum(), [gamma, xi2])
    expected_phi = torch.autograd.grad((weights[0] * g_act.reference_moments(gamma, xi2.sqrt())[0]).sum(), [gamma, xi2])
    for found_grad, expected in zip(only_phi, expected_phi):
        torch.testing.assert_close(found_grad, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_hidden_moments_from_variances_are_finite_at_the_extremes_and_pass_gradcheck(kind):
    from_variance = lambda m, v: torch.ops.cfbnn.relu_family_moments(m, v, kind, 0.1, True)  # noqa: E731
    mean = torch.tensor([-1e3, -30.0, 0.0, 1e-3, 30.0, 1e3]).repeat(4).requires_grad_()
    variance = torch.tensor([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e-38]).repeat_interleave(4).requires_grad_()
    outputs = from_variance(mean, variance)
    grads = torch.autograd.grad(sum(o.sum() for o in outputs), [mean, variance])
    assert all(torch.isfinite(t).all() for t in (*outputs, *grads))
    g = _generator(10)
    mean64 = torch.randn(3, 5, generator=g, dtype=DT, requires_grad=True)
    variance64 = (torch.rand(3, 5, generator=g, dtype=DT) + 0.1).requires_grad_()
    torch.autograd.gradcheck(from_variance, (mean64, variance64))


# the ELBO as one autograd node on the operators (one hidden layer, two or more)
ONE_NODE = ("normal_elbo", "deep_normal_elbo")


def node_of(value) -> str:
    """The ``cfbnn::`` operator whose autograd node made ``value`` (else the node's class name)."""
    operator = getattr(value.grad_fn, "operator", None)
    return operator.name if operator is not None else type(value.grad_fn).__name__


def _node_by_node_elbo(network, x, y, num_data, estimator, noise=None):
    """The ELBO through the layers' functions one by one (what the single node replaces)."""
    from cfbnn_cli.bnn.estimators import make_estimator

    sink = {} if network.prior != "empirical_bayes" else None  # the KL terms handed over on the way
    ell = make_estimator(estimator).expected_log_likelihood_per_point(network, x, y, noise=noise, kl_sink=sink).sum(-1)
    return num_data / x.shape[-2] * ell - network.kl(folded=sink)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize(
    "hidden, estimator, output_bias",
    [
        ([12, 9], "deterministic", True),
        ([7, 6, 5], "deterministic", False),
        ([12], "analytic", True),
        ([3], "deterministic", True),
    ],
)
def test_the_single_node_elbo_matches_the_node_by_node_route(dtype, tolerance, hidden, estimator, output_bias):
    """The closed-form ELBO as one autograd node on the operators (NormalELBO for one hidden layer,
    DeepNormalELBO for more) against the same layers as separate nodes, value and every gradient
    (the learned noise precision's too); the node-by-node route is itself checked against the
    torch formulas above and against Monte Carlo in tests/bnn/test_deterministic.py."""
    from cfbnn_cli.bnn.network import BayesianNetwork

    torch.manual_seed(3)
    # (a ReLU network takes the operators' route, tests/bnn/test_operator_elbo.py)
    network = BayesianNetwork(5, hidden, 1, activation="leaky_relu", prior_scale=0.7, output_bias=output_bias)
    network = network.to(dtype)
    with torch.no_grad():  # spread the weights' scales so that every term matters
        for layer in network.layers:
            layer.log_scale.add_(torch.rand_like(layer.log_scale))
    g = _generator(11)
    x, y = torch.randn(30, 5, generator=g, dtype=dtype), torch.randn(30, generator=g, dtype=dtype)
    parameters = list(network.parameters())
    single = network.elbo(x, y, num_data=300, estimator=estimator)
    assert node_of(single) == ONE_NODE[min(len(hidden), 2) - 1]
    reference = _node_by_node_elbo(network, x, y, 300, estimator)
    assert node_of(reference) not in ONE_NODE
    torch.testing.assert_close(single, reference, rtol=tolerance, atol=0.0)
    for found, expected in zip(torch.autograd.grad(single, parameters), torch.autograd.grad(reference, parameters)):
        torch.testing.assert_close(
            found, expected, rtol=50 * tolerance, atol=50 * tolerance * expected.abs().max().item()
        )


def test_the_single_node_elbo_passes_gradcheck():
    """Finite differences through the network's one-node ELBO (two hidden layers, float64)."""
    from cfbnn_cli.bnn.network import BayesianNetwork

    torch.manual_seed(12)
    network = BayesianNetwork(3, [3, 4], 1, prior_scale=0.8).double()
    g = _generator(12)
    x, y = torch.randn(6, 3, generator=g, dtype=DT), torch.randn(6, generator=g, dtype=DT)
    parameters = tuple(network.parameters())
    assert node_of(network.elbo(x, y, num_data=60, estimator="deterministic")) in ONE_NODE
    # gradcheck perturbs the parameters in place: the ELBO reads them through the network
    torch.autograd.gradcheck(lambda *p: network.elbo(x, y, num_data=60, estimator="deterministic"), parameters)


def test_the_single_node_elbo_keeps_autograd_semantics():
    """retain_graph gives the same gradients twice; without it a second backward pass is refused;
    a parameter changed in place between the passes is caught (the saved tensors' versions)."""
    from cfbnn_cli.bnn.network import BayesianNetwork

    network = BayesianNetwork(4, [6, 5], 1)
    x, y = torch.randn(10, 4), torch.randn(10)
    elbo = network.elbo(x, y, num_data=None, estimator="deterministic")
    assert node_of(elbo) == ONE_NODE[1]
    first = torch.autograd.grad(elbo, list(network.parameters()), retain_graph=True)
    second = torch.autograd.grad(elbo, list(network.parameters()))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.grad(elbo, list(network.parameters()))
    elbo = network.elbo(x, y, num_data=None, estimator="deterministic")
    with torch.no_grad():
        network.layers[1].loc.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        elbo.backward()


@pytest.mark.parametrize("case", ["empirical_bayes", "sampling", "two_outputs", "deterministic_full", "no_kernels"])
def test_the_single_node_elbo_declines_what_it_does_not_cover(case):
    """Outside its conditions the ELBO goes node by node (the bound objective says why), with the
    same value as the reference."""
    from cfbnn_cli.bnn.estimators import make_estimator
    from cfbnn_cli.bnn.network import BayesianNetwork

    torch.manual_seed(5)
    network = BayesianNetwork(
        4,
        [6, 5],
        2 if case == "two_outputs" else 1,
        activation="hard_sigmoid" if case == "no_kernels" else "leaky_relu",
        prior="empirical_bayes" if case == "empirical_bayes" else "fixed",
    )
    x = torch.randn(10, 4)
    y = torch.randn(*x.shape[:-1], 2) if case == "two_outputs" else torch.randn(x.shape[:-1])
    estimator = case if case in ("sampling", "deterministic_full") else "deterministic"
    assert make_estimator(estimator).bind(network).route.startswith("layer by layer")
    noise = network.sample_noise(10, estimator=estimator, generator=_generator(1))
    elbo = network.elbo(x, y, num_data=100, estimator=estimator, noise=noise)
    assert node_of(elbo) not in ONE_NODE
    # the estimator's own route (deterministic_full: the covariance across units, not the diagonal)
    reference = _node_by_node_elbo(network, x, y, 100, estimator, noise)
    torch.testing.assert_close(elbo, reference, rtol=1e-6, atol=0.0)
    elbo.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in network.parameters())


@pytest.mark.parametrize("hidden", [[6], [6, 5]])
def test_the_single_node_elbo_gives_the_inputs_gradient_and_takes_leading_dimensions(hidden):
    """The whole-ELBO node differentiates in ``x`` too (``x.requires_grad``), and an ``x`` with leading
    dimensions gives one ELBO per leading index (the node on each batch of rows): both as the
    layers one by one give them."""
    from cfbnn_cli.bnn.estimators import make_estimator
    from cfbnn_cli.bnn.network import BayesianNetwork

    torch.manual_seed(5)
    network = BayesianNetwork(4, hidden, 1, activation="leaky_relu").double()
    by_layer = make_estimator("deterministic").bind(network, fused=False)
    x = torch.randn(3, 10, 4, dtype=DT, requires_grad=True)
    y = torch.randn(3, 10, dtype=DT)
    elbo = network.elbo(x, y, num_data=100, estimator="deterministic")
    reference = by_layer.elbo(x, y, num_data=100)
    assert elbo.shape == reference.shape == (3,)
    torch.testing.assert_close(elbo, reference, rtol=1e-12, atol=0.0)
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=DT)
    inputs = [x, *network.parameters()]
    found = torch.autograd.grad((weights * elbo).sum(), inputs)
    expected = torch.autograd.grad((weights * reference).sum(), inputs)
    for got, want in zip(found, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item())
    one = network.elbo(x[0], y[0], num_data=100, estimator="deterministic")
    assert node_of(one) == ONE_NODE[len(hidden) - 1]
    (grad_x,) = torch.autograd.grad(one, [x])
    torch.testing.assert_close(one, reference[0], rtol=1e-12, atol=0.0)
    assert grad_x[1:].abs().max() == 0 and grad_x[0].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(7, 3), (80, 91)])
def test_the_first_layers_augmented_inputs_come_from_one_kernel_pass(dtype, shape):
    """cfbnn::augment_pair's [x, 1] and [x^2, 1] against torch's pad and square, exactly; a
    transposed (non-contiguous) input too."""
    x = torch.randn(*shape, generator=_generator(14), dtype=dtype)
    for given in (x, x.mT.contiguous().mT):
        inputs, squares = torch.ops.cfbnn.augment_pair(given, True)
        expected = torch.nn.functional.pad(x, (0, 1), value=1.0)
        torch.testing.assert_close(inputs, expected, rtol=0.0, atol=0.0)
        torch.testing.assert_close(squares, expected * expected, rtol=0.0, atol=0.0)


def test_a_change_of_the_networks_prior_or_likelihood_binds_the_objective_again():
    """The fused node is chosen once per network, and again when what the choice reads changes: the
    UCI protocol fits under a fixed prior, then sets ``prior = "empirical_bayes"`` (which the
    whole-ELBO node does not fit) and fits on."""
    from cfbnn_cli.bnn.estimators import make_estimator
    from cfbnn_cli.bnn.likelihoods import NormalLikelihood
    from cfbnn_cli.bnn.network import BayesianNetwork

    torch.manual_seed(6)
    network = BayesianNetwork(3, [5], 1).double()
    x, y = torch.randn(8, 3, dtype=DT), torch.randn(8, dtype=DT)
    assert node_of(network.elbo(x, y, num_data=80)) == "normal_elbo"
    network.prior = "empirical_bayes"
    elbo = network.elbo(x, y, num_data=80)
    assert node_of(elbo) not in ONE_NODE
    reference = make_estimator("analytic").bind(network, fused=False).elbo(x, y, num_data=80)
    torch.testing.assert_close(elbo, reference, rtol=1e-12, atol=0.0)
    network.prior = "fixed"
    network.likelihood = NormalLikelihood(precision=3.0).double()
    elbo = network.elbo(x, y, num_data=80)
    assert node_of(elbo) == "normal_elbo"
    reference = make_estimator("analytic").bind(network, fused=False).elbo(x, y, num_data=80)
    torch.testing.assert_close(elbo, reference, rtol=1e-12, atol=0.0)
