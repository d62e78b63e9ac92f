"""The report's tables, one builder per kind of section (``builder(runs, keys) -> DataFrame``): Table 1,
the UCI protocol, Table 2, Figure 1's numbers, a fit's test metrics and a generic table of headline
metrics; and the helpers the figures and the reproduction notes share with them."""

from __future__ import annotations

import math
import re
from typing import Dict, List, Sequence, Tuple

import pandas as pd

from . import table1_schema
from .grouping import Stat, group_runs, metric_stat, run_label, seeds_text, stat
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
from .records import MISSING, config_value

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
    "test_ll": "Test LL per row",
    "coverage_90": "90 % interval coverage (%)",
    "test_accuracy": "Test accuracy (%)",
    "test_nll": "Test LL per row",
    "baseline_accuracy": "Logistic regression's accuracy (%)",
    "baseline_nll": "Logistic regression's LL per row",
}
# what a headline's stored value is multiplied by in tables and figures, so that they read as the
# per-run tables (fit.md, classification.md) do: shares in per cent, log-likelihoods (not their
# negatives) per row
HEADLINE_SCALES = {
    "coverage_90": 100.0,
    "test_accuracy": 100.0,
    "baseline_accuracy": 100.0,
    "test_nll": -1.0,
    "baseline_nll": -1.0,
}
# a headline figure's panel: its title and what its axis measures
HEADLINE_PANELS = {
    "test_rmse": ("Test RMSE (lower is better)", "target units"),
    "test_ll": ("Test LL (higher is better)", "nats per test row, target units"),
    "coverage_90": ("90 % interval coverage", "% of test targets inside\n(dotted: 90, calibrated)"),
    "test_accuracy": ("Test accuracy (higher is better)", "% of test rows"),
    "test_nll": ("Test LL (higher is better)", "nats per test row"),
    "baseline_accuracy": ("Logistic regression's accuracy", "% of test rows"),
    "baseline_nll": ("Logistic regression's LL", "nats per test row"),
}
HEADLINES = {"regression": REGRESSION_HEADLINES, "classification": CLASSIFICATION_HEADLINES}


def headline_stat(runs, keys, name: str = "") -> Stat:
    """Mean ± s.e. over ``runs`` of the metric the first of ``keys`` present in each run holds, times
    the headline ``name``'s scale (:data:`HEADLINE_SCALES`)."""
    scale = HEADLINE_SCALES.get(name, 1.0)
    values = [headline_value(run["metrics"], keys) for run in runs]
    return stat([None if v is None else v * scale for v in values], [run_label(run) for run in runs])


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
            row[HEADLINE_LABELS[name]] = headline_stat(members, metric_keys, name).text()
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
