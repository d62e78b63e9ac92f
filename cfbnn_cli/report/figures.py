"""Figures: matplotlib with the Agg backend, saved atomically at paper size."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..runtime.io import atomic_write_bytes  # noqa: E402

PAPER_STYLE = {"font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8, "figure.dpi": 150}


def new_figure(ncols: int = 1, width: float = 6.5, height: float = 2.4):
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig, path) -> str:
    buffer = io.BytesIO()
    with plt.rc_context(PAPER_STYLE):
        fig.tight_layout()
        fig.savefig(buffer, format="png", dpi=200)
    plt.close(fig)
    atomic_write_bytes(Path(path), buffer.getvalue())
    return Path(path).name
