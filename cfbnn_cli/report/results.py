"""``results.json``: the machine-readable record every run writes last.

Layout (schema 1): ``{"pipeline", "schema", "status", "config_fingerprint", "config",
"metrics", "tables", "figures", "environment", "timing"}`` (and ``"error"`` for a run that stopped on
one); then an empty ``done``
marker, only when ``status`` is ``"complete"``.
Both are written atomically so that a sweep can tell finished jobs from killed ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from ..runtime.environment import environment_record
from ..runtime.io import atomic_write_json, atomic_write_text

RESULTS_SCHEMA = 1


def _flat_number(value):
    if value is None:  # "not applicable" (e.g. a standard error of one replicate)
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def write_results(
    run_dir,
    pipeline: str,
    cfg: DictConfig,
    metrics: Mapping[str, float],
    wall_s: float,
    device=None,
    tables: Optional[Mapping[str, str]] = None,
    figures: Optional[Mapping[str, str]] = None,
    status: str = "complete",
    fingerprint: Optional[str] = None,
    error: Optional[str] = None,
) -> Path:
    """Write ``results.json`` and then the ``done`` marker into ``run_dir``. A failed run's record
    carries ``status: "failed"`` and, where it stopped on an error, that error's one line."""
    run_dir = Path(run_dir)
    record = {
        "pipeline": pipeline,
        "schema": RESULTS_SCHEMA,
        "status": status,
        "config_fingerprint": fingerprint,
        "config": OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg),
        "metrics": {str(k): _flat_number(v) for k, v in metrics.items()},
        "tables": dict(tables or {}),
        "figures": dict(figures or {}),
        "environment": environment_record(device),
        "timing": {"wall_s": float(wall_s)},
    }
    if error is not None:
        record["error"] = error
    path = atomic_write_json(run_dir / "results.json", record)
    if status == "complete":
        atomic_write_text(run_dir / "done", "")
    return path
