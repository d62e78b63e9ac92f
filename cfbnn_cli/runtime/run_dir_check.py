"""A run only into a folder that is its own: checked before Hydra makes or writes anything.

Hydra makes the run dir (``mkdir -p``) and opens the log in it before cfbnn's task runs, so a
refusal in the task would come after ``<job>.log`` was written into, say, ``/`` or a home.
:class:`RefuseForeignRunDir`, a Hydra callback in every command's config
(``hydra.callbacks.run_dir``), looks first: a single run's dir must be new, empty or a cfbnn run
dir of the same command (:func:`~cfbnn_cli.runtime.rundir.foreign_run_dir`); a sweep's dir new,
empty, or a Hydra sweep dir (it holds ``multirun.yaml``), whose jobs' dirs the task checks one by
one. A refusal is one line on stderr and exit 2, with nothing written.

Hydra turns an exception raised by a callback into a warning and goes on, so the refusal
leaves by :class:`SystemExit` (exit code 2). The task checks the run dir again (where this
callback is turned off, or for a sweep's job), then with the log it opened left out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from .rundir import foreign_run_dir

SWEEP_RECORD = "multirun.yaml"  # what Hydra writes into every sweep dir


def _path(config, key: str) -> Optional[Path]:
    value = OmegaConf.select(config, key, default=None)  # resolves ${now:...} once: Hydra reuses the value
    return Path(os.path.abspath(str(value))) if value not in (None, "") else None


def _refuse(message: str) -> None:
    print(f"cfbnn: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def foreign_sweep_dir(sweep_dir: Path) -> Optional[str]:
    """Why a sweep must not be written into ``sweep_dir``, or ``None``: it must be new, empty or a
    sweep dir (:data:`SWEEP_RECORD`)."""
    if not sweep_dir.is_dir() or (sweep_dir / SWEEP_RECORD).is_file():
        return None
    problem = foreign_run_dir(sweep_dir, key="hydra.sweep.dir")
    return problem.replace("a cfbnn run's own", "a sweep's own") if problem else None


class RefuseForeignRunDir(Callback):
    """Refuses, before Hydra makes or writes anything, a run dir (or sweep dir) that holds other
    files than a run's (see the module docstring)."""

    def on_run_start(self, config, **kwargs) -> None:
        run_dir = _path(config, "hydra.run.dir")
        if run_dir is None:  # an empty hydra.run.dir: the task says so
            return
        problem = foreign_run_dir(run_dir, OmegaConf.select(config, "hydra.job.name", default=None))
        if problem is not None:
            _refuse(problem)

    def on_multirun_start(self, config, **kwargs) -> None:
        sweep_dir = _path(config, "hydra.sweep.dir")
        problem = foreign_sweep_dir(sweep_dir) if sweep_dir is not None else None
        if problem is not None:
            _refuse(problem)
