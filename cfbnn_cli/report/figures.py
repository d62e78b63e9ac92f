"""Figures: matplotlib with the Agg backend, saved atomically at paper size.

Every cfbnn figure is made for reading in a paper: 8-9 pt text at its printed size, a
caption line naming the data, estimator, draws, batch and seed (:func:`caption`),
legends outside the axes (:func:`legend_below`), and curves that may coincide told
apart by line style and markers as well as colour.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..runtime.io import atomic_write_bytes  # noqa: E402

PAPER_STYLE = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "figure.titlesize": 9,
    "figure.dpi": 150,
}
# every text of a figure follows the style, also the titles and labels set after the axes exist
matplotlib.rcParams.update(PAPER_STYLE)


def new_figure(
    ncols: int = 1, width: float = 6.5, height: float = 2.4, sharey: bool = False, layout: str = "constrained"
):
    """``(fig, axes)`` with ``ncols`` axes in a row; constrained layout by default (room is made
    for a legend or caption placed outside the axes)."""
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False, sharey=sharey, layout=layout)
    return fig, axes[0]


def caption(fig, text: str, width_chars: int = None) -> None:
    """A caption line (or two) above the axes, wrapped to the figure's width: what the
    figure shows, on what data, with how many draws, which batch and seed."""
    width_chars = width_chars or int(fig.get_figwidth() * 15)
    with plt.rc_context(PAPER_STYLE):
        fig.suptitle("\n".join(textwrap.wrap(text, width_chars)), fontsize=8)


def legend_below(fig, axes, ncol: int = None) -> None:
    """One legend for the whole figure, below the axes (never over data); entries are
    collected from every axis, each label once."""
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if not label.startswith("_"):
                seen.setdefault(label, handle)
    if not seen:
        return
    labels = list(seen)
    ncol = ncol or min(len(labels), 4)
    # about 15 characters of 8 pt text per inch, plus the handle: fewer columns until a row fits the figure
    while (
        ncol > 1
        and max(sum(len(label) + 6 for label in labels[i : i + ncol]) for i in range(0, len(labels), ncol))
        > 15 * fig.get_figwidth()
    ):
        ncol -= 1
    with plt.rc_context(PAPER_STYLE):
        fig.legend(list(seen.values()), labels, loc="outside lower center", ncol=ncol, frameon=False)


def save_figure(fig, path, layout: bool = True) -> str:
    """Save ``fig`` as a PNG at 200 dpi, atomically; ``layout`` tightens a figure made
    without constrained layout."""
    buffer = io.BytesIO()
    with plt.rc_context(PAPER_STYLE):
        engine = fig.get_layout_engine()
        if layout and engine is None:
            fig.tight_layout()
        fig.savefig(buffer, format="png", dpi=200)
    plt.close(fig)
    atomic_write_bytes(Path(path), buffer.getvalue())
    return Path(path).name


def plot_calibration(pit, path, description: str) -> str:
    """Calibration of a regression predictive: the coverage of its central intervals against their
    nominal level (left; the diagonal is perfect calibration) and the histogram of the PIT values
    (right; flat when calibrated)."""
    import numpy as np

    values = np.asarray(pit, dtype=float)
    levels = np.linspace(0.05, 0.95, 19)
    coverage = [float(np.mean(np.abs(values - 0.5) <= level / 2)) for level in levels]
    fig, axes = new_figure(2, width=7.0, height=3.2)
    axes[0].plot([0, 1], [0, 1], color="0.5", ls=":", lw=1, label="perfect calibration")
    axes[0].plot(levels, coverage, "o-", ms=3, color="C0", label="this run's predictive")
    axes[0].set_xlabel("nominal level of the central interval")
    axes[0].set_ylabel("share of test targets inside")
    axes[0].set_xlim(0, 1)
    axes[0].set_ylim(0, 1)
    axes[0].grid(alpha=0.3)
    axes[1].hist(values, bins=20, range=(0, 1), density=True, color="C0", alpha=0.7, label="PIT of the test targets")
    axes[1].axhline(1.0, color="0.5", ls=":", lw=1)
    axes[1].set_xlabel("PIT = predictive CDF at the target")
    axes[1].set_ylabel("density")
    axes[1].grid(alpha=0.3)
    legend_below(fig, axes)
    caption(fig, f"Calibration on the test set ({len(values)} targets). {description}")
    return save_figure(fig, path)
