"""What an own-data fit keeps while it trains: progress, ``metrics.csv`` and checkpoints.

A fit (``cfbnn train regression`` with ``protocol: fit``, ``cfbnn train classification``) trains
in phases: ``fit`` (the training rows of the held-out split), then ``refit`` (every row, for
``model.pt``). Each phase trains by full-batch L-BFGS or by minibatch Adam, and

* shows its progress (:class:`FitProgress`): a tqdm bar on a terminal (iterations or steps, the
  latest numbers, the time left to the iteration or epoch cap); otherwise one INFO line at least
  every :data:`LOG_SECONDS` seconds with the iteration or epoch, the latest numbers and, for Adam,
  the best validation log-likelihood so far;
* appends its rows to the run's ``metrics.csv`` (one per L-BFGS round of iterations or per Adam
  epoch, a ``phase`` column saying which), written with its checkpoint;
* keeps its checkpoint (``checkpoints/last.pt`` for ``fit``, ``checkpoints/<phase>/last.pt`` for
  the others; Adam also ``best.pt`` beside it), written atomically after the first round or epoch,
  then at most every :data:`PERSIST_SECONDS` seconds, and when the phase ends (marked finished).

``resume=true`` restores each phase from its checkpoint (the same config only, loaded with
``weights_only=True``): a finished phase is not trained again, an unfinished one continues with
the computations an uninterrupted run makes, so the fit ends with the same numbers.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import pandas as pd
import torch

from ..runtime.checkpoints import restore_training_state, save_training_state
from ..runtime.errors import CheckpointError
from ..runtime.io import atomic_write_text
from ..runtime.progress import progress_bar
from .full_batch import FullBatchMinimizer, FullBatchResult, FullBatchRound

log = logging.getLogger(__name__)
LOG_SECONDS = 20.0  # without a bar: a progress line at most this long after the last (the promise: 30 s)
PERSIST_SECONDS = 10.0  # checkpoint and metrics.csv at most this often (a kill loses at most this much)


class FitProgress:
    """One phase's progress: a bar on a terminal, else rate-limited INFO lines (module docstring).

    ``update(n)`` counts iterations or steps; ``note(text)`` sets the latest numbers (the bar's
    postfix, the log line's tail)."""

    def __init__(self, label: str, total: int, unit: str, what: str):
        self.label, self.total, self.unit, self.what = label, int(total), unit, what
        self.bar = progress_bar(total=self.total, desc=label, unit=unit, leave=False)
        self.drawn = not self.bar.disable
        self.count = 0
        self.status = ""
        self.started = self.logged = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.count += n
        self.bar.update(n)
        self._maybe_log()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:  # a tqdm bar's interface
        self.note(text)

    def note(self, text: str) -> None:  # shown with the next update's bar or line
        self.status = text
        if self.drawn:
            self.bar.set_postfix_str(text, refresh=False)

    def _maybe_log(self, final: bool = False) -> None:
        now = time.perf_counter()
        if self.drawn or (now - self.logged < LOG_SECONDS and not final):
            return
        self.logged = now
        log.info(
            "%s: %s%s; %.0f s so far",
            self.label,
            self.what.format(count=self.count, total=self.total),
            f", {self.status}" if self.status else "",
            now - self.started,
        )

    def close(self) -> None:
        if self.count:  # where it ended (a line unless a bar showed it)
            self._maybe_log(final=True)
        self.bar.close()

    def __enter__(self) -> "FitProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class FitRecords:
    """A fit's run dir records: its ``metrics.csv`` rows (of the phases so far) and one checkpoint
    folder per phase, bound to the config's ``fingerprint``; ``resume`` restores from them."""

    run_dir: Path
    fingerprint: Optional[str]
    resume: bool = False
    config: Optional[dict] = None
    rows: List[dict] = field(default_factory=list)

    def directory(self, phase: str) -> Path:
        folder = Path(self.run_dir) / "checkpoints"
        return folder if phase == "fit" else folder / phase

    @property
    def metrics_path(self) -> Path:
        return Path(self.run_dir) / "metrics.csv"

    def write_metrics(self, current=()) -> None:
        atomic_write_text(self.metrics_path, pd.DataFrame([*self.rows, *current]).to_csv(index=False))

    def loop_options(self, phase: str) -> dict:
        """:class:`~cfbnn_cli.train.loop.TrainingLoop`'s keywords for an Adam phase: its checkpoint
        folder, fingerprint, resume, config, and ``metrics.csv`` after the earlier phases' rows."""
        return {
            "checkpoint_dir": self.directory(phase),
            "fingerprint": self.fingerprint,
            "resume": self.resume,
            "config": self.config,
            "metrics_path": self.metrics_path,
            "metrics_prefix": list(self.rows),
            "row_fields": {"phase": phase},
        }


def epoch_note(loop, epoch: int, metric: str = "validation_ll") -> str:
    """An Adam epoch of ``loop`` in a few words: its last validation log-likelihood and the best so far."""
    scores = [(r["epoch"], r[metric]) for r in loop.history if isinstance(r.get(metric), float)]
    finite = [(e, v) for e, v in scores if math.isfinite(v)]
    if not finite:
        return f"epoch {epoch}/{loop.epochs}"
    at, best = max(finite, key=lambda pair: pair[1])
    return f"epoch {epoch}/{loop.epochs}, validation LL {scores[-1][1]:.4g} per row (best {best:.4g} at epoch {at})"


def run_adam_phase(loop, records: Optional[FitRecords]):
    """``loop.run()`` (a :class:`~cfbnn_cli.train.loop.TrainingLoop` built with
    :meth:`FitRecords.loop_options`), restored first where resuming; a phase its checkpoint marks
    finished is not trained again. Returns ``(history, stopped_early)``."""
    restored = loop.restore() if records is not None else 0
    if restored and loop.extra.get("finished"):
        log.info("%s: finished before (%s); not trained again", loop.label, loop.last_path)
        history, stopped = loop.history, bool(loop.extra.get("stopped_early"))
    else:
        if restored:  # the loop's own line is hushed with its per-epoch ones (uci_methods.quiet)
            log.info("%s: resumed from %s after epoch %d of %d", loop.label, loop.last_path, restored, loop.epochs)
        result = loop.run()
        history, stopped = result.history, loop.stopped_early
        if records is not None:
            loop.extra.update(finished=True, stopped_early=stopped)
            loop.save_checkpoint()
    if records is not None:
        records.rows.extend(history)
    return history, stopped


def _lbfgs_state(state: dict, path: Path) -> dict:
    extra = state.get("lbfgs")
    history = state.get("history")
    if not isinstance(extra, dict) or not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise CheckpointError(f"{path} is not an L-BFGS fit checkpoint (no L-BFGS state or history); delete it")
    return extra


def run_lbfgs_phase(
    minimizer: FullBatchMinimizer,
    model: torch.nn.Module,
    records: Optional[FitRecords],
    phase: str,
    progress: Optional[FitProgress] = None,
) -> FullBatchResult:
    """``minimizer.run()`` with this phase's rows in ``metrics.csv`` and its checkpoint (``model``'s
    weights, the L-BFGS state); restored first where resuming (see the module docstring)."""
    history: List[dict] = []
    path = None if records is None else records.directory(phase) / "last.pt"
    if records is not None and records.resume and path.exists():
        device = next(model.parameters()).device
        state = restore_training_state(path, model, minimizer.optimizer, {}, device, records.fingerprint)
        extra = _lbfgs_state(state, path)
        try:
            minimizer.load_state_dict(extra)
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{path} is not an L-BFGS fit checkpoint ({error}); delete it") from None
        history = list(state["history"])
        log.info("%s: resumed from %s after %d iterations", phase, path, minimizer.iterations)
        if progress is not None:
            progress.update(minimizer.iterations)
    persisted = [None]  # time.perf_counter() of the last write

    def persist() -> None:
        if records is None:
            return
        extra = {k: v for k, v in minimizer.state_dict().items() if k != "optimizer"}
        save_training_state(
            path,
            model,
            minimizer.optimizer,
            minimizer.iterations,
            {},
            records.fingerprint,
            history=history,
            lbfgs=extra,
            phase=phase,
            config=records.config,
        )
        records.write_metrics(history)
        persisted[0] = time.perf_counter()

    def on_round(done: FullBatchRound) -> None:
        history.append(
            {
                "phase": phase,
                "iteration": done.iterations,
                "train_elbo_per_point": -done.objective,
                "change": done.change,
                "gradient_max": done.gradient,
                "seconds": done.seconds,
            }
        )
        if progress is not None:
            progress.note(f"ELBO per row {-done.objective:.5g}, change {done.change:.2g}")
        final = minimizer.result is not None
        if final or persisted[0] is None or time.perf_counter() - persisted[0] >= PERSIST_SECONDS:
            persist()

    finished_before = minimizer.result is not None
    result = minimizer.run(progress, on_round) if not finished_before else minimizer.result
    if finished_before:
        log.info("%s: finished before (%s); not trained again", phase, path)
    if records is not None:
        records.rows.extend(history)
    return result
