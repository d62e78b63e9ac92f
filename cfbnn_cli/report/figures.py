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
