"""bnn/fused.py: the hot path's hand-written backward passes against autograd of the plain
torch formulas (bnn/functional.py) and against finite differences (gradcheck), in float64."""

import pytest
import torch
from torch.func import grad, vmap

from cfbnn_cli.bnn import fused
from cfbnn_cli.bnn.functional import augment, kl_normal_rows, output_moments_given_hidden, preactivation_moments

DT = torch.float64


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_diagonal_preactivation_matches_the_functional_form_and_gradcheck(bias, lead):
    g = _generator()
    h = torch.randn(*lead, 5, 4, generator=g, dtype=DT, requires_grad=True)
    loc = torch.randn(6, 4 + bias, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.3 * torch.randn(6, 4 + bias, generator=g, dtype=DT) - 1.0).requires_grad_()
    gamma, xi = fused.diagonal_preactivation(h, loc, log_scale, bias)
    reference = preactivation_moments(augment(h) if bias else h, loc, log_scale.exp())
    torch.testing.assert_close(gamma, reference[0])
    torch.testing.assert_close(xi, reference[1])
    torch.autograd.gradcheck(lambda *a: fused.diagonal_preactivation(*a, bias), (h, loc, log_scale))


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
    gamma, xi = fused.propagated_preactivation(phi, variance, loc, log_scale, bias)
    full = GaussianMatrix(6, 4 + bias, "full", bias=bias).double()
    with torch.no_grad():
        full.loc.copy_(loc)
        full.log_scale.copy_(log_scale)
    reference = full.propagated_preactivation_moments(phi, variance)
    torch.testing.assert_close(gamma, reference[0])
    torch.testing.assert_close(xi, reference[1])
    torch.autograd.gradcheck(lambda *a: fused.propagated_preactivation(*a, bias), (phi, variance, loc, log_scale))


@pytest.mark.parametrize("prior_variance", [1.0, 0.3])
def test_diagonal_kl_matches_torch_distributions_and_gradcheck(prior_variance):
    g = _generator(1)
    loc = torch.randn(4, 3, generator=g, dtype=DT, requires_grad=True)
    log_scale = (0.5 * torch.randn(4, 3, generator=g, dtype=DT)).requires_grad_()
    prior = torch.tensor(prior_variance, dtype=DT, requires_grad=True)
    torch.testing.assert_close(fused.diagonal_kl(loc, log_scale, prior),
                               kl_normal_rows(loc, log_scale.exp(), prior.sqrt()))
    torch.autograd.gradcheck(fused.diagonal_kl, (loc, log_scale, prior))


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
    reference = (-0.5 * beta * ((y - mean) ** 2 + var_a + var_b) + 0.5 * (log_precision - torch.log(
        torch.tensor(2 * torch.pi, dtype=DT)))).sum(-1)
    torch.testing.assert_close(ell, reference)
    torch.autograd.gradcheck(lambda *a: fused.normal_ell_given_hidden(*a[:4], y, a[4], bias),
                             (phi, variance, loc, log_scale, log_precision))


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
        gamma, xi = fused.diagonal_preactivation(h, loc, log_scale)
        z = torch.relu(gamma + xi * eps)
        ell = fused.normal_ell_given_hidden(z, torch.zeros_like(z), out_loc, out_log_scale, y, torch.tensor(0.0, dtype=DT))
        return ell.sum() - fused.diagonal_kl(loc, log_scale, 1.0)

    batched = vmap(grad(loss), in_dims=(None, 0))(loc, noise)
    one_by_one = torch.stack([grad(loss)(loc, noise[i]) for i in range(8)])
    torch.testing.assert_close(batched, one_by_one)
