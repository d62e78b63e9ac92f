"""The analytic estimator's own ELBO for deeper networks (bound to the network: the earlier layers
sampled, the last two integrated as one node, ``cfbnn::normal_ell``) against its layer-by-layer ELBO
(``bind(network, fused=False)``): the same noise draws, values and gradients, float32 and float64,
for every ReLU-family member, with point layers, leading dimensions and minibatch scaling; and the
networks the node does not fit (they go layer by layer)."""

from __future__ import annotations

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.estimators import ClosedForm
from cfbnn_cli.bnn.likelihoods import NormalLikelihood

MEMBERS = [("relu", {}), ("leaky_relu", {"negative_slope": -0.2}), ("relu_squared", {})]


def _network(dtype, activation="relu", hidden=(9, 7), **options):
    generator = torch.Generator().manual_seed(3)
    likelihood = NormalLikelihood(precision=2.0, learn=True)
    net = BayesianNetwork(
        5, list(hidden), 1, activation=activation, generator=generator, likelihood=likelihood, **options
    )
    for parameter in net.parameters():  # spread the means and scales away from their start
        with torch.no_grad():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return net.to(dtype)


def _elbo_and_gradients(net, elbo):
    value = elbo()
    return (value.detach(), *torch.autograd.grad(value.sum(), list(net.parameters())))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("member", MEMBERS, ids=[name for name, _ in MEMBERS])
@pytest.mark.parametrize("case", ["plain", "lead", "point_layer", "three_hidden"])
def test_the_tail_node_elbo_is_the_layer_by_layer_elbo(dtype, tolerance, member, case):
    name, parameters = member
    from cfbnn_cli.moments import get_activation

    activation = get_activation(name, **parameters)
    options = {"point_layers": 1} if case == "point_layer" else {}
    hidden = (9, 8, 7) if case in ("three_hidden", "point_layer") else (9, 7)
    net = _network(dtype, activation, hidden, **options)
    g = torch.Generator().manual_seed(4)
    lead = (2,) if case == "lead" else ()
    x = torch.randn(*lead, 11, 5, generator=g).to(dtype)
    y = torch.randn(*lead, 11, generator=g).to(dtype)
    estimator = ClosedForm()
    noise = estimator.sample_noise(net, 11, generator=torch.Generator().manual_seed(5), lead=lead)
    assert noise, "the case samples a layer"
    assert "the tail as one node (cfbnn::normal_ell)" in estimator.bind(net).route
    by_layer = estimator.bind(net, fused=False)
    got = _elbo_and_gradients(net, lambda: net.elbo(x, y, num_data=40, estimator=estimator, noise=noise))
    want = _elbo_and_gradients(net, lambda: by_layer.elbo(x, y, num_data=40, noise=noise))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * max(1.0, float(b.abs().max())))


def test_drawn_noise_is_the_layer_by_layer_draw():
    """noise=None: the same generator gives the same draws, so the same ELBO, either way."""
    net = _network(torch.float64)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(13, 5, generator=g, dtype=torch.float64), torch.randn(13, generator=g, dtype=torch.float64)
    estimator = ClosedForm()
    got = net.elbo(x, y, estimator=estimator, generator=torch.Generator().manual_seed(7))
    want = estimator.bind(net, fused=False).elbo(x, y, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    other = net.elbo(x, y, estimator=estimator, generator=torch.Generator().manual_seed(8))
    assert not torch.allclose(got, other)  # (the draw matters: the comparison above is not vacuous)


@pytest.mark.parametrize(
    "options",
    [
        {"prior": "empirical_bayes"},  # the KL's prior depends on q: nothing folded
        {"activation": "hard_sigmoid"},  # no kernel-backed tail
        {"output_dim": 2},  # more than one output
        {"covariance": "full"},  # a layer without a diagonal q
    ],
    ids=["empirical_bayes", "hard_sigmoid", "two_outputs", "full_covariance"],
)
def test_networks_the_node_does_not_take_go_layer_by_layer(options):
    """The same ELBO as layer by layer where the tail node does not fit (or, under empirical Bayes, fits
    without the KL)."""
    generator = torch.Generator().manual_seed(9)
    net = BayesianNetwork(5, [9, 7], generator=generator, **options).double()
    g = torch.Generator().manual_seed(10)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(8, net.output_dim, generator=g, dtype=torch.float64)
    y = y.squeeze(-1) if net.output_dim == 1 else y
    estimator = ClosedForm()
    noise = estimator.sample_noise(net, 8, generator=torch.Generator().manual_seed(11))
    route = estimator.bind(net).route
    # empirical Bayes: the tail node computes the ELL, the KL (differentiable in the prior) is outside it
    tail = "prior" in options
    assert route.startswith("layer by layer") and ("the tail as one node" in route) == tail, route
    got = net.elbo(x, y, estimator=estimator, noise=noise)
    torch.testing.assert_close(got, estimator.bind(net, fused=False).elbo(x, y, noise=noise))
