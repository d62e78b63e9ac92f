"""Second derivatives of the ELBO: the closed-form ELBO's nodes have written-out backward passes
(first derivatives only), so differentiating their gradients (a graph of them taken with
``create_graph=True``, then a Hessian-vector product) raises, on the C++ kernels and on the reference
kernels alike, instead of leaving their part of a second derivative out. torch's
``once_differentiable`` would leave it out silently when the differentiated sum also holds other
terms: with the penalty below, a Hessian-vector product then came out wrong by up to 10^4 with no
error."""

import contextlib

import pytest
import torch
from reference_kernels import reference_kernels

from cfbnn_cli.bnn import BayesianNetwork


@pytest.mark.parametrize("fast", [True, False], ids=["cpp", "reference"])
@pytest.mark.parametrize("hidden", [[6], [6, 5]])
@pytest.mark.parametrize("estimator", ["analytic", "deterministic", "sampling"])
def test_a_graph_of_the_gradients_is_refused_never_silently_incomplete(fast, hidden, estimator):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    y = torch.randn(30, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    net = BayesianNetwork(4, hidden).double()
    params = [p for p in net.parameters() if p.requires_grad]
    with contextlib.nullcontext() if fast else reference_kernels():
        penalty = sum((p**3).sum() for p in params)  # a second term, whose own graph would survive
        objective = net.elbo(x, y, num_data=90, estimator=estimator) - 1e-3 * penalty
        graph = torch.autograd.grad(objective, params, create_graph=True)
        direction = [torch.ones_like(p) for p in params]
        with pytest.raises(RuntimeError, match="has first derivatives only: second derivatives"):
            torch.autograd.grad(sum((g * d).sum() for g, d in zip(graph, direction)), params)
        gradients = torch.autograd.grad(objective, params)  # first derivatives as usual
    assert all(torch.isfinite(gradient).all() for gradient in gradients)
