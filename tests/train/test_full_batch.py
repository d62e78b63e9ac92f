"""Full-batch L-BFGS to convergence (train/full_batch.py)."""

import pytest
import torch

from cfbnn_cli.runtime.numerics import NonFiniteLossError
from cfbnn_cli.train.full_batch import FullBatchMinimizer, FullBatchResult, minimize_full_batch, minimize_with_polish


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


class _WrongSlope(torch.autograd.Function):
    """``sum(x^2)`` whose backward returns a gradient that points the wrong way along one axis: the
    line search is told a direction descends that does not, as a gradient bug would tell it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x * x).sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        slope = 2 * x
        slope[0] = -slope[0]
        return grad * slope


def test_a_line_search_that_finds_no_lower_point_is_not_called_converged():
    x = torch.nn.Parameter(torch.tensor([3.0, 0.0], dtype=torch.float64))
    result = minimize_full_batch(lambda: _WrongSlope.apply(x), [x], max_iterations=500)
    assert result.stop == "line_search" and not result.converged
    assert "NOT converged" in result.describe() and result.gradient == pytest.approx(6.0)
    assert float(x.detach()[0]) == pytest.approx(3.0)  # it went nowhere


def test_a_float32_objective_at_its_rounding_converges_to_its_precision_not_by_failure():
    """float32 cannot resolve the last digits of the decrease: the search stalls at the optimum, and
    no step could gain more than the rounding (the L-BFGS curvature estimate says so)."""
    target = torch.tensor([0.3, -1.7, 2.2])
    weights = torch.tensor([1.0, 30.0, 900.0])
    x = torch.nn.Parameter(torch.zeros(3))
    result = minimize_full_batch(lambda: ((x - target).square() * weights).sum() + 1.0, [x])
    assert result.converged and result.stop in ("gradient", "objective", "precision"), result
    torch.testing.assert_close(x.detach(), target, atol=2e-3, rtol=0)


def test_a_run_restored_from_its_state_continues_as_the_uninterrupted_run():
    """The state after some rounds (the parameters, FullBatchMinimizer.state_dict) restored into a
    fresh minimizer gives the same iterates bit for bit, and the same stop."""
    torch.manual_seed(0)
    a = torch.randn(40, 6, dtype=torch.float64)
    b = torch.randn(40, dtype=torch.float64)

    def problem():
        w = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
        return w, lambda: torch.nn.functional.softplus(a @ w - b).square().mean() + 1e-3 * w.square().sum()

    w, objective = problem()
    whole = FullBatchMinimizer(objective, [w], round_iterations=3, rtol=1e-12)
    result = whole.run()
    assert result.iterations > 9  # several rounds, so the interruption below falls mid-run

    w2, objective2 = problem()
    first = FullBatchMinimizer(objective2, [w2], round_iterations=3, rtol=1e-12)

    class Stop(Exception):
        pass

    rounds = []

    def stop_after_two(done):
        rounds.append(done.iterations)
        if len(rounds) == 2:
            raise Stop

    with pytest.raises(Stop):
        first.run(on_round=stop_after_two)
    saved_w, saved_state = w2.detach().clone(), first.state_dict()
    w3, objective3 = problem()
    with torch.no_grad():
        w3.copy_(saved_w)
    resumed = FullBatchMinimizer(objective3, [w3], round_iterations=3, rtol=1e-12)
    resumed.load_state_dict(saved_state)
    again = resumed.run()
    assert torch.equal(w3.detach(), w.detach())
    assert (again.iterations, again.stop, again.objective) == (result.iterations, result.stop, result.objective)


def test_a_float32_stall_is_polished_in_float64_and_the_model_is_float32_again():
    """Where the float32 stage stops because its line search stalled, the run goes on in float64
    from there (the parameters float64 during that stage only), within the iterations left."""
    torch.manual_seed(1)
    x = torch.randn(50, 3)
    y = torch.sin(x[:, 0])
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    stages = []

    def objective_in(dtype):
        xs, ys = x.to(dtype), y.to(dtype)
        return lambda: (model(xs).squeeze(-1) - ys).square().mean()

    def run_stage(minimizer, stage):
        stages.append((stage, next(model.parameters()).dtype, minimizer.max_iterations))
        if not stage:  # the float32 stage, as if its line search had stalled after 40 iterations
            return FullBatchResult(0.5, 40, 50, 0.1, False, "line_search", 1e-3)
        return minimizer.run()

    result = minimize_with_polish(objective_in, model, run_stage, max_iterations=300, rtol=1e-9)
    assert stages == [("", torch.float32, 300), ("float64", torch.float64, 260)]
    assert next(model.parameters()).dtype == torch.float32
    assert result.polished and result.iterations > 40 and "in float64 after float32 stalled" in result.describe()
