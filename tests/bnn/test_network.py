"""bnn/network.py: the one network against weight-space Monte Carlo, its estimators, its modules.

The reference (:func:`weight_space_outputs`) samples every weight matrix from q and runs
the network forward: an independent code path from the moment formulas and from local
reparameterization. Tolerances are a few standard errors of the Monte Carlo mean.
"""

import math

import pytest
import torch
from torch.func import functional_call, grad, vmap

from cfbnn_cli.bnn import (
    BayesianNetwork,
    ClosedFormBNN,
    GaussianMatrix,
    NormalLikelihood,
    PointLinear,
    bayesian_head,
    cached_weights,
)
from cfbnn_cli.runtime.numerics import NonFiniteLossError, ensure_finite

DT = torch.float64


def weight_space_outputs(network, x, num_samples, generator):
    """Outputs ``(S, N[, O])`` with every Gaussian weight matrix sampled whole from q."""
    h = x.expand(num_samples, *x.shape)
    for index, layer in enumerate(network.layers):
        if isinstance(layer, PointLinear):
            z = layer(h)
        else:
            eps = torch.randn((num_samples,) + layer.loc.shape, generator=generator, dtype=layer.loc.dtype)
            scale = layer.scale()
            if layer.covariance == "full":
                weights = layer.loc + torch.einsum("rcd,srd->src", scale, eps)
            elif layer.covariance == "lowrank":  # Sigma_r = diag(d_r^2) + U_r U_r^T
                low = torch.randn(
                    (num_samples, layer.loc.shape[0], scale.factor.shape[-1]),
                    generator=generator,
                    dtype=layer.loc.dtype,
                )
                weights = layer.loc + scale.diag * eps + torch.einsum("rck,srk->src", scale.factor, low)
            else:
                weights = layer.loc + scale * eps
            inputs = torch.cat([h, torch.ones_like(h[..., :1])], -1) if layer.bias else h
            z = inputs @ weights.transpose(-1, -2)
        h = z if index == len(network.layers) - 1 else network.activation(z)
    return h[..., 0] if network.output_dim == 1 else h


def _normal_ell(y, outputs, precision):
    """``sum_n log N(y_n | output, 1/beta)`` per sample."""
    per = -0.5 * precision * (y - outputs).square() + 0.5 * (math.log(precision) - math.log(2 * math.pi))
    return per.reshape(per.shape[0], -1).sum(-1)


def _within(value, samples, n_se=4.0):
    se = samples.std().item() / math.sqrt(samples.numel())
    assert abs(value - samples.mean().item()) <= n_se * se, (value, samples.mean().item(), se)


def _wide(network, scale=0.35, seed=0):
    """Spread the posterior (and the off-diagonals) so that the checks have teeth."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in network.gaussian_layers:
            layer.log_scale.copy_(torch.log(scale * (0.5 + torch.rand(layer.log_scale.shape, generator=g, dtype=DT))))
            if layer.covariance == "full":
                layer.off_diagonal.copy_(0.1 * torch.randn(layer.off_diagonal.shape, generator=g, dtype=DT))
            if layer.covariance == "lowrank":
                layer.factor.copy_(0.2 * torch.randn(layer.factor.shape, generator=g, dtype=DT))
    return network


@pytest.mark.parametrize("a_cov, b_cov", [("diagonal", "diagonal"), ("full", "full"), ("lowrank", "diagonal")])
@pytest.mark.parametrize("output_bias", [True, False])
def test_one_hidden_layer_ell_and_predictive_match_weight_space_monte_carlo(a_cov, b_cov, output_bias):
    torch.manual_seed(0)
    model = _wide(
        ClosedFormBNN(
            3,
            5,
            a_covariance=a_cov,
            b_covariance=b_cov,
            rank=2,
            precision=1.7,
            output_bias=output_bias,
            generator=torch.Generator().manual_seed(1),
        ).double()
    )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, generator=g, dtype=DT)
    y = torch.randn(6, generator=g, dtype=DT)
    with torch.no_grad():
        exact = model.expected_log_likelihood(x, y).item()
        mean, var_a, var_b, noise = model.predictive(x)
        outputs = weight_space_outputs(model, x, 200_000, torch.Generator().manual_seed(3))
    _within(exact, _normal_ell(y, outputs, 1.7))
    for n in range(6):
        _within(mean[n].item(), outputs[:, n])
        _within((var_a[n] + var_b[n]).item(), (outputs[:, n] - mean[n]) ** 2)
    assert float(noise) == pytest.approx(1 / 1.7)


@pytest.mark.parametrize("estimator", ["analytic", "integrate_output_layer", "sampling"])
def test_every_estimator_of_a_deeper_network_is_unbiased_for_the_weight_space_ell(estimator):
    """3-4-4-2 network: each estimator's mean over its noise equals the weight-space ELL."""
    model = _wide(
        BayesianNetwork(
            3, [4, 4], 2, likelihood=NormalLikelihood(0.9, learn=False), generator=torch.Generator().manual_seed(4)
        ).double()
    )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, generator=g, dtype=DT)
    y = torch.randn(5, 2, generator=g, dtype=DT)
    with torch.no_grad():
        truth = _normal_ell(y, weight_space_outputs(model, x, 200_000, torch.Generator().manual_seed(6)), 0.9)
        noise = model.sample_noise(
            5, estimator=estimator, generator=torch.Generator().manual_seed(7), num_samples=20_000
        )
        estimates = model.expected_log_likelihood(x.expand(20_000, 5, 3), y, estimator=estimator, noise=noise)
    assert estimates.shape == (20_000,)
    se = math.sqrt(estimates.var().item() / estimates.numel() + truth.var().item() / truth.numel())
    assert abs(estimates.mean().item() - truth.mean().item()) < 4 * se
    if estimator == "analytic":  # integrating two layers removes variance
        assert estimates.var() < 0.5 * truth.var()


def test_one_hidden_layer_analytic_path_samples_nothing_and_its_gradient_is_the_mean_monte_carlo_gradient():
    torch.manual_seed(0)
    model = BayesianNetwork(3, [6], init_scale=0.3, generator=torch.Generator().manual_seed(0)).double()
    assert model.noise_shapes(10, estimator="analytic") == ()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 3, generator=g, dtype=DT)
    y = torch.randn(10, generator=g, dtype=DT)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def ell(p, estimator, noise):
        return functional_call(model, p, (x, y), {"estimator": estimator, "noise": noise})

    exact = grad(ell)(params, "analytic", ())
    again = grad(ell)(params, "analytic", ())
    for name in exact:  # deterministic: nothing is sampled
        torch.testing.assert_close(exact[name], again[name], rtol=0, atol=0)
    per_sample = vmap(grad(lambda p, noise: ell(p, "sampling", noise)), in_dims=(None, 0))
    draws = [
        per_sample(params, model.sample_noise(10, estimator="sampling", generator=g, num_samples=20_000))
        for _ in range(10)
    ]
    for name in exact:
        samples = torch.cat([d[name] for d in draws])
        standard_error = samples.std(0) / math.sqrt(samples.shape[0])
        z = ((exact[name] - samples.mean(0)).abs() / standard_error.clamp(min=1e-12)).max()
        assert z < 4.5, (name, float(z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_output_mean_is_the_mean_of_sampled_logits(dtype):
    """``output_mean`` (prediction's mean-only kernel, cached variances) of the Figure 1 head
    (a point layer first) against 2^17 sampled logits, within 5 standard errors."""
    torch.manual_seed(0)
    head = bayesian_head(6, [16, 16], 5, init_scale=0.5).to(dtype)
    x = torch.randn(8, 6, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mean = head.output_mean(x)
        draws = torch.cat([head.sample_outputs(x, 8192, generator=generator).double() for _ in range(16)])
    sample_mean, standard_error = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    assert mean.dtype == dtype and mean.shape == (8, 5)
    assert float(standard_error.min()) > 0  # the posterior is wide: the check has teeth
    assert ((mean.double() - sample_mean).abs() <= 5 * standard_error).all()
    # the same mean as the training path's moments (autograd kernel, variances recomputed)
    torch.testing.assert_close(mean, head.output_moments(x)[0].detach())
    assert not any("precision" in name for name, _ in head.named_parameters())  # no meaningless noise parameter


def test_a_network_of_point_layers_is_a_plain_mlp():
    torch.manual_seed(0)
    network = BayesianNetwork(4, [8], 2, point_layers=2)
    x = torch.randn(3, 4)
    first, second = network.layers
    torch.testing.assert_close(network.output_mean(x), second(torch.relu(first(x))))
    mean, variance = network.output_moments(x, estimator="sampling")
    assert (variance == 0).all() and float(network.kl()) == 0.0
    assert network.noise_shapes(3, estimator="sampling") == ()


@pytest.mark.parametrize("a_cov", ["diagonal", "full", "lowrank"])
@pytest.mark.parametrize("b_cov", ["diagonal", "full"])
def test_minibatch_elbo_is_unbiased_for_full_batch(a_cov, b_cov):
    torch.manual_seed(0)
    model = ClosedFormBNN(3, 8, a_covariance=a_cov, b_covariance=b_cov, rank=2).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, generator=g, dtype=DT)
    y = torch.randn(12, generator=g, dtype=DT)
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
    with pytest.raises(ValueError, match="estimator"):
        BayesianNetwork(2, [3]).treatments("gibbs")
    with pytest.raises(ValueError, match="point_layers"):
        BayesianNetwork(2, [3], point_layers=3)
    with pytest.raises(ValueError, match="one entry per Gaussian layer"):
        BayesianNetwork(2, [3], covariance=["full"])


def test_layer_names_for_any_depth():
    assert BayesianNetwork(2, [3, 3]).layer_names() == ["first", "second", "final"]
    names = BayesianNetwork(2, [3] * 11).layer_names()
    assert names[:2] == ["first", "second"] and names[9:] == ["layer 10", "layer 11", "final"]


def test_gaussian_matrix_loc_and_variance_is_cached_only_while_the_parameters_stay_put():
    """Inside cached_weights(), prediction reuses ``loc_and_variance()`` across batches; any change
    of a parameter must show. Outside, nothing is cached: an edit through ``.data`` (no new
    version) shows too."""
    matrix = GaussianMatrix(4, 3, init_scale=0.5, generator=torch.Generator().manual_seed(0))

    def expected():
        return torch.stack([matrix.loc, matrix.log_scale.exp() ** 2]).detach()

    with torch.no_grad():
        outside = matrix.loc_and_variance()
        assert matrix.loc_and_variance() is not outside
        matrix.loc.data.mul_(3.0)  # invisible to a version-keyed cache
        torch.testing.assert_close(matrix.loc_and_variance(), expected())
    with torch.no_grad(), cached_weights():
        first = matrix.loc_and_variance()
        assert matrix.loc_and_variance() is first  # reused, not recomputed
        torch.testing.assert_close(first, expected())
    with cached_weights():
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


def test_closed_form_bnn_takes_likelihood_objects_like_every_network():
    """An object and its name build the same model (the name is the config's shorthand)."""
    from cfbnn_cli.bnn import CategoricalLikelihood, NormalLikelihood

    torch.manual_seed(0)
    x, y = torch.randn(7, 3), torch.randn(7)
    by_object = ClosedFormBNN(
        3, 8, likelihood=NormalLikelihood(precision=4.0, learn=False), generator=torch.Generator().manual_seed(1)
    )
    by_name = ClosedFormBNN(
        3, 8, likelihood="normal", precision=4.0, learn_precision=False, generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(by_object.elbo(x, y, num_data=7), by_name.elbo(x, y, num_data=7))
    labels = torch.randint(0, 4, (7,))
    softmax = ClosedFormBNN(3, 8, 4, likelihood=CategoricalLikelihood("control_variate"))
    assert torch.isfinite(softmax.elbo(x, labels, num_data=7, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="logistic"):
        ClosedFormBNN(3, 8, 2, likelihood=CategoricalLikelihood(logistic=True))
    with pytest.raises(ValueError, match="NormalLikelihood or CategoricalLikelihood"):
        ClosedFormBNN(3, 8, likelihood=torch.nn.Identity())
