"""The report's figures, one per kind of section where one helps (``figure(runs, path, keys) ->
caption or None``): Table 1's gradient variances, Table 2, Figure 1 and a fit's headline metrics."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from matplotlib.ticker import MaxNLocator

from . import paper as paper_values
from . import table1_schema
from .figures import caption, legend_below, new_figure, save_figure
from .grouping import Stat, group_runs, metric_stat
from .metric_keys import (
    deterministic_key,
    monte_carlo_key,
    vae_key,
)
from .section_tables import (
    HEADLINE_PANELS,
    describe_runs,
    epoch_heading,
    gradvar_layout,
    headline_stat,
    inner_samples_of,
    present_headlines,
    top_k_of,
    vae_variants_of,
)

PAPER_LATE_EPOCH = 50  # the paper's Table 1 "after training" column


def figure_table1(runs, path, keys: Sequence[str] = ()) -> Optional[str]:
    epochs, layers = gradvar_layout(runs)
    if not epochs:
        return None
    fig, axes = new_figure(len(epochs), width=max(3.6 * len(epochs), 4.5), height=3.4, sharey=True)
    pairs = [(layer, kind) for layer in layers for kind in ("mean", "scale")]
    for ax, epoch in zip(axes, epochs):
        stats = [metric_stat(runs, table1_schema.ratio_key(epoch, layer, kind)) for layer, kind in pairs]
        ax.bar(
            range(len(pairs)),
            [s.mean for s in stats],
            0.6,
            yerr=[s.se or 0.0 for s in stats],
            capsize=3,
            color="C1",
            label="cfbnn: mean ± s.e. over runs",
        )
        _run_markers(ax, stats, 0.0, "0.25", "cfbnn: one run")
        # the paper's markers only where they compare: at initialization, and after its 50 epochs only on
        # a panel at epoch 50 (a ratio after 1 epoch of synthetic data is no match for 50 epochs of MSD)
        comparable = epoch in (0, PAPER_LATE_EPOCH)
        when, label = (
            ("init", "paper (MSD), at initialization") if epoch == 0 else ("late", "paper (MSD), after 50 epochs")
        )
        paper_ratios = [
            paper_values.table1_ratio(when, layer, kind) if (when, layer, kind) in paper_values.TABLE1 else math.nan
            for layer, kind in pairs
        ]
        if comparable:
            ax.plot(
                range(len(pairs)),
                paper_ratios,
                "_",
                color="k" if epoch == 0 else "0.45",
                ms=18,
                mew=2,
                ls="none",
                label=label,
            )
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xticks(range(len(pairs)))
        ax.set_xticklabels([f"{layer}\n{'means' if kind == 'mean' else 'log σ'}" for layer, kind in pairs])
        ax.set_title(epoch_heading(epoch, runs))
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("gradient variance ratio\nsampling / analytic")
    legend_below(fig, axes, ncol=3)
    caption(
        fig,
        f"Table 1: how much larger the sampling estimator's gradient variance is than the analytic one's, per "
        f"layer, for the weight means and log σ. {describe_runs(runs)}",
    )
    return save_figure(fig, path)


def _run_markers(ax, stats: Sequence[Stat], offset: float, color: str, label: str) -> None:
    """One open marker per run for each of ``stats``, at x = its index + ``offset``."""
    for i, s in enumerate(stats):
        ax.plot(
            [i + offset] * len(s.values), s.values, "o", ms=3, mfc="none", color=color, label=label if i == 0 else None
        )


def _errorbar(ax, x, stats: Sequence[Stat], **style):
    """The means of ``stats`` at ``x``, ± one standard error (none where a single run gives no s.e.)."""
    return ax.errorbar(x, [s.mean for s in stats], yerr=[s.se or 0.0 for s in stats], **style)


def figure_vae(runs, path, keys: Sequence[str] = ()) -> Optional[str]:
    variants = sorted({v for run in runs for v in vae_variants_of(run)})
    if not variants:
        return None
    fig, axes = new_figure(1, width=4.2, height=3.2)
    ax = axes[0]
    stats = [metric_stat([r for r in runs if v in vae_variants_of(r)], vae_key(v, "test_ll")) for v in variants]
    _errorbar(
        ax,
        range(len(variants)),
        stats,
        fmt="s",
        ms=6,
        capsize=4,
        color="C0",
        label="mean ± s.e. over runs",
    )
    _run_markers(ax, stats, 0.12, "0.3", "one run (seed)")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([v.upper() for v in variants])
    ax.set_xlim(-0.5, len(variants) - 0.5)
    ax.set_ylabel("test log-likelihood per point\n(original units, nats)")
    ax.grid(axis="y", alpha=0.3)
    legend_below(fig, axes, ncol=2)
    caption(fig, f"Table 2: VAE test log-likelihood by variant; {describe_runs(runs)}", width_chars=60)
    return save_figure(fig, path)


def figure_figure1(runs, path, keys: Sequence[str] = ()) -> Optional[str]:
    inner = inner_samples_of(runs)
    if not inner:
        return None
    k = top_k_of(runs)
    fig, axes = new_figure(2, width=7.0, height=3.3)
    for ax, kk in zip(axes, (1, k)):
        for run in runs:
            values = [run["metrics"].get(monte_carlo_key(n, f"top{kk}_mean")) for n in inner]
            ax.plot(inner, values, "-", lw=0.8, color="C0", alpha=0.35, label="Monte Carlo: one run (seed)")
        stats = [metric_stat(runs, monte_carlo_key(n, f"top{kk}_mean")) for n in inner]
        _errorbar(
            ax,
            inner,
            stats,
            fmt="o-",
            ms=4,
            capsize=2,
            color="C0",
            label="Monte Carlo: mean ± s.e. over runs",
        )
        det = metric_stat(runs, deterministic_key(f"top{kk}"))
        if det.n:
            ax.axhline(det.mean, color="k", ls="--", lw=1.2, label="deterministic argmax ŷ: mean (band ± s.e.)")
            if det.se:
                ax.axhspan(det.mean - det.se, det.mean + det.se, color="k", alpha=0.1, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(inner)
        ax.set_xticklabels([str(n) for n in inner])
        ax.set_xlabel("N_inner (samples averaged per prediction)")
        ax.set_ylabel(f"top-{kk} test accuracy")
        ax.set_title(f"top-{kk}")
        ax.grid(alpha=0.3)
    legend_below(fig, axes, ncol=3)
    caption(
        fig,
        f"Figure 1: Monte Carlo prediction with N_inner samples vs the deterministic prediction; {describe_runs(runs)}",
    )
    return save_figure(fig, path)


def headline_figure(runs, path, keys: Sequence[str], kind: str) -> Optional[str]:
    """One panel per headline metric (regression: test RMSE, test LL, 90 %-interval coverage;
    classification: accuracy, NLL), one row per configuration (group of ``keys``), in the table's
    order: mean ± s.e. over the runs (seeds) of the group, and each run as an open circle."""
    headlines = present_headlines(runs, kind)
    if not headlines:
        return None
    groups = group_runs(runs, keys)
    labels = [", ".join(group.values()) or "all runs" for group, _ in groups]
    longest = max(len(label) for label in labels)
    panels = len(headlines)
    fig, axes = new_figure(
        panels, width=max(2.3 * panels + 0.07 * longest, 4.5), height=1.6 + 0.3 * len(groups), sharey=True
    )
    rows = list(range(len(groups)))
    for ax, (name, metric_keys) in zip(axes, headlines.items()):
        stats = [headline_stat(members, metric_keys, name) for _, members in groups]
        ax.errorbar(
            [s.mean for s in stats],
            rows,
            xerr=[s.se or 0.0 for s in stats],
            fmt="s",
            ms=5,
            capsize=3,
            color="C0",
            label="mean ± s.e. over the runs (seeds)",
        )
        for row, s in zip(rows, stats):
            ax.plot(
                s.values,
                [row + 0.22] * len(s.values),
                "o",
                ms=3,
                mfc="none",
                color="0.35",
                label="one run (seed)" if row == 0 else None,
            )
        if name == "coverage_90":  # the nominal level (in per cent, as the values), inside the axis with a margin
            ax.axvline(90.0, color="0.5", ls=":", lw=1)
            low, high = ax.get_xlim()
            low, high = min(low, 90.0), max(high, 90.0)
            ax.set_xlim(low - 0.05 * (high - low), high + 0.05 * (high - low))
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))  # tick labels that do not run into each other
        title, unit = HEADLINE_PANELS[name]
        ax.set_title(title)
        ax.set_xlabel(unit)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(rows)
    axes[0].set_yticklabels(labels)
    axes[0].set_ylim(len(groups) - 0.5, -0.5)  # the first configuration on top, as in the table
    legend_below(fig, axes, ncol=3)
    # the factors' names in the caption: a long list as the axis label runs off the figure
    named = f" (rows: {', '.join(keys)})" if keys else ""
    caption(fig, f"Test metrics per configuration{named}; {describe_runs(runs)}")
    return save_figure(fig, path)


def figure_regression(runs, path, keys: Sequence[str] = ()) -> Optional[str]:
    return headline_figure(runs, path, keys, "regression")


def figure_classification(runs, path, keys: Sequence[str] = ()) -> Optional[str]:
    return headline_figure(runs, path, keys, "classification")
