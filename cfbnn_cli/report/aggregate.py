"""`cfbnn report PATH`: every ``results.json`` under a run or sweep dir, one table per pipeline.

Runs are grouped by the configuration keys whose values differ between them (the
swept keys, ``seed`` excepted: seeds are the replicates); each metric is reported as
mean ± standard error over the runs of a group (``n`` runs; the standard error is
``sd / sqrt(n)``, blank for one run). Written beside the runs as
``report_<pipeline>.{csv,md,tex}`` (the CSV in long form with numeric mean, s.e. and
n) plus a comparison figure for the pipelines that have one: Table 2 (VAE test LL by
variant), Table 1 (gradient-variance ratios by layer) and Figure 1 (MC top-1 vs
``N_inner`` with seed bands and the deterministic line). A corrupt ``results.json``
is named and skipped; a path with none is an error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pandas as pd

from ..runtime.errors import CfbnnError, DataError
from ..runtime.io import atomic_write_text
from .figures import new_figure, save_figure
from .tables import write_table

log = logging.getLogger(__name__)
# keys that differ between runs without being an experimental factor
IGNORED_KEYS = re.compile(r"^(seed|resume|device|features\.cache_dir|data\.path|data\.root|evaluation\.checkpoint)$")


def flatten(tree, prefix: str = "") -> Dict[str, object]:
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = json.dumps(tree) if isinstance(tree, (list, dict)) else tree
    return out


def safe_name(text) -> str:
    """``text`` as a plain file-name part: letters, digits, ``_`` and ``-`` only (a
    pipeline name read from a results.json must not lead a path anywhere)."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", str(text)).strip("_-")
    return cleaned[:64] or "unnamed"


def _results_files(root: Path) -> List[Path]:
    """Every ``results.json`` under ``root``: symbolic links to folders are not followed,
    and a linked file is read only when it resolves inside ``root``."""
    inside = root.resolve()
    files = []
    for folder, _, names in os.walk(root, followlinks=False):
        if "results.json" not in names:
            continue
        file = Path(folder) / "results.json"
        if file.is_symlink() and not file.resolve().is_relative_to(inside):
            _skip(file, f"a symbolic link out of {root} ({file.resolve()})")
            continue
        files.append(file)
    return sorted(files)


def _skip(file, reason) -> None:
    log.warning("skipping %s: %s", file, reason)
    print(f"cfbnn report: skipping {file}: {reason}", file=sys.stderr)


def _check_record(record) -> None:
    """Raise ``ValueError`` naming what makes ``record`` unusable for a report."""
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict) or "pipeline" not in record:
        raise ValueError("not a cfbnn results record (pipeline/metrics missing)")
    if not isinstance(record["pipeline"], str):
        raise ValueError(f"its pipeline is {record['pipeline']!r}, not a name")
    for name, value in record["metrics"].items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"metric {name!r} is {value!r}, not a number")
    if record.get("status", "complete") != "complete":
        raise ValueError(f"its status is {record.get('status')!r} (a failed or unfinished run)")


def collect(path) -> List[dict]:
    """Every readable, complete ``results.json`` under ``path`` (any other is named and skipped)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"cfbnn report: {path} does not exist")
    files = [path] if path.is_file() else _results_files(path)
    runs = []
    for file in files:
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
            _check_record(record)
        except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            _skip(file, error)
            continue
        record["_path"] = str(file.parent)
        runs.append(record)
    if not runs:
        raise DataError(f"cfbnn report: no results.json of a complete run under {path} (nothing to aggregate; did the runs finish?)")
    return runs


def swept_keys(runs: Sequence[dict]) -> List[str]:
    """Config keys whose values differ between ``runs`` (seeds and paths excepted)."""
    flat = [flatten(run.get("config", {})) for run in runs]
    keys = sorted(set().union(*flat))
    return [k for k in keys if not IGNORED_KEYS.match(k) and len({json.dumps(f.get(k), default=str) for f in flat}) > 1]


def summarize(runs: Sequence[dict]) -> pd.DataFrame:
    """Long table: one row per (group, metric) with mean, se, n."""
    keys = swept_keys(runs)
    rows = []
    for run in runs:
        flat = flatten(run.get("config", {}))
        group = {k: flat.get(k) for k in keys}
        for metric, value in run["metrics"].items():
            rows.append({**group, "metric": metric, "value": math.nan if value is None else float(value)})
    frame = pd.DataFrame(rows)
    by = keys + ["metric"]
    grouped = frame.groupby(by, dropna=False, sort=True)["value"]
    summary = grouped.agg(mean="mean", sd="std", n="count").reset_index()
    summary["se"] = summary["sd"] / summary["n"].pow(0.5)
    return summary.drop(columns="sd")[by + ["mean", "se", "n"]]


def _pm(mean, se, n) -> str:
    if not math.isfinite(mean):
        return ""
    digits = 4 if abs(mean) < 10 else 2
    return f"{mean:.{digits}f} ± {se:.{digits}f}" if n > 1 and math.isfinite(se) else f"{mean:.{digits}f}"


def wide_table(summary: pd.DataFrame, metrics: Optional[Sequence[str]] = None) -> pd.DataFrame:
    keys = [c for c in summary.columns if c not in ("metric", "mean", "se", "n")]
    part = summary if metrics is None else summary[summary["metric"].isin(metrics)]
    part = part.assign(cell=[_pm(m, s, n) for m, s, n in zip(part["mean"], part["se"], part["n"])])
    if keys:
        table = part.pivot_table(index=keys, columns="metric", values="cell", aggfunc="first")
        table["runs"] = part.groupby(keys)["n"].max()
    else:
        table = part.set_index("metric")[["cell"]].T
        table.index = ["all runs"]
        table["runs"] = int(part["n"].max())
    return table


def vae_table(runs: Sequence[dict]) -> pd.DataFrame:
    """Table 2 from any mix of ``variant=all`` and single-variant runs: one row per variant."""
    rows = []
    for run in runs:
        for metric, value in run["metrics"].items():
            match = re.fullmatch(r"vae/(v\d)/(test_ll|test_elbo)", metric)
            if match and value is not None:
                rows.append({"variant": match.group(1), "metric": match.group(2), "value": float(value)})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    stats = frame.groupby(["variant", "metric"])["value"].agg(["mean", "std", "count"]).reset_index()
    stats["cell"] = [_pm(m, s / math.sqrt(c) if c > 1 else math.nan, c) for m, s, c in zip(stats["mean"], stats["std"], stats["count"])]
    table = stats.pivot(index="variant", columns="metric", values="cell")
    table["runs"] = stats.groupby("variant")["count"].max()
    table.index = [v.upper() for v in table.index]
    table.index.name = "Variant"
    return table.rename(columns={"test_ll": "Test LL (mean ± s.e. over runs)", "test_elbo": "Test ELBO"})


def _figure_vae(runs, path) -> Optional[str]:
    values = {}
    for run in runs:
        for metric, value in run["metrics"].items():
            match = re.fullmatch(r"vae/(v\d)/test_ll", metric)
            if match and value is not None:
                values.setdefault(match.group(1).upper(), []).append(float(value))
    if not values:
        return None
    fig, axes = new_figure(1, width=3.3, height=2.4)
    names = sorted(values)
    means = [sum(values[n]) / len(values[n]) for n in names]
    errors = [pd.Series(values[n]).std() / math.sqrt(len(values[n])) if len(values[n]) > 1 else 0.0 for n in names]
    axes[0].bar(names, means, yerr=errors, capsize=3)
    axes[0].set_ylim(min(means) - 3 * max(max(errors), 0.5), max(means) + 3 * max(max(errors), 0.5))
    axes[0].set_ylabel("test log-likelihood")
    return save_figure(fig, path)


def _figure_imagenet(runs, path) -> Optional[str]:
    rows = []
    for run in runs:
        for metric, value in run["metrics"].items():
            match = re.fullmatch(r"monte_carlo/N(\d+)/top1_mean", metric)
            if match and value is not None:
                rows.append({"N": int(match.group(1)), "top1": float(value)})
    if not rows:
        return None
    frame = pd.DataFrame(rows).groupby("N")["top1"].agg(["mean", "min", "max"]).reset_index()
    fig, axes = new_figure(1, width=3.3, height=2.4)
    axes[0].plot(frame["N"], frame["mean"], "o-", ms=3, label="Monte Carlo (mean over runs)")
    axes[0].fill_between(frame["N"], frame["min"], frame["max"], alpha=0.25, label="min-max over runs")
    deterministic = [run["metrics"].get("deterministic/top1") for run in runs if run["metrics"].get("deterministic/top1") is not None]
    if deterministic:
        axes[0].axhline(sum(deterministic) / len(deterministic), color="k", ls="--", lw=1, label="deterministic")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("N_inner")
    axes[0].set_ylabel("top-1 accuracy")
    axes[0].legend(fontsize=6)
    return save_figure(fig, path)


def _figure_regression(summary, path) -> Optional[str]:
    part = summary[summary["metric"].str.match(r"gradvar_ratio_sampling_over_analytic/.*/mean$")]
    if part.empty:
        return None
    part = part.groupby("metric")[["mean", "se"]].mean()
    fig, axes = new_figure(1, width=4.5, height=2.6)
    labels = [m.split("/", 1)[1].rsplit("/", 1)[0] for m in part.index]
    axes[0].bar(labels, part["mean"], yerr=part["se"].fillna(0), capsize=3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("gradient variance ratio\nsampling / analytic (means)")
    axes[0].tick_params(axis="x", labelrotation=45, labelsize=6)
    return save_figure(fig, path)


def report(path, out: Optional[Path] = None) -> Dict[str, List[str]]:
    """Aggregate ``path``; returns ``{pipeline: [written files]}``."""
    runs = collect(path)
    out = Path(out) if out is not None else (Path(path) if Path(path).is_dir() else Path(path).parent)
    written: Dict[str, List[str]] = {}
    used_names: set = set()
    for pipeline in sorted({run["pipeline"] for run in runs}):
        group = [run for run in runs if run["pipeline"] == pipeline]
        summary = summarize(group)
        name = f"report_{safe_name(pipeline)}"
        while name in used_names:  # two odd names that clean up alike must not overwrite each other
            name += "_"
        used_names.add(name)
        atomic_write_text(out / f"{name}.csv", summary.to_csv(index=False))
        files = [f"{name}.csv"]
        table = vae_table(group) if pipeline == "vae" else wide_table(summary, _headline(summary))
        md = write_table(table, out, f"{name}_table", caption=f"{pipeline}: mean ± s.e. over {len(group)} runs")
        files += list(md)
        figure = {"vae": lambda: _figure_vae(group, out / f"{name}.png"),
                  "imagenet_predict": lambda: _figure_imagenet(group, out / f"{name}.png"),
                  "train_regression": lambda: _figure_regression(summary, out / f"{name}.png")}.get(pipeline)
        if figure is not None and figure():
            files.append(f"{name}.png")
        written[pipeline] = files
        print(f"{pipeline}: {len(group)} runs, grouped by {swept_keys(group) or 'nothing (replicates only)'}\n"
              f"{table.to_markdown()}\n-> {', '.join(str(out / f) for f in files)}\n")
    return written


def _headline(summary: pd.DataFrame) -> List[str]:
    """The metrics worth a column: final/test numbers, not every per-layer detail."""
    metrics = summary["metric"].unique()
    pattern = re.compile(r"^(final_test_|uci/[^/]+/(test_ll|rmse)_mean|deterministic/top|monte_carlo/N(1|16|512)/top1_mean|calibration/variance_corrected|vae/)")
    chosen = [m for m in metrics if pattern.search(m)]
    return chosen or list(metrics)[:12]


def main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="cfbnn report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run dir, a sweep dir or any folder holding results.json files")
    parser.add_argument("--out", default=None, help="where to write the report (default: PATH)")
    args = parser.parse_args(list(argv))
    try:
        report(args.path, args.out)
    except CfbnnError as error:
        print(f"cfbnn: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0
