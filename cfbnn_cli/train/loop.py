"""The one training loop: every pipeline (Table 1, Table 2, Figure 1) and the UCI protocol.

:class:`TrainingLoop` owns what training is, the same everywhere:

* the minibatches -- epochs of fresh permutations from a seeded generator, or a fixed
  ``schedule`` of ``(steps, batch)`` row indices (the UCI protocol's equal budgets);
  under ``torchrun`` each rank takes its rows of every global batch
  (:func:`~cfbnn_cli.runtime.distributed.local_rows`), so N processes train as one;
* the optimizer step, with the NaN/Inf guard (the message names the epoch and step); on
  CUDA each step (forward, backward, Adam) runs as one CUDA graph per batch size
  (:mod:`.graphs`; ``cuda_graphs=False``, i.e. ``trainer.cuda_graphs=false``, runs it
  eagerly), and the guard checks the epoch's losses at its end instead of waiting for
  the GPU at every step;
* after each epoch: the pipeline's evaluation (``evaluate(epoch) -> metrics``) and hook
  (``after_epoch(epoch, row)``), the validation-picked ``checkpoints/best.pt``
  (``select=(metric, "max"|"min")``), ``checkpoints/last.pt`` (model, optimizer, epoch,
  every generator, history, best, the pipeline's ``extra`` state and the config
  fingerprint; atomic) and ``metrics.csv``; only rank 0 writes;
* resume: ``resume=True`` continues from ``last.pt`` if the same configuration wrote it
  (:func:`~cfbnn_cli.runtime.checkpoints.restore_training_state` refuses another);
* the progress bar (runtime.progress: a terminal only; the log gets one line per epoch).

What stays in a pipeline is only its own: the data, the model, the loss of a
minibatch (``loss(rows) -> scalar``) and what to measure.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pandas as pd
import torch

from ..runtime import distributed, metrics_sink, threads
from ..runtime.checkpoints import load_model_weights, restore_training_state, save_training_state
from ..runtime.errors import CheckpointError, clip
from ..runtime.io import atomic_torch_save, atomic_write_text
from ..runtime.numerics import ensure_finite
from ..runtime.progress import progress_bar
from .graphs import GraphedTrainingStep

log = logging.getLogger(__name__)


@dataclass
class TrainingResult:
    history: List[dict]
    best: Dict[str, float]
    extra: dict
    resumed_from: int = 0
    seconds: float = 0.0
    steps: int = 0


@dataclass
class TrainingLoop:
    """See the module docstring. ``loss(rows)`` gets this rank's row indices of one
    minibatch (a tensor on the training device) and returns the scalar to minimize;
    the epoch's ``objective_name`` column is the row-weighted mean of ``-loss`` times
    ``objective_scale``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor], torch.Tensor]
    num_rows: int
    batch_size: int
    device: torch.device
    epochs: int = 1
    data_generator: Optional[torch.Generator] = None
    schedule: Optional[torch.Tensor] = None  # (steps, batch) rows: one pass, instead of epochs of permutations
    generators: Dict[str, torch.Generator] = field(default_factory=dict)  # checkpointed with the model
    checkpoint_dir: Optional[Path] = None
    fingerprint: Optional[str] = None
    resume: bool = False
    evaluate: Optional[Callable[[int], Dict[str, float]]] = None
    after_epoch: Optional[Callable[[int, dict], None]] = None
    select: Optional[Tuple[str, str]] = None  # (metric, "max" | "min") -> best.pt (or kept in memory)
    best_payload: Optional[Callable[[], dict]] = None  # extra fields stored in best.pt
    patience: Optional[int] = None  # stop after this many epochs without a better ``select`` metric
    evaluate_every: int = 1  # epochs between evaluations (and early-stopping checks)
    snapshot_after_seconds: Optional[float] = None  # keep the parameters reached at this training time
    metrics_path: Optional[Path] = None
    metrics_prefix: Sequence[dict] = ()  # rows written before this loop's (e.g. earlier VAE variants)
    row_fields: Dict[str, object] = field(default_factory=dict)  # constant columns of every row
    objective_name: str = "train_elbo_per_point"
    objective_scale: float = 1.0
    label: str = "train"
    progress: Optional[object] = None  # an outer bar (progress_bar) to advance per step, not one per epoch
    extra: dict = field(default_factory=dict)  # the pipeline's state, saved in and restored from last.pt
    config: Optional[dict] = None  # the resolved config, recorded in last.pt
    cuda_graphs: bool = True  # on CUDA, each step as one CUDA graph (train/graphs.py); trainer.cuda_graphs
    epoch_cap: Optional[int] = None  # the epochs shown in the bar when a caller runs one epoch at a time (the VAE)
    log_summary: bool = True  # one INFO line when training ends (epochs, the best epoch); per-epoch lines are DEBUG
    # last.pt and metrics.csv carry the whole history, so writing them every epoch made a run's
    # time grow with the square of its epochs (5,000 epochs of a small network: 233 s for 30 s of
    # steps); they are written after the first epoch, then at most every this many seconds, and
    # at the last epoch or an early stop. A kill loses at most this much training, redone
    # bit-identically on resume (the checkpoint holds every generator).
    persist_seconds: float = 10.0

    def __post_init__(self):
        self.history: List[dict] = []
        self.best: Dict[str, float] = {"epoch": 0, "value": None}
        self.start_epoch = 0
        self._best_state = None  # the best epoch's parameters, when there is no checkpoint folder
        self.snapshot = None  # parameters at ``snapshot_after_seconds`` of training (None if it stopped sooner)
        self._persisted_at = None  # time.perf_counter() of the last write of last.pt and metrics.csv
        self.stopped_early = False
        self.training_seconds = 0.0  # optimizer steps only (evaluations excluded): the equal-time clock
        self.trained = self.model
        if distributed.world_size() > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.trained = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        if self.schedule is not None:
            self.epochs = 1
        # DDP's gradient hooks would need their own warm-up and capture: one process only
        self.graphed = (
            GraphedTrainingStep(
                self.model, self.optimizer, self.loss, self.device, list(self.generators.values()), self.label
            )
            if self.cuda_graphs and self.trained is self.model and self.device.type == "cuda"
            else None
        )

    # ----------------------------------------------------------------------------- state

    @property
    def last_path(self) -> Optional[Path]:
        return None if self.checkpoint_dir is None else Path(self.checkpoint_dir) / "last.pt"

    @property
    def best_path(self) -> Optional[Path]:
        return None if self.checkpoint_dir is None else Path(self.checkpoint_dir) / "best.pt"

    def restore(self) -> int:
        """Load ``last.pt`` when resuming; returns the last finished epoch (0 for a fresh start)."""
        if not self.resume or self.last_path is None:
            return 0
        generators = {"data_order": self.data_generator, **self.generators} if self.data_generator else self.generators
        state = restore_training_state(
            self.last_path, self.model, self.optimizer, generators, self.device, self.fingerprint
        )
        if state is None:
            return 0
        history, best = state.get("history"), state.get("best")
        if (
            not isinstance(history, list)
            or not all(isinstance(row, dict) for row in history)
            or not isinstance(best, dict)
            or isinstance(best.get("epoch"), bool)
            or not isinstance(best.get("epoch"), int)
            or not 0 <= best["epoch"] <= state["epoch"]
            or not isinstance(state.get("extra", {}), dict)
            or state["epoch"] > self.epochs
        ):
            raise CheckpointError(
                f"{self.last_path} is not a checkpoint of this training loop (its history, best "
                f"epoch or epoch {state['epoch']} of {self.epochs} is malformed); delete it or start "
                "a fresh run dir"
            )
        problem = self._history_problem(history, int(state["epoch"]))
        if problem is not None:
            raise CheckpointError(
                f"{self.last_path} does not hold this run's history ({problem}); it cannot be resumed as it "
                "stands: delete it to train afresh, or start a fresh run dir"
            )
        self.history, self.best, self.start_epoch = list(history), dict(best), int(state["epoch"])
        self.extra.clear()
        self.extra.update(state.get("extra", {}))
        log.info("%s: resumed from %s after epoch %d", self.label, self.last_path, self.start_epoch)
        return self.start_epoch

    def _history_problem(self, history: List[dict], epoch: int) -> Optional[str]:
        """Why ``history`` cannot be the record of epochs 1..``epoch`` this loop wrote, or ``None``:
        one row per finished epoch, in order, each with its objective a finite number and only
        plain values, the evaluated rows with the same fields."""
        if len(history) != epoch:
            return f"{len(history)} rows of history for {epoch} finished epochs"
        evaluated = None
        for number, row in enumerate(history, start=1):
            if row.get("epoch") != number or isinstance(row.get("epoch"), bool):
                return f"row {number} is epoch {clip(repr(row.get('epoch')), 40)}, not {number}"
            value = row.get(self.objective_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return f"epoch {number}'s {self.objective_name} is {clip(repr(value), 40)}, not a finite number"
            if not all(isinstance(v, (int, float, str, bool, type(None))) for v in row.values()):
                return f"epoch {number}'s row holds values that are not numbers or text"
            if number % self.evaluate_every == 0 or number == self.epochs:
                evaluated = set(row) if evaluated is None else evaluated
                if set(row) != evaluated:
                    return f"epoch {number}'s row has other fields than the other evaluated epochs'"
        return None

    def _save(self, epoch: int) -> None:
        if self.last_path is None:
            return
        generators = {"data_order": self.data_generator, **self.generators} if self.data_generator else self.generators
        save_training_state(
            self.last_path,
            self.model,
            self.optimizer,
            epoch,
            generators,
            self.fingerprint,
            history=self.history,
            best=self.best,
            extra=self.extra,
            config=self.config,
        )

    def save_checkpoint(self) -> None:
        """Write ``last.pt`` and ``metrics.csv`` now, after the epochs trained so far (rank 0), e.g.
        once a caller has marked its ``extra`` state finished."""
        if distributed.is_main() and self.history:
            self._save(int(self.history[-1]["epoch"]))
            self._write_metrics()

    def _write_metrics(self) -> None:
        if self.metrics_path is not None:
            atomic_write_text(
                self.metrics_path, pd.DataFrame([*self.metrics_prefix, *self.history]).to_csv(index=False)
            )

    def _improved(self, value: float) -> bool:
        if value is None or not math.isfinite(value):
            return False
        best = self.best["value"]
        _, mode = self.select
        return best is None or (value > best if mode == "max" else value < best)

    def load_best(self) -> bool:
        """Load the best epoch's parameters (``best.pt``, or the in-memory copy without a checkpoint
        folder) if this run (trained or resumed) picked one; never a stale file of another run."""
        if self.select is None or self.best["epoch"] < 1:
            return False
        if self._best_state is not None:
            self.model.load_state_dict(self._best_state)
            return True
        if self.best_path is None or not self.best_path.exists():
            return False
        load_model_weights(self.model, self.best_path, self.device, "best-epoch checkpoint")
        return True

    def _copy_state(self) -> dict:
        return {name: value.detach().clone() for name, value in self.model.state_dict().items()}

    # ----------------------------------------------------------------------------- training

    def _batches(self) -> torch.Tensor:
        if self.schedule is not None:
            return self.schedule
        permutation = torch.randperm(self.num_rows, generator=self.data_generator).to(self.device)
        steps = math.ceil(self.num_rows / self.batch_size)
        return [permutation[step * self.batch_size : (step + 1) * self.batch_size] for step in range(steps)]

    def _step(self, rows: torch.Tensor, epoch: int, step: int) -> float:
        threads.rebalance()  # another cfbnn job may have started or ended: share the cores (once a second)
        loss = self.loss(rows)
        ensure_finite(loss, epoch=epoch if self.schedule is None else None, step=step, what=f"{self.label} loss")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def _graphed_step(self, rows: torch.Tensor, losses: torch.Tensor, step: int) -> None:
        """One step through :class:`GraphedTrainingStep`: no host synchronization; the loss is
        kept on the device in ``losses[step]`` (checked at the epoch's end)."""
        threads.rebalance()
        losses[step].copy_(self.graphed(rows))
        if self.snapshot_after_seconds is not None:
            torch.cuda.synchronize(self.device)  # the equal-time clock must time the GPU's work

    def _epoch_total(self, losses: torch.Tensor, sizes: List[int], epoch: int) -> float:
        """``-sum_k loss_k n_k`` of a graphed epoch, after the one NaN/Inf check of its losses."""
        values = losses.tolist()  # the epoch's one synchronization
        for step, value in enumerate(values):
            if not math.isfinite(value):
                ensure_finite(
                    losses[step], epoch=epoch if self.schedule is None else None, step=step, what=f"{self.label} loss"
                )
        return -sum(value * size for value, size in zip(values, sizes))

    def run(self) -> TrainingResult:
        """Train from the restored epoch (call :meth:`restore` first to resume) to ``epochs``."""
        started = time.perf_counter()
        steps_done = 0
        for epoch in range(self.start_epoch + 1, self.epochs + 1):
            self.model.train()
            epoch_started = time.perf_counter()
            batches = self._batches()
            total = 0.0
            graphed = self.graphed is not None and self.graphed.enabled
            losses = torch.empty(len(batches), device=self.device) if graphed else None
            sizes: List[int] = []
            own_bar = self.progress is None
            bar = (
                progress_bar(
                    total=len(batches),
                    desc=f"{self.label}: epoch {epoch}/{self.epoch_cap or self.epochs}",
                    leave=False,
                    disable=not distributed.is_main(),
                )
                if own_bar
                else self.progress
            )
            if own_bar and self.history:  # the last epoch's numbers, in the bar instead of a log line
                bar.set_postfix_str(self._short(self.history[-1]), refresh=False)
            try:
                for step, batch in enumerate(batches):
                    rows = distributed.local_rows(batch)
                    step_started = time.perf_counter()
                    if graphed:
                        self._graphed_step(rows, losses, step)
                        sizes.append(rows.numel())
                    else:
                        total -= self._step(rows, epoch, step) * rows.numel()
                    self.training_seconds += time.perf_counter() - step_started
                    if (
                        self.snapshot is None
                        and self.snapshot_after_seconds is not None
                        and self.training_seconds >= self.snapshot_after_seconds
                    ):
                        self.snapshot = self._copy_state()
                    steps_done += 1
                    bar.update(1)
            finally:
                if own_bar:
                    bar.close()
            if graphed:
                total = self._epoch_total(losses, sizes, epoch)
            total = distributed.all_reduce_sum(total, self.device)
            row = {
                **self.row_fields,
                "epoch": epoch,
                self.objective_name: total
                / (self.num_rows if self.schedule is None else self.schedule.numel())
                * self.objective_scale,
                "epoch_seconds": time.perf_counter() - epoch_started,
            }
            evaluating = epoch % self.evaluate_every == 0 or epoch == self.epochs
            if self.evaluate is not None and evaluating:
                self.model.eval()
                row.update(self.evaluate(epoch))
            self.history.append(row)
            if distributed.is_main():
                log.debug(
                    "%s %d: %s",
                    self.label,
                    epoch,
                    ", ".join(
                        f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                        for key, value in row.items()
                        if key != "epoch"
                    ),
                )
            if self.after_epoch is not None:
                self.after_epoch(epoch, row)
            improved = self.select is not None and self._improved(row.get(self.select[0]))
            if improved:
                self.best = {"epoch": epoch, "value": float(row[self.select[0]])}
            if improved and self.best_path is None:
                self._best_state = self._copy_state()
            stopping = (
                self.patience is not None and self.best["epoch"] > 0 and epoch - self.best["epoch"] >= self.patience
            )
            now = time.perf_counter()
            persist = (
                stopping
                or epoch == self.epochs
                or self._persisted_at is None
                or now - self._persisted_at >= self.persist_seconds
            )
            if distributed.is_main():
                if improved and self.best_path is not None:
                    payload = self.best_payload() if self.best_payload is not None else {}
                    atomic_torch_save({"model": self.model.state_dict(), "epoch": epoch, **payload}, self.best_path)
                if persist:
                    self._save(epoch)
                    self._write_metrics()
                metrics_sink.emit(self.label, self.history[-1])
            if persist:
                self._persisted_at = now
            distributed.barrier()
            if stopping:
                self.stopped_early = True
                log.info(
                    "%s: stopped after epoch %d, %d epochs after the best (%s = %.4g)",
                    self.label,
                    epoch,
                    epoch - self.best["epoch"],
                    self.select[0],
                    self.best["value"],
                )
                break
        if self.log_summary and distributed.is_main() and self.history:
            log.info("%s", self.summary())
        return TrainingResult(
            self.history, self.best, self.extra, self.start_epoch, time.perf_counter() - started, steps_done
        )

    def _short(self, row: dict) -> str:
        keys = [self.objective_name] + ([self.select[0]] if self.select is not None else [])
        return ", ".join(f"{key} {row[key]:.4g}" for key in keys if isinstance(row.get(key), (int, float)))

    def summary(self) -> str:
        """One line: the epochs trained, the last epoch's numbers and, where a metric picks it, the
        epoch that was kept (``best.pt``)."""
        last = self.history[-1]
        text = f"{self.label}: trained {last['epoch']} epochs ({self._short(last)})"
        if self.select is not None and self.best["epoch"] >= 1:
            text += f"; kept epoch {self.best['epoch']}, the best {self.select[0]} ({self.best['value']:.4g})" + (
                ", stopped early" if self.stopped_early else ""
            )
        return text


def loop_from_config(
    cfg, run_dir, model, optimizer, loss, num_data: int, device, data_generator, sampler, checkpoint_dir=None, **options
) -> TrainingLoop:
    """A :class:`TrainingLoop` set up from a command's config as every pipeline sets it:
    ``trainer.batch_size``, ``trainer.epochs``, ``trainer.cuda_graphs`` and ``resume``; checkpoints
    in ``<run dir>/checkpoints`` (or ``checkpoint_dir``), the metrics in ``<run dir>/metrics.csv``,
    the config's fingerprint and the resolved config in them; ``sampler`` checkpointed with the
    model. ``options``: the pipeline's own fields (evaluation, selection, labels)."""
    from omegaconf import OmegaConf

    from ..runtime.rundir import config_fingerprint

    run_dir = Path(run_dir)
    return TrainingLoop(
        model,
        optimizer,
        loss,
        num_data,
        cfg.trainer.batch_size,
        device,
        epochs=cfg.trainer.epochs,
        data_generator=data_generator,
        generators={"sampler": sampler},
        checkpoint_dir=checkpoint_dir or run_dir / "checkpoints",
        fingerprint=config_fingerprint(cfg, run_dir),
        resume=cfg.resume,
        metrics_path=run_dir / "metrics.csv",
        config=OmegaConf.to_container(cfg, resolve=True),
        cuda_graphs=cfg.trainer.cuda_graphs,
        **options,
    )
