"""Deterministic full-batch optimization of an exact objective, to convergence.

The closed-form ELBO and its gradient are exact: nothing is sampled, so a small data
set can be optimized as an ordinary smooth function -- L-BFGS with a strong-Wolfe line
search over every row at once, stopped by a convergence test rather than a step
budget. No sampling method can do that (its objective is noisy).

L-BFGS runs in rounds of ``round_iterations`` iterations; after each round the objective and
its gradient are evaluated at the point reached, and the run stops (:class:`FullBatchResult`
``stop``) when:

* ``"gradient"`` -- the largest gradient entry is below ``gtol``: converged;
* ``"objective"`` -- the round lowered the objective, by less than ``rtol`` relative to it
  (at least :data:`ROUNDING_UNITS` units of the parameters' floating-point rounding, ``eps``: a
  float32 objective cannot tell a smaller change from its rounding): converged;
* ``"precision"`` -- the round did not lower the objective at all, again after the L-BFGS memory
  was cleared (a restart from steepest descent), and no step could lower it by more than its
  rounding: the decrease a Newton step would make, ``|g|^2 / 2`` times L-BFGS's estimate of the
  inverse curvature (its ``H_diag``), is below :data:`ROUNDING_UNITS` units of the objective's
  rounding. Converged, as far as the objective's precision can tell;
* ``"line_search"`` -- the same, but a step could still gain more than the rounding: the line
  search failed to find a lower point that is there. That is a failure, **not** convergence;
* ``"max_iterations"`` -- ``max_iterations`` reached: not converged.

The objective should be O(1) (e.g. the negative ELBO per data point) so that the tolerances
mean the same for any data size.

:class:`FullBatchMinimizer` keeps its whole state (the L-BFGS memory, the counts, the last
objective) in :meth:`~FullBatchMinimizer.state_dict` -- plain tensors and numbers, for a
checkpoint loaded with ``weights_only=True`` -- so a run restored from it (with the parameters
it had) continues with exactly the computations an uninterrupted run makes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from ..runtime import threads
from ..runtime.numerics import ensure_finite

STOPS = {
    "gradient": "converged (gradient ~ 0)",
    "objective": "converged (objective changed less than rtol)",
    "precision": "converged to the objective's floating-point precision (no step can lower it more)",
    "line_search": "NOT converged: the line search found no lower point",
    "max_iterations": "NOT converged: reached the iteration limit",
}
CONVERGED_STOPS = ("gradient", "objective", "precision")
# the smallest relative change of the objective the "objective" test looks for, in units of the
# parameters' machine epsilon: a round's change of a float32 objective below ~1e-7 relative is
# one or two units of its rounding, which a line search cannot resolve (it stalls instead)
ROUNDING_UNITS = 16


@dataclass
class FullBatchResult:
    objective: float
    iterations: int
    evaluations: int
    seconds: float
    converged: bool
    stop: str = "objective"  # a key of STOPS
    gradient: float = 0.0  # the largest gradient entry where it stopped
    polished: bool = False  # continued in float64 after its float32 line search stalled

    def describe(self) -> str:
        """How the run ended, in words (``STOPS``), with the gradient where it did not converge."""
        text = STOPS.get(self.stop, self.stop)
        text = text if self.converged else f"{text} (largest gradient entry {self.gradient:.2g})"
        return f"{text}, in float64 after float32 stalled" if self.polished else text


@dataclass
class FullBatchRound:
    """What :meth:`FullBatchMinimizer.run` reports after each round (``on_round``)."""

    iterations: int
    evaluations: int
    objective: float
    change: float  # the objective's decrease over the round
    gradient: float  # the largest gradient entry
    seconds: float  # since the run started (resumed runs count their earlier seconds)
    max_iterations: int


class FullBatchMinimizer:
    """Minimize ``objective()`` over ``parameters`` with L-BFGS (strong Wolfe) until it converges
    or stops (see the module docstring)."""

    def __init__(
        self,
        objective: Callable[[], torch.Tensor],
        parameters: Iterable[torch.nn.Parameter],
        *,
        max_iterations: int = 2000,
        rtol: float = 1e-7,
        gtol: float = 1e-6,
        history_size: int = 20,
        round_iterations: int = 25,
        label: str = "full-batch objective",
    ):
        self.objective = objective
        self.parameters = [p for p in parameters if p.requires_grad]
        self.max_iterations, self.gtol = int(max_iterations), float(gtol)
        dtype = self.parameters[0].dtype if self.parameters else torch.float32
        self.rtol = max(float(rtol), ROUNDING_UNITS * torch.finfo(dtype).eps)
        self.round_iterations = int(round_iterations)
        self.label = label
        self.optimizer = torch.optim.LBFGS(
            self.parameters,
            lr=1.0,
            max_iter=self.round_iterations,
            history_size=history_size,
            tolerance_grad=self.gtol,
            tolerance_change=0.0,
            line_search_fn="strong_wolfe",
        )
        self.iterations = 0
        self.evaluations = 0
        self.rejected = 0  # line-search trial points where the objective overflowed
        self.previous: Optional[float] = None  # the objective where the last round ended
        self.overflow_stand_in: Optional[float] = None
        self.restarted = False  # the L-BFGS memory was cleared after a round without progress
        self.inverse_curvature = 1.0  # L-BFGS's last H_diag: its estimate of 1 / the curvature
        self.seconds = 0.0  # of earlier sessions (a resumed run)
        self.result: Optional[FullBatchResult] = None  # set when the run has stopped

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Everything a resumed run needs besides the parameters (which the caller saves)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "iterations": self.iterations,
            "evaluations": self.evaluations,
            "rejected": self.rejected,
            "previous": self.previous,
            "overflow_stand_in": self.overflow_stand_in,
            "restarted": self.restarted,
            "inverse_curvature": self.inverse_curvature,
            "seconds": self.seconds,
            "result": None if self.result is None else dict(self.result.__dict__),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (the parameters restored by the caller). A field of the
        wrong type is a ``ValueError`` (the caller names the file)."""
        for key in ("iterations", "evaluations", "rejected"):
            if isinstance(state.get(key), bool) or not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(f"its L-BFGS `{key}` is {state.get(key)!r:.40}, not a count")
        for key in ("previous", "overflow_stand_in", "seconds", "inverse_curvature"):
            value = state.get(key)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise ValueError(f"its L-BFGS `{key}` is {value!r:.40}, not a finite number")
        result = state.get("result")
        if result is not None and (
            not isinstance(result, dict) or set(result) != set(FullBatchResult.__dataclass_fields__)
        ):
            raise ValueError("its L-BFGS `result` is not a result record")
        if "optimizer" in state:  # (a caller may restore the optimizer itself)
            if not isinstance(state["optimizer"], dict):
                raise ValueError("its L-BFGS `optimizer` state is not a mapping")
            self.optimizer.load_state_dict(state["optimizer"])
        self.iterations, self.evaluations, self.rejected = state["iterations"], state["evaluations"], state["rejected"]
        self.previous, self.overflow_stand_in = state["previous"], state["overflow_stand_in"]
        self.restarted, self.seconds = bool(state.get("restarted", False)), float(state.get("seconds") or 0.0)
        self.inverse_curvature = float(state.get("inverse_curvature", 1.0))
        self.result = None if result is None else FullBatchResult(**result)

    # ----------------------------------------------------------------- evaluation

    def _closure(self):
        self.optimizer.zero_grad(set_to_none=True)
        try:
            value = self.objective()
        except RuntimeError as error:  # an operator's float32 result out of range: an overflowed point
            if "without overflow" not in str(error):
                raise
            value = torch.tensor(math.inf)
        self.evaluations += 1
        if not torch.isfinite(value):
            # a trial step of the line search went where the objective overflows (exp of a huge
            # log-variance, say): report it as far worse than the start, with no slope, so the
            # strong-Wolfe search backtracks instead of the run failing; an accepted point is
            # still checked after the round, so a real divergence (or bad data) is reported
            self.rejected += 1
            for p in self.parameters:
                p.grad = torch.zeros_like(p)
            # large but modest: the line search's cubic interpolation squares differences of values
            return torch.tensor(self.overflow_stand_in, dtype=value.dtype, device=value.device)
        value.backward()
        return value

    def _value_and_gradient(self, step: int):
        """The objective, its largest gradient entry and the gradient's squared norm at the current
        point (checked finite)."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            value = self.objective()
            ensure_finite(value.detach(), step=step, what=self.label)
            value.backward()
        grads = [p.grad.detach() for p in self.parameters if p.grad is not None]
        largest = max((float(g.abs().max()) for g in grads), default=0.0)
        squared = sum((float(g.double().square().sum()) for g in grads), 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        return float(value.detach()), largest, squared

    def _rounding(self, value: float) -> float:
        """The change of the objective near ``value`` that its floating-point rounding can hide."""
        return ROUNDING_UNITS * torch.finfo(self.parameters[0].dtype).eps * max(1.0, abs(value))

    # ----------------------------------------------------------------- the run

    def run(self, progress=None, on_round: Optional[Callable[[FullBatchRound], None]] = None) -> FullBatchResult:
        """Rounds of L-BFGS until a stopping rule holds (from where :meth:`load_state_dict` left it);
        ``progress.update(iterations)`` after each round, ``on_round(FullBatchRound)`` too."""
        if self.result is not None:  # restored from a run that had already stopped
            return self.result
        started = time.perf_counter() - self.seconds
        if self.previous is None:
            with torch.no_grad():
                self.previous = float(self.objective())
            ensure_finite(torch.tensor(self.previous), step=0, what=self.label)
            self.overflow_stand_in = abs(self.previous) + 1e4 * max(1.0, abs(self.previous))
        stop = None
        gradient = math.inf
        while stop is None:
            threads.rebalance()  # another cfbnn job may have started or ended: share the cores
            group = self.optimizer.param_groups[0]  # the last round stops at max_iterations
            group["max_iter"] = min(self.round_iterations, self.max_iterations - self.iterations)
            group["max_eval"] = group["max_iter"] * 5 // 4  # (torch's default ratio)
            state = self.optimizer.state[self.parameters[0]]
            before = int(state.get("n_iter", 0))
            self.optimizer.step(self._closure)
            done_now = max(int(self.optimizer.state[self.parameters[0]].get("n_iter", 0)) - before, 0)
            self.iterations += done_now
            current, gradient, squared = self._value_and_gradient(self.iterations)
            change = self.previous - current
            if gradient <= self.gtol:
                stop = "gradient"
            elif not change > 0:  # no lower point found in a whole round
                if self.restarted:  # what a Newton step could still gain, against the objective's rounding
                    gain = 0.5 * squared * self.inverse_curvature
                    stop = "precision" if gain <= self._rounding(current) else "line_search"
                else:  # the L-BFGS memory may point nowhere useful: once, start again from steepest descent
                    h_diag = self.optimizer.state[self.parameters[0]].get("H_diag")
                    if h_diag is not None and 0 < float(h_diag) < math.inf:
                        self.inverse_curvature = float(h_diag)
                    self.optimizer.state.clear()
                    self.restarted = True
            else:
                self.restarted = False
                if change <= self.rtol * max(1.0, abs(current)):
                    stop = "objective"
            self.previous = current  # where the parameters are
            if stop is None and self.iterations >= self.max_iterations:
                stop = "max_iterations"
            self.seconds = time.perf_counter() - started
            if stop is not None:
                self.result = FullBatchResult(
                    self.previous,
                    self.iterations,
                    self.evaluations,
                    self.seconds,
                    stop in CONVERGED_STOPS,
                    stop,
                    gradient,
                )
            if on_round is not None:
                on_round(
                    FullBatchRound(
                        self.iterations,
                        self.evaluations,
                        current,
                        change,
                        gradient,
                        self.seconds,
                        self.max_iterations,
                    )
                )
            if progress is not None:
                progress.update(done_now)
        return self.result


def minimize_full_batch(
    objective: Callable[[], torch.Tensor],
    parameters: Iterable[torch.nn.Parameter],
    *,
    progress=None,
    on_round: Optional[Callable[[FullBatchRound], None]] = None,
    **options,
) -> FullBatchResult:
    """Minimize ``objective()`` over ``parameters`` with L-BFGS (strong Wolfe) until it converges or
    stops (:class:`FullBatchMinimizer`; ``options``: its keywords)."""
    return FullBatchMinimizer(objective, parameters, **options).run(progress, on_round)


def minimize_with_polish(
    make_objective: Callable[[torch.dtype], Callable[[], torch.Tensor]],
    model: torch.nn.Module,
    run_stage: Callable[[FullBatchMinimizer, str], FullBatchResult],
    *,
    max_iterations: int = 2000,
    label: str = "full-batch objective",
    **options,
) -> FullBatchResult:
    """L-BFGS on ``make_objective(model's dtype)`` over ``model``'s parameters and, where that stops
    because its line search stalls (a float32 objective cannot resolve the last digits of its
    decrease: its rounding, not the optimum, ends the search), continued in float64 from there
    until the stopping rules hold, within what is left of ``max_iterations`` (a polish: the model
    is float32 again afterwards). ``run_stage(minimizer, stage)`` runs each stage (``""``, then
    ``"float64"``: a checkpoint or a progress bar of its own). Returns the run's result, its
    iterations those of both stages."""
    dtype = next(model.parameters()).dtype
    first = FullBatchMinimizer(
        make_objective(dtype), model.parameters(), max_iterations=max_iterations, label=label, **options
    )
    result = run_stage(first, "")
    if result.stop != "line_search" or dtype == torch.float64 or result.iterations >= max_iterations:
        return result
    model.to(torch.float64)
    try:
        polish = FullBatchMinimizer(
            make_objective(torch.float64),
            model.parameters(),
            max_iterations=max_iterations - result.iterations,
            label=f"{label} (float64)",
            **options,
        )
        finished = run_stage(polish, "float64")
    finally:
        model.to(dtype)
    return FullBatchResult(
        finished.objective,
        result.iterations + finished.iterations,
        result.evaluations + finished.evaluations,
        result.seconds + finished.seconds,
        finished.converged,
        finished.stop,
        finished.gradient,
        polished=True,
    )
