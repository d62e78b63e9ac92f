"""Which folders a run's start made: a run refused before any work removes those, and only those.

Hydra makes the run dir (``mkdir -p``) and opens the log in it before cfbnn's task runs, so
the task alone cannot tell a dir it was given from one made for it. :class:`NoteMadeDirs`, a
Hydra callback in every command's config (``hydra.callbacks.made_dirs``), looks before Hydra
makes anything and leaves its findings in :data:`ENV` (inherited by a launcher's worker
processes):

* a single run: the topmost folder of ``hydra.run.dir`` that does not exist yet;
* a sweep: whether the sweep dir exists, and the names already in it; a job's subdir whose
  first folder was not among them is the job's own.

:func:`made_by_this_run` reads them back in the task. Where nothing was noted (the callback
turned off, a launcher that does not pass the environment on) it says ``None``: the dir is
treated as one that was there before, and nothing is removed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

ENV = "CFBNN_MADE_RUN_DIRS"
NAMES_LIMIT = 5000  # a sweep dir holding more names than this is not listed (its jobs' dirs count as existing)


def _topmost_missing(path: Path) -> Optional[Path]:
    """The topmost folder of ``path`` (itself or a parent) that does not exist, or ``None``."""
    missing = None
    while not os.path.lexists(path):
        missing = path
        if path.parent == path:
            break
        path = path.parent
    return missing


def _absolute(config, key: str) -> Optional[Path]:
    value = OmegaConf.select(config, key, default=None)  # resolves ${now:...} once: Hydra reuses the value
    return Path(os.path.abspath(str(value))) if value is not None else None


class NoteMadeDirs(Callback):
    """Notes, before Hydra makes them, which folders of the run (or sweep) dir do not exist yet."""

    def on_run_start(self, config, **kwargs) -> None:
        run_dir = _absolute(config, "hydra.run.dir")
        if run_dir is not None:
            missing = _topmost_missing(run_dir)
            os.environ[ENV] = json.dumps({"run": str(run_dir), "made": None if missing is None else str(missing)})

    def on_multirun_start(self, config, **kwargs) -> None:
        sweep = _absolute(config, "hydra.sweep.dir")
        if sweep is None:
            return
        names = None
        if os.path.lexists(sweep):
            try:
                names = sorted(os.listdir(sweep)) if sweep.is_dir() and not sweep.is_symlink() else None
            except OSError:
                names = None
            if names is not None and len(names) > NAMES_LIMIT:
                names = None
            if names is None:
                os.environ.pop(ENV, None)
                return
        os.environ[ENV] = json.dumps({"sweep": str(sweep), "names": names or []})


def forget() -> None:
    """Drop what an earlier command in this process noted."""
    os.environ.pop(ENV, None)


def made_by_this_run(run_dir) -> Optional[Path]:
    """The topmost folder this run's start made for ``run_dir`` (the dir itself or a parent of it;
    never a sweep dir), or ``None`` when ``run_dir`` was there before or nothing was noted."""
    try:
        noted = json.loads(os.environ.get(ENV, "") or "null")
    except ValueError:
        return None
    if not isinstance(noted, dict):
        return None
    run_dir = Path(os.path.abspath(str(run_dir)))
    if "run" in noted:
        return Path(noted["made"]) if noted.get("made") and str(run_dir) == noted["run"] else None
    if "sweep" in noted and isinstance(noted.get("names"), list):
        try:
            parts = run_dir.relative_to(noted["sweep"]).parts
        except ValueError:
            return None
        if parts and parts[0] not in noted["names"]:
            return Path(noted["sweep"]) / parts[0]
    return None
