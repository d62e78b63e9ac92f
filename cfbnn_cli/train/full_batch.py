"""Deterministic full-batch optimization of an exact objective, to convergence.

The closed-form ELBO and its gradient are exact: nothing is sampled, so a small data
set can be optimized as an ordinary smooth function -- L-BFGS with a strong-Wolfe line
search over every row at once, stopped by a convergence test rather than a step
budget. No sampling method can do that (its objective is noisy).

Convergence: the relative change of the objective over one round of iterations below
``rtol``, or the largest gradient entry below ``gtol``; ``max_iterations`` bounds the
work. The objective should be O(1) (e.g. the negative ELBO per data point) so that the
tolerances mean the same for any data size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..runtime import threads
from ..runtime.numerics import ensure_finite


@dataclass
class FullBatchResult:
    objective: float
    iterations: int
    evaluations: int
    seconds: float
    converged: bool


def minimize_full_batch(
    objective: Callable[[], torch.Tensor],
    parameters: Iterable[torch.nn.Parameter],
    *,
    max_iterations: int = 2000,
    rtol: float = 1e-7,
    gtol: float = 1e-6,
    history_size: int = 20,
    round_iterations: int = 25,
    label: str = "full-batch objective",
    progress=None,
) -> FullBatchResult:
    """Minimize ``objective()`` over ``parameters`` with L-BFGS (strong Wolfe) until convergence."""
    parameters = [p for p in parameters if p.requires_grad]
    optimizer = torch.optim.LBFGS(
        parameters,
        lr=1.0,
        max_iter=round_iterations,
        history_size=history_size,
        tolerance_grad=gtol,
        tolerance_change=0.0,
        line_search_fn="strong_wolfe",
    )
    evaluations = 0
    rejected = 0  # line-search trial points where the objective overflowed

    def closure():
        nonlocal evaluations, rejected
        optimizer.zero_grad(set_to_none=True)
        value = objective()
        evaluations += 1
        if not torch.isfinite(value):
            # a trial step of the line search went where the objective overflows (exp of a huge
            # log-variance, say): report it as far worse than the start, with no slope, so the
            # strong-Wolfe search backtracks instead of the run failing; an accepted point is
            # still checked below, so a real divergence (or bad data) is reported
            rejected += 1
            for p in parameters:
                p.grad = torch.zeros_like(p)
            # large but modest: the line search's cubic interpolation squares differences of values
            return torch.tensor(overflow_stand_in, dtype=value.dtype, device=value.device)
        value.backward()
        return value

    started = time.perf_counter()
    with torch.no_grad():
        previous = float(objective())
    ensure_finite(torch.tensor(previous), step=0, what=label)
    overflow_stand_in = abs(previous) + 1e4 * max(1.0, abs(previous))
    iterations, converged = 0, False
    while iterations < max_iterations:
        threads.rebalance()  # another cfbnn job may have started or ended: share the cores
        optimizer.step(closure)
        state = optimizer.state[parameters[0]]
        done_now = max(int(state.get("n_iter", 0)) - iterations, 0)
        iterations += done_now
        if progress is not None:
            progress.update(done_now)
        with torch.no_grad():
            current = float(objective())
        ensure_finite(torch.tensor(current), step=iterations, what=label)
        gradient = max((float(p.grad.abs().max()) for p in parameters if p.grad is not None), default=0.0)
        # L-BFGS stops a round early when its gradient test holds; no progress means converged too
        if done_now == 0 or gradient <= gtol or abs(previous - current) <= rtol * max(1.0, abs(current)):
            converged = True
            previous = current
            break
        previous = current
    return FullBatchResult(previous, iterations, evaluations, time.perf_counter() - started, converged)
