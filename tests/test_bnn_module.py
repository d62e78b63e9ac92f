"""ClosedFormBNN: minibatch scaling, learned precision, predictive decomposition, NaN check."""


import pytest
import torch

from cfbnn_cli.bnn import ClosedFormBNN
from cfbnn_cli.runtime.numerics import NonFiniteLossError, ensure_finite


@pytest.mark.parametrize("a_cov", ["diagonal", "full", "lowrank"])
@pytest.mark.parametrize("b_cov", ["diagonal", "full"])
def test_minibatch_elbo_is_unbiased_for_full_batch(a_cov, b_cov):
    torch.manual_seed(0)
    model = ClosedFormBNN(3, 8, a_covariance=a_cov, b_covariance=b_cov, rank=2).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, generator=g, dtype=torch.float64)
    y = torch.randn(12, generator=g, dtype=torch.float64)
    full = model.elbo(x, y)
    halves = [model.elbo(x[i : i + 6], y[i : i + 6], num_data=12) for i in (0, 6)]
    torch.testing.assert_close(sum(halves) / 2, full)


def test_predictive_three_way_decomposition_and_training():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    x = torch.rand(300, 1, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(300, generator=g)
    model = ClosedFormBNN(1, 32, init_scale=0.05, precision=1.0, learn_precision=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for step in range(400):
        opt.zero_grad()
        loss = -model.elbo(x, y)
        ensure_finite(loss, epoch=0, step=step)
        loss.backward()
        opt.step()
    mean, var_a, var_b, noise = model.predictive(x)
    rmse = (mean - y).pow(2).mean().sqrt().item()
    assert rmse < 0.3
    assert (var_a >= 0).all() and (var_b >= 0).all()
    # the learned noise variance approaches the true 0.01 from above
    assert 0.005 < noise.item() < 0.1


def test_ensure_finite_names_epoch_and_step():
    ensure_finite(torch.tensor(1.0))
    with pytest.raises(NonFiniteLossError, match="epoch 3, step 17"):
        ensure_finite(torch.tensor(float("nan")), epoch=3, step=17)


def test_module_bad_arguments():
    with pytest.raises(ValueError, match="likelihood"):
        ClosedFormBNN(2, 3, likelihood="poisson")
    with pytest.raises(ValueError, match="prior_scale"):
        ClosedFormBNN(2, 3, prior_scale=0.0)
    with pytest.raises(ValueError, match="precision"):
        ClosedFormBNN(2, 3, precision=-1.0)
    with pytest.raises(ValueError, match="b_covariance"):
        ClosedFormBNN(2, 3, b_covariance="lowrank")


def test_gaussian_matrix_loc_and_variance_is_cached_only_while_the_parameters_stay_put():
    """Prediction reuses ``loc_and_variance()`` across batches; any change of a parameter must show."""
    from cfbnn_cli.bnn.layers import GaussianMatrix

    matrix = GaussianMatrix(4, 3, init_scale=0.5, generator=torch.Generator().manual_seed(0))

    def expected():
        return torch.stack([matrix.loc, matrix.log_scale.exp() ** 2]).detach()

    with torch.no_grad():
        first = matrix.loc_and_variance()
        assert matrix.loc_and_variance() is first  # reused, not recomputed
        torch.testing.assert_close(first, expected())
    optimizer = torch.optim.SGD(matrix.parameters(), lr=0.1)
    with_grad = matrix.loc_and_variance()
    assert with_grad.requires_grad  # with autograd on: a fresh, differentiable value
    (with_grad[0].sum() + with_grad[1].sum()).backward()
    assert matrix.loc.grad is not None and matrix.log_scale.grad is not None
    optimizer.step()
    with torch.no_grad():
        stepped = matrix.loc_and_variance()
        torch.testing.assert_close(stepped, expected())
        assert not torch.allclose(stepped, first)
    state = {k: v.clone() for k, v in matrix.state_dict().items()}
    state["log_scale"].fill_(0.0)
    matrix.load_state_dict(state)
    with torch.inference_mode():
        torch.testing.assert_close(matrix.loc_and_variance()[1], torch.ones(4, 3))
    with torch.no_grad():
        matrix.loc.add_(1.0)  # an in-place change of the means alone
        torch.testing.assert_close(matrix.loc_and_variance(), expected())
    matrix.double()
    with torch.no_grad():
        assert matrix.loc_and_variance().dtype == torch.float64
    with pytest.raises(ValueError, match="diagonal"):
        GaussianMatrix(2, 2, covariance="full").loc_and_variance()


def test_diagonal_preactivation_moments_names_a_bad_shape():
    from cfbnn_cli.bnn.functional import diagonal_preactivation_moments

    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"\(2, H, D\) \(means, variances\); got \(4, 3\)"):
        diagonal_preactivation_moments(x, torch.ones(4, 3))
    with pytest.raises(ValueError, match="`x` must be"):
        diagonal_preactivation_moments(torch.randn(5, 2), torch.ones(2, 4, 3))
