"""The UCI protocol's summary table (one row per method: test LL and RMSE, paired differences,
equal-time LL, times) and its figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional, Tuple

import matplotlib.ticker
import numpy as np
import pandas as pd

from ...report.figures import caption, legend_below, new_figure, save_figure
from ...report.numbers import format_mean_se, format_value
from .uci_methods import METHODS, SHORT_NAMES

# ----------------------------------------------------------------------------- outputs


def mean_and_standard_error(values: pd.Series) -> Tuple[float, Optional[float]]:
    """Mean and s.e. over splits; a split's NaN makes both NaN (a diverged split is not left out
    silently: the run's metric is not finite, so the run is failed)."""
    values = values.astype(float)
    if values.isna().any():
        return math.nan, None
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None  # one split: no s.e.
    return float(values.mean()), se


def _iterations(method: str, part: pd.DataFrame, cfg) -> str:
    """How the method stopped, with its median count: L-BFGS iterations or Adam epochs."""
    median = int(round(float(part["iterations"].median())))
    if part["optimizer"].iloc[0] == "lbfgs":
        converged = int(part["converged"].sum())
        text = f"L-BFGS {median} it. ({converged}/{len(part)} converged"
        if converged < len(part) and "stop" in part:  # why the others did not (records of older runs lack it)
            why = part.loc[~part["converged"].astype(bool), "stop"].dropna().map(_why_not).value_counts()
            text += "; " + ", ".join(f"{count}: {reason}" for reason, count in why.items())
        return text + ")"
    stopped = int(part["stopped_early"].sum())
    return f"Adam {median} ep. ({stopped}/{len(part)} stopped by validation)"


def _why_not(stop: str) -> str:
    """How an L-BFGS run stopped without converging, in a few words (``NOT converged: reached the
    iteration limit (largest gradient entry 0.02)`` -> ``reached the iteration limit``)."""
    text = str(stop).split(";")[-1].replace("NOT converged:", "").split("(")[0].strip()
    return text or "not converged"


def summary_table(records: pd.DataFrame, methods: List[str], cfg, reference: Optional[str] = None) -> pd.DataFrame:
    """One row per method: mean ± s.e. over splits of the test LL and RMSE (original
    units), the test LL minus the reference closed form's on the same split (paired, so
    the split-to-split spread cancels: the column that says whether a difference is
    real), the test LL at the reference's training time, and medians over splits of
    training seconds, iterations and prediction time. Rounded by the shared
    :func:`~cfbnn_cli.report.numbers.format_mean_se` like every cfbnn table."""
    base = records[records["method"] == reference].set_index("split")["test_ll"] if reference is not None else None
    rows = []
    for method in methods:
        part = records[records["method"] == method]
        equal = part["equal_time_test_ll"].astype(float)
        paired = "—"
        if base is not None and method != reference:
            difference = (part.set_index("split")["test_ll"] - base).dropna()
            paired = format_mean_se(*mean_and_standard_error(difference), signed=True, scientific=False)
        rows.append(
            {
                "Method": METHODS[method],
                "Test LL": format_mean_se(*mean_and_standard_error(part["test_ll"])),
                f"Test LL − {SHORT_NAMES.get(reference, 'closed form')} (paired)": paired,
                "RMSE": format_mean_se(*mean_and_standard_error(part["rmse"])),
                "Test LL at closed form's time": (
                    format_mean_se(*mean_and_standard_error(equal)) if equal.notna().all() else "—"
                ),
                "Train s (median)": format_value(part["train_seconds"].median()),
                "Stopping": _iterations(method, part, cfg),
                "Predict ms / 1000 pts (median)": format_value(1e3 * part["predict_seconds_per_1000"].median()),
            }
        )
    return pd.DataFrame(rows).set_index("Method")


def summary_data(records: pd.DataFrame, methods: List[str], reference: Optional[str] = None) -> pd.DataFrame:
    """The numbers of :func:`summary_table` (``uci.csv``), one per column: per method the mean
    and s.e. over splits of the test LL, the paired difference to ``reference``, the RMSE and
    the test LL at the reference's time; the medians of training seconds, iterations and
    prediction milliseconds per 1000 points; how many splits converged (L-BFGS) or stopped by
    validation (Adam)."""
    base = records[records["method"] == reference].set_index("split")["test_ll"] if reference is not None else None
    rows = []
    for method in methods:
        part = records[records["method"] == method]
        equal = part["equal_time_test_ll"].astype(float)
        paired = (None, None)
        if base is not None and method != reference:
            paired = mean_and_standard_error((part.set_index("split")["test_ll"] - base).dropna())
        lbfgs = part["optimizer"].iloc[0] == "lbfgs"
        rows.append(
            {
                "method": method,
                "splits": len(part),
                "test_ll": mean_and_standard_error(part["test_ll"])[0],
                "test_ll_se": mean_and_standard_error(part["test_ll"])[1],
                "test_ll_minus_reference": paired[0],
                "test_ll_minus_reference_se": paired[1],
                "reference": reference,
                "rmse": mean_and_standard_error(part["rmse"])[0],
                "rmse_se": mean_and_standard_error(part["rmse"])[1],
                "test_ll_at_reference_time": mean_and_standard_error(equal)[0] if equal.notna().all() else None,
                "test_ll_at_reference_time_se": mean_and_standard_error(equal)[1] if equal.notna().all() else None,
                "train_seconds_median": float(part["train_seconds"].median()),
                "optimizer": part["optimizer"].iloc[0],
                "iterations_median": float(part["iterations"].median()),
                "converged_splits": int(part["converged"].sum()) if lbfgs else None,
                "stopped_by_validation_splits": None if lbfgs else int(part["stopped_early"].sum()),
                "predict_ms_per_1000_median": float(1e3 * part["predict_seconds_per_1000"].median()),
            }
        )
    return pd.DataFrame(rows)


def plot_paired_differences(
    records: pd.DataFrame, methods: List[str], reference: Optional[str], title: str, path: Path
) -> str:
    """Left: each method's test LL minus the reference closed form's on the same split (one
    dot per split, the mean as a bar; right of zero = better than the closed form). Right:
    mean test LL (± s.e.) against the median training time, the accuracy-for-cost view."""
    fig, axes = new_figure(2, width=7.5, height=max(2.8, 1.2 + 0.3 * len(methods)))
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    rows = list(reversed(methods))  # the first method on top
    if reference is not None:
        base = records[records["method"] == reference].set_index("split")["test_ll"]
        for row, method in enumerate(rows):
            difference = (records[records["method"] == method].set_index("split")["test_ll"] - base).dropna()
            axes[0].plot(difference, np.full(len(difference), row), "o", ms=2.5, alpha=0.6, color=colors[method])
            axes[0].plot([difference.mean()] * 2, [row - 0.3, row + 0.3], "-", lw=2, color=colors[method])
        axes[0].axvline(0.0, color="0.5", lw=0.8, ls="--")
        axes[0].set_xlabel(f"test LL − {SHORT_NAMES[reference]}\n(same split, nats/point)")
    axes[0].set_yticks(range(len(rows)), [SHORT_NAMES[m] for m in rows])
    axes[0].set_ylim(-0.6, len(rows) - 0.4)
    for method in methods:
        part = records[records["method"] == method]
        mean, se = mean_and_standard_error(part["test_ll"])
        axes[1].errorbar(
            float(part["train_seconds"].median()),
            mean,
            yerr=se or 0.0,
            fmt="o",
            ms=4,
            color=colors[method],
            capsize=2,
            label=SHORT_NAMES[method],
        )
    axes[1].set_xscale("log")
    # plain-number ticks (1, 2, 5, 10, ...) and no minor labels: matplotlib's default minor
    # labels on a log axis spanning less than a decade print on top of each other
    axes[1].xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[1].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_xlabel("training time per split\n(median, s)")
    axes[1].set_ylabel("test LL (mean ± s.e.)")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=6, frameon=False)
    fig.suptitle(title, fontsize=8)
    return save_figure(fig, path)


def plot_coverage(records: pd.DataFrame, methods: List[str], title: str, path: Path) -> Optional[str]:
    """Calibration: each method's share of test targets inside its predictive's central intervals of
    nominal level 50/80/90/95 % (mean ± s.e. over splits), against the diagonal of a calibrated one."""
    levels = [int(column.split("_")[1]) for column in records.columns if column.startswith("coverage_")]
    if not levels:
        return None
    levels.sort()
    fig, axes = new_figure(1, width=4.8, height=3.6)
    ax = axes[0]
    ax.plot([0.45, 1.0], [0.45, 1.0], color="0.5", ls=":", lw=1, label="calibrated")
    for i, method in enumerate(methods):
        part = records[records["method"] == method]
        stats = [mean_and_standard_error(part[f"coverage_{level}"].astype(float)) for level in levels]
        ax.errorbar(
            [level / 100 for level in levels],
            [m for m, _ in stats],
            yerr=[se or 0.0 for _, se in stats],
            fmt="o-",
            ms=3,
            lw=1,
            capsize=2,
            color=f"C{i}",
            label=SHORT_NAMES.get(method, method),
        )
    ax.set_xlabel("nominal level of the central interval")
    ax.set_ylabel("share of test targets inside")
    ax.grid(alpha=0.3)
    legend_below(fig, axes, ncol=2)
    caption(fig, f"{title}: calibration of each method's predictive (mean ± s.e. over splits)")
    return save_figure(fig, path)
