"""The report's sections: one table (and a figure where one helps) per pipeline and protocol --
Table 1, the UCI protocol, Table 2, Figure 1, the test metrics of a fit (regression: test RMSE, LL and
90 %-interval coverage; classification: accuracy and NLL), and a generic table of headline metrics."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd
from matplotlib.ticker import MaxNLocator

from . import paper as paper_values
from . import table1_schema
from .figures import caption, legend_below, new_figure, save_figure
from .grouping import Stat, group_runs, metric_stat, run_label, seeds_text, stat, swept_keys
from .metric_keys import (
    CLASSIFICATION_HEADLINES,
    CONVERGED_KEYS,
    REGRESSION_HEADLINES,
    deterministic_key,
    headline_value,
    monte_carlo_key,
    monte_carlo_sizes,
    uci_key,
    uci_methods,
    vae_key,
    vae_variants,
)
from .numbers import format_mean_se, format_value
from .records import MISSING, config_value, safe_name

# a pipeline's protocols are separate tables
VARIANT_KEYS = {"train_regression": "protocol"}
GRADIENT_VARIANCE = "gradient_variance"  # Table 1's protocol: its runs that measured nothing are not a Table 1
COMMAND_WORDS = {"train_regression": "train regression", "vae": "vae", "imagenet_predict": "imagenet-predict"}


# ----------------------------------------------------------------------------- tables


def headline_metrics(metrics: Sequence[str]) -> List[str]:
    """The metrics worth a column in a generic table: final/test numbers, not every detail."""
    pattern = re.compile(
        r"^(final_test_|deterministic/top|monte_carlo/N(1|16|512)/top1_mean|calibration/variance_corrected"
        r"|features/(train|held_out)_images)"
    )
    chosen = [m for m in metrics if pattern.search(m)]
    return chosen or list(metrics)[:12]


def generic_table(runs, keys) -> pd.DataFrame:
    metrics = headline_metrics(sorted({m for run in runs for m in run["metrics"]}))
    rows = []
    for group, members in group_runs(runs, keys):
        row = dict(group)
        for metric in metrics:
            row[metric] = metric_stat(members, metric).text()
        row.update({"runs": len(members), "seeds": seeds_text(members)})
        rows.append(row)
    return pd.DataFrame(rows)


def gradvar_layout(runs) -> Tuple[List[int], List[str]]:
    """The epochs and layers Table 1's metric keys cover, over runs."""
    return table1_schema.layout(m for run in runs for m in run["metrics"])


def epoch_heading(epoch: int, runs) -> str:
    """Table 1's column group over runs: their last epoch where they agree on it, and the share
    of them whose training had converged."""
    last = {config_value(run, "trainer.epochs") for run in runs}
    converged = metric_stat(runs, "train/converged")
    return table1_schema.epoch_heading(
        epoch, next(iter(last)) if len(last) == 1 else None, converged.mean if converged.n else None
    )


def table1_table(runs, keys) -> pd.DataFrame:
    """Table 1 over runs (:mod:`.table1_schema`): rows (group, the paper's two estimators and their
    ratio), columns epoch x layer (the headings over all the runs, so that every group has the same
    columns), cells "weight means / log σ" as mean ± s.e. over seeds (the ratio: of the per-run
    ratios); ``—`` where a measurement has no value, empty where a group's runs did not measure it
    (a layer their network does not have)."""
    epochs, layers = gradvar_layout(runs)
    headings = {epoch: epoch_heading(epoch, runs) for epoch in epochs}  # one set of columns for every group
    rows = []
    for group, members in group_runs(runs, keys):
        measured = {m for run in members for m in run["metrics"]}

        def cell(key, members=members, measured=measured):
            if key not in measured:  # a layer or epoch this group's runs do not have: an empty cell
                return ""
            return metric_stat(members, key).text(sig=table1_schema.DIGITS) or MISSING

        body = table1_schema.table_rows(
            [*table1_schema.PAPER_ESTIMATORS, table1_schema.RATIO], epochs, layers, headings.__getitem__, cell
        )
        for label, columns in body:
            rows.append({**group, "Estimator": label, **columns, "runs": len(members), "seeds": seeds_text(members)})
    return pd.DataFrame(rows)


def uci_table(runs, keys) -> pd.DataFrame:
    """The UCI protocol over runs: rows (group, method); test LL and RMSE. One run keeps its
    own mean ± s.e. over splits; several runs give mean ± s.e. over the runs."""
    rows = []
    for group, members in group_runs(runs, keys):
        for method in uci_methods(m for run in members for m in run["metrics"]):
            row = {**group, "Method": method}
            for column, label in (("test_ll", "Test LL"), ("rmse", "RMSE")):
                s = metric_stat(members, uci_key(method, f"{column}_mean"))
                if s.n == 1:
                    se = metric_stat(members, uci_key(method, f"{column}_se")).mean
                    row[f"{label} (± s.e. over splits)" if len(members) == 1 else label] = format_mean_se(
                        s.mean, se if math.isfinite(se) else None
                    )
                else:
                    row[label] = s.text()
            row.update({"runs": len(members), "seeds": seeds_text(members)})
            rows.append(row)
    return pd.DataFrame(rows)


HEADLINE_LABELS = {
    "test_rmse": "Test RMSE",
    "test_ll": "Test LL",
    "coverage_90": "90 %-interval coverage",
    "test_accuracy": "Test accuracy",
    "test_nll": "Test NLL",
}
# a headline figure's panel: its title and what its axis measures
HEADLINE_PANELS = {
    "test_rmse": ("Test RMSE (lower is better)", "target units"),
    "test_ll": ("Test LL (higher is better)", "nats per test row, target units"),
    "coverage_90": ("90 %-interval coverage", "share of test targets inside\n(dotted: 0.9, calibrated)"),
    "test_accuracy": ("Test accuracy (higher is better)", "share of test rows"),
    "test_nll": ("Test NLL (lower is better)", "nats per test row"),
}
HEADLINES = {"regression": REGRESSION_HEADLINES, "classification": CLASSIFICATION_HEADLINES}


def headline_stat(runs, keys) -> Stat:
    """Mean ± s.e. over ``runs`` of the metric the first of ``keys`` present in each run holds."""
    return stat([headline_value(run["metrics"], keys) for run in runs], [run_label(run) for run in runs])


def present_headlines(runs, kind: str) -> Dict[str, Tuple[str, ...]]:
    """The headline metrics of ``kind`` (``regression``/``classification``) that some run has a value for."""
    return {
        name: keys
        for name, keys in HEADLINES[kind].items()
        if any(headline_value(run["metrics"], keys) is not None for run in runs)
    }


def converged_text(runs) -> str:
    """``"k of n"``: of the runs that judged convergence, how many had converged (``""``: none judged)."""
    judged = [v for run in runs if (v := headline_value(run["metrics"], CONVERGED_KEYS)) is not None]
    return f"{sum(1 for v in judged if v == 1)} of {len(judged)}" if judged else ""


def headline_table(runs, keys, kind: str) -> pd.DataFrame:
    """A fit's test metrics over runs: rows (group), columns the headline metrics of ``kind`` as
    mean ± s.e. over the runs (seeds) of a row, how many of them converged, runs and seeds."""
    headlines = present_headlines(runs, kind)
    judged = any(headline_value(run["metrics"], CONVERGED_KEYS) is not None for run in runs)
    rows = []
    for group, members in group_runs(runs, keys):
        row = dict(group)
        for name, metric_keys in headlines.items():
            row[HEADLINE_LABELS[name]] = headline_stat(members, metric_keys).text()
        if judged:
            row["Converged"] = converged_text(members)
        row.update({"runs": len(members), "seeds": seeds_text(members)})
        rows.append(row)
    return pd.DataFrame(rows)


def regression_table(runs, keys) -> pd.DataFrame:
    return headline_table(runs, keys, "regression")


def classification_table(runs, keys) -> pd.DataFrame:
    return headline_table(runs, keys, "classification")


VAE_COLUMNS = (
    ("test_ll", "Test LL"),
    ("test_elbo", "Test ELBO"),
    ("test_ell", "E[log p(x|z,W)]"),
    ("test_kl_z", "KL(z)"),
    ("test_kl_w", "KL(W) / N"),
    ("best_epoch", "Best epoch"),
    ("epochs", "Epochs trained"),
)


def vae_variants_of(run) -> List[str]:
    return vae_variants(run["metrics"])


def vae_table(runs, keys) -> pd.DataFrame:
    """Table 2 from any mix of ``variant=all`` and single-variant runs: rows (group, variant);
    test LL and the ELBO's terms as mean ± s.e. over the runs (seeds) that trained the variant."""
    keys = [k for k in keys if k != "variant"]
    rows = []
    for group, members in group_runs(runs, keys):
        for variant in sorted({v for run in members for v in vae_variants_of(run)}):
            trained = [run for run in members if variant in vae_variants_of(run)]
            row = {**group, "Variant": variant.upper()}
            for metric, label in VAE_COLUMNS:
                s = metric_stat(trained, vae_key(variant, f"{metric}"))
                row[f"{label} (mean ± s.e. over runs)" if metric == "test_ll" else label] = s.text(sig=5)
                if metric == "test_ll" and any(
                    vae_key(variant, "test_ll_posterior_mean") in r["metrics"] for r in trained
                ):
                    plug_in = metric_stat(trained, vae_key(variant, "test_ll_posterior_mean"))
                    row["Test LL, weights at posterior mean"] = plug_in.text(sig=5)
            row.update({"runs": len(trained), "seeds": seeds_text(trained)})
            rows.append(row)
    frame = pd.DataFrame(rows)
    if "Test LL, weights at posterior mean" in frame.columns:  # runs without that reading
        frame["Test LL, weights at posterior mean"] = frame["Test LL, weights at posterior mean"].fillna("—")
    return frame


def top_k_of(runs) -> int:
    ks = {int(run["metrics"]["evaluation/top_k"]) for run in runs if run["metrics"].get("evaluation/top_k") is not None}
    if not ks:  # runs written before top_k was configurable report top-5
        return 5
    return max(ks)


def inner_samples_of(runs) -> List[int]:
    return monte_carlo_sizes(name for run in runs for name in run["metrics"])


def paired_stat(runs, a: str, b: str) -> Stat:
    """Mean ± s.e. over runs of the per-run difference ``metric a - metric b``."""
    paired = [run for run in runs if run["metrics"].get(a) is not None and run["metrics"].get(b) is not None]
    return stat([run["metrics"][a] - run["metrics"][b] for run in paired], [run_label(run) for run in paired])


def figure1_table(runs, keys) -> pd.DataFrame:
    """Figure 1 over runs: rows (group, method, N_inner); top-1 and top-k as mean ± s.e. over
    runs (seeds), the per-run difference to the deterministic prediction, and the s.d.
    over the outer trials (averaged over runs)."""
    rows = []
    for group, members in group_runs(runs, keys):
        k = top_k_of(members)
        for n in inner_samples_of(members):
            row = {**group, "Method": "Monte Carlo", "N_inner": str(n)}
            for kk in (1, k):
                row[f"Top-{kk}"] = metric_stat(members, monte_carlo_key(n, f"top{kk}_mean")).text(sig=3)
                row[f"Top-{kk} − deterministic"] = paired_stat(
                    members, monte_carlo_key(n, f"top{kk}_mean"), deterministic_key(f"top{kk}")
                ).text(sig=3, signed=True, scientific=False)
                sd = metric_stat(members, monte_carlo_key(n, f"top{kk}_sd"))
                row[f"Top-{kk} s.d. over trials"] = format_value(sd.mean, sig=2) if sd.n else ""
            row.update({"runs": len(members), "seeds": seeds_text(members)})
            rows.append(row)
        row = {**group, "Method": "Deterministic argmax ŷ (eq. 42)", "N_inner": ""}
        for kk in (1, k):
            row.update(
                {
                    f"Top-{kk}": metric_stat(members, deterministic_key(f"top{kk}")).text(sig=3),
                    f"Top-{kk} − deterministic": "",
                    f"Top-{kk} s.d. over trials": "",
                }
            )
        row.update({"runs": len(members), "seeds": seeds_text(members)})
        rows.append(row)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- figures


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def describe_runs(runs) -> str:
    names = sorted({str(config_value(run, "data.name", "?")) for run in runs})
    return f"data {', '.join(names)}; {plural(len(runs), 'run')}, seeds {seeds_text(runs) or '?'}"


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
        stats = [headline_stat(members, metric_keys) for _, members in groups]
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
        if name == "coverage_90":  # the nominal level, inside the axis with a margin
            ax.axvline(0.9, color="0.5", ls=":", lw=1)
            low, high = ax.get_xlim()
            low, high = min(low, 0.9), max(high, 0.9)
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


# ----------------------------------------------------------------------------- one table per pipeline variant


@dataclass
class Section:
    """The runs of one table: a pipeline and, where it has several, a protocol."""

    pipeline: str
    variant: Optional[str]
    runs: List[dict]

    @property
    def key(self) -> str:
        return self.pipeline if self.variant is None else f"{self.pipeline}/{self.variant}"

    @property
    def name(self) -> str:
        """The report's files for this section are ``<name>.csv``, ``<name>_table.*``, ..."""
        return f"report_{safe_name(self.pipeline)}" + (f"_{safe_name(self.variant)}" if self.variant else "")

    @property
    def note(self) -> str:
        """What the title adds: runs of Table 1's protocol that measured no gradient variance say so."""
        if self.variant is None and any(
            run.get("config", {}).get("protocol") == GRADIENT_VARIANCE for run in self.runs
        ):
            return " (protocol gradient_variance; no gradient variance measured)"
        return ""

    @property
    def kind(self) -> str:
        metrics = {m for run in self.runs for m in run["metrics"]}
        if self.pipeline == "vae" and vae_variants(metrics):
            return "table2"
        if self.pipeline == "imagenet_predict" and deterministic_key("top1") in metrics:
            return "figure1"
        if self.pipeline == "train_regression" and table1_schema.layout(metrics)[0]:
            return "table1"
        if self.pipeline == "train_regression" and uci_methods(metrics):
            return "uci"
        for kind in ("regression", "classification"):
            if present_headlines(self.runs, kind):
                return kind
        return "generic"

    def parts(self) -> List[Tuple[str, str]]:
        """``(file-name suffix, kind)`` of each table the section writes: its own, and for Table 1's
        runs also their test metrics (``_test_metrics``)."""
        parts = [("", self.kind)]
        if self.kind == "table1" and present_headlines(self.runs, "regression"):
            parts.append(("_test_metrics", "regression"))
        return parts


def measured_gradient_variance(run) -> bool:
    return bool(table1_schema.layout(run["metrics"])[0])


def sections(runs: Sequence[dict]) -> List[Section]:
    """The runs by pipeline and protocol. Runs of Table 1's protocol that measured no gradient
    variance (``gradient_variance.epochs=[]``) are a section of their own, under no protocol name:
    their test metrics, not a Table 1 of empty cells."""
    out: Dict[Tuple[str, Optional[str]], List[dict]] = {}
    for run in runs:
        key = VARIANT_KEYS.get(run["pipeline"])
        variant = run.get("config", {}).get(key) if key else None
        if variant == GRADIENT_VARIANCE and not measured_gradient_variance(run):
            variant = None
        out.setdefault((run["pipeline"], None if variant is None else str(variant)), []).append(run)
    return [Section(p, v, out[(p, v)]) for p, v in sorted(out, key=lambda pv: (pv[0], pv[1] or ""))]


TABLE_BUILDERS = {
    "table1": table1_table,
    "uci": uci_table,
    "table2": vae_table,
    "figure1": figure1_table,
    "regression": regression_table,
    "classification": classification_table,
    "generic": generic_table,
}
FIGURES = {
    "table1": figure_table1,
    "table2": figure_vae,
    "figure1": figure_figure1,
    "regression": figure_regression,
    "classification": figure_classification,
}
TITLES = {
    "table1": "Table 1, gradient variance",
    "uci": "UCI protocol",
    "table2": "Table 2, VAE",
    "figure1": "Figure 1, Monte Carlo vs deterministic prediction",
    "regression": "test metrics",
    "classification": "test metrics",
    "generic": "headline metrics",
}


def section_keys(section: Section) -> List[str]:
    """The config keys that group the section's runs (not its protocol, which names the section)."""
    keys = swept_keys(section.runs)
    if section.variant is not None:
        keys = [k for k in keys if k != VARIANT_KEYS[section.pipeline]]
    return keys


def section_table(section: Section, kind: Optional[str] = None) -> Tuple[pd.DataFrame, List[str]]:
    """The table of ``kind`` (default: the section's own) over the section's runs, and its group keys;
    a cell no group has a value for is empty."""
    keys = section_keys(section)
    table = TABLE_BUILDERS[kind or section.kind](section.runs, keys)
    return table.fillna(""), keys
