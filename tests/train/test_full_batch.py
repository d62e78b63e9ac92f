"""Full-batch L-BFGS to convergence (train/full_batch.py)."""

import pytest
import torch

from cfbnn_cli.runtime.numerics import NonFiniteLossError
from cfbnn_cli.train.full_batch import minimize_full_batch


def test_converges_to_the_minimum_of_a_quadratic():
    target = torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64)
    x = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    result = minimize_full_batch(lambda: ((x - target) ** 2 * torch.tensor([1.0, 10.0, 100.0])).sum(), [x])
    assert result.converged
    torch.testing.assert_close(x.detach(), target, atol=1e-6, rtol=0)


def test_a_line_search_step_into_overflow_backtracks_instead_of_failing():
    """exp(40 x) overflows float32 beyond x ~ 2.2: a first step that lands there is rejected."""
    x = torch.nn.Parameter(torch.tensor([-3.0]))

    def objective():  # minimum at x = log(1/40)/40 ~ -0.092, huge slope to the right of it
        return (torch.exp(40 * x) - x).sum()

    result = minimize_full_batch(objective, [x], max_iterations=200)
    assert result.converged and torch.isfinite(torch.tensor(result.objective))
    assert float(x.detach()) == pytest.approx(torch.log(torch.tensor(1 / 40.0)).item() / 40, abs=1e-4)


def test_a_non_finite_start_is_an_error_naming_the_objective():
    x = torch.nn.Parameter(torch.tensor([float("nan")]))
    with pytest.raises(NonFiniteLossError, match="toy objective"):
        minimize_full_batch(lambda: (x**2).sum(), [x], label="toy objective")
