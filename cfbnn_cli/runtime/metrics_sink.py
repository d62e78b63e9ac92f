"""Where per-epoch metrics go besides ``metrics.csv``: TensorBoard, when ``logger=tensorboard``.

The CLI opens the sink for a run (:func:`open_tensorboard`, events under ``<run dir>/tensorboard``,
a folder made or checked by :func:`cfbnn_cli.runtime.safefs.output_folder`: a link there is refused)
and closes it when the run ends; the training loop hands it every row it appends to
``metrics.csv`` (:func:`emit`): each numeric column becomes a scalar ``<label>/<column>`` at
step ``epoch`` (the label names the training: ``train``, ``v1``..``v3``, the head). With no sink
open (the default, ``logger=csv``) :func:`emit` does nothing. TensorBoard is an optional extra
(``pip install 'cfbnn[tensorboard]'``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Optional

from .errors import ConfigError
from .safefs import output_folder

_WRITER = None


def open_tensorboard(folder: Path) -> None:
    global _WRITER
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module needs the tensorboard package
        raise ConfigError(
            "logger=tensorboard needs the tensorboard package: pip install 'cfbnn[tensorboard]' "
            "(or drop logger=tensorboard: metrics.csv is written either way)"
        ) from None
    close()
    output_folder(folder)  # made here, not through a link: the writer only adds its event file
    _WRITER = SummaryWriter(log_dir=str(folder))


def emit(label: str, row: Mapping[str, object], step: Optional[int] = None) -> None:
    if _WRITER is None:
        return
    step = int(row.get("epoch", 0)) if step is None else step
    for key, value in row.items():
        if key == "epoch" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            _WRITER.add_scalar(f"{label}/{key}", float(value), step)
    _WRITER.flush()


def close() -> None:
    global _WRITER
    if _WRITER is not None:
        _WRITER.close()
        _WRITER = None


class logging_to:
    """``with logging_to(cfg, run_dir): ...``: the sink ``cfg.logger.name`` asks for, open for the
    block (``enabled=False``: none, e.g. on a rank that writes no metrics)."""

    def __init__(self, cfg, run_dir, enabled: bool = True):
        from omegaconf import OmegaConf

        self.name = OmegaConf.select(cfg, "logger.name", default="csv")
        if self.name not in ("csv", "tensorboard"):
            raise ConfigError(f"logger={self.name!r} is not one of csv, tensorboard")
        self.folder = Path(run_dir) / "tensorboard"
        self.enabled = enabled and self.name == "tensorboard"

    def __enter__(self):
        if self.enabled:
            open_tensorboard(self.folder)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            close()
        return False
