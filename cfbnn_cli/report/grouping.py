"""Grouping runs for ``cfbnn report``: the swept keys, duplicates (same configuration and seed),
and mean ± standard error over the replicates of a group."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from ..runtime.errors import listing
from .numbers import format_mean_se
from .records import MISSING, flatten

# keys that differ between runs without being an experimental factor (seeds are the replicates)
# (runtime.matmul_precision is a factor: TF32 changes the numbers, see docs/cli.md)
IGNORED_KEYS = re.compile(
    r"^(seed|resume|device|runtime\.(?!matmul_precision$).*|logger\..*|distributed\.nproc|features\.(cache_dir|num_workers|batch_size|shard_size)"
    r"|data\.path|data\.root|evaluation\.(checkpoint|batch_size|timing_images))$"
)
# keys that do not change a run's results: two runs equal in everything else (seed included) are duplicates
NOT_SETTINGS = re.compile(
    r"^(resume|device|runtime\.(?!matmul_precision$).*|logger\..*|distributed\.nproc|features\.(cache_dir|num_workers)"
    r"|evaluation\.checkpoint)$"
)


def run_config(run) -> Dict[str, object]:
    """The run's flattened configuration with its input files' content hashes
    (:func:`~.records.input_contents`): runs on different data files differ in them."""
    flat = flatten(run.get("config", {}))
    if flat:  # a run recorded before the key existed multiplied in torch's default precision
        flat.setdefault("runtime.matmul_precision", "highest")
    return {**flat, **run.get("_inputs", {})}


def run_settings(run) -> str:
    """The run's configuration without what does not change its results (the seed stays)."""
    flat = run_config(run)
    return json.dumps({k: v for k, v in sorted(flat.items()) if not NOT_SETTINGS.match(k)}, default=str)


def drop_duplicates(runs: Sequence[dict]) -> Tuple[List[dict], List[Tuple[dict, dict]]]:
    """``(kept, [(duplicate, kept_run), ...])``: of the runs of one pipeline with the same
    configuration and the same seed, only the first (by path) is kept. Such runs repeat
    one experiment; averaging them would shrink the standard error without any new
    replicate (two identical seed-0 runs gave ``± 0.0000``)."""
    kept, duplicates, first = [], [], {}
    for run in sorted(runs, key=lambda r: r.get("_path", "")):
        key = (run["pipeline"], run_settings(run))
        if key in first:
            duplicates.append((run, first[key]))
        else:
            first[key] = run
            kept.append(run)
    return kept, duplicates


# ----------------------------------------------------------------------------- grouping


def swept_keys(runs: Sequence[dict]) -> List[str]:
    """Config keys whose values differ between ``runs``: not the seed, not a key that
    follows the seed in every run (``data.seed: ${seed}``), not paths and devices."""
    flat = [run_config(run) for run in runs]
    keys = sorted(set().union(*flat)) if flat else []
    out = []
    for key in keys:
        if IGNORED_KEYS.match(key):
            continue
        if len({json.dumps(f.get(key), default=str) for f in flat}) < 2:
            continue
        if all(key in f and "seed" in f and f[key] == f["seed"] for f in flat):
            continue  # follows the seed: a replicate, not a factor
        out.append(key)
    return out


def group_value(value, key: str = "") -> str:
    if value is None:
        return MISSING
    if key.endswith("#content"):  # a file's SHA-256: its first 12 digits tell files apart in a table
        return str(value)[:12]
    return str(value)


def value_order(value) -> tuple:
    """A sort key that puts config values in numeric order: numbers by value (``1e-05`` before
    ``0.001``, ``20`` before ``100``), lists element by element (a flattened list is its JSON text:
    ``[50]`` before ``[50, 50]`` before ``[200, 200]``), then text, then a missing value."""
    if value is None or value == MISSING:
        return (3,)
    if isinstance(value, (bool, int, float)):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range (a damaged record): at its end
            number = math.inf if value > 0 else -math.inf
        return (0, math.inf, 1) if math.isnan(number) else (0, number, 0)  # NaN after every number
    if isinstance(value, str) and value.startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            return (1, tuple(value_order(item) for item in parsed))
    if isinstance(value, list):
        return (1, tuple(value_order(item) for item in value))
    return (2, str(value))


def file_labels(runs: Sequence[dict], key: str) -> Dict[str, str]:
    """For an input file's content key (``data.path#content``): each content's label in a table,
    the file's name (``prices.csv``), with the start of its SHA-256 where two different contents
    have one name (``prices.csv (3f9a0c1d)``); a run without the path keeps the short hash."""
    names: Dict[str, set] = {}
    for run in runs:
        flat = run_config(run)
        content = flat.get(key)
        path = flat.get(key[: -len("#content")])
        if content is not None and isinstance(path, str) and path:
            names.setdefault(str(content), set()).add(Path(path).name)
    by_name: Dict[str, set] = {}
    for content, found in names.items():
        by_name.setdefault(" / ".join(sorted(found)), set()).add(content)
    labels = {}
    for name, contents in by_name.items():
        for content in contents:
            digest = content.split(":")[-1][:8]
            labels[content] = name if len(contents) == 1 else f"{name} ({digest})"
    return labels


def group_runs(runs: Sequence[dict], keys: Sequence[str]) -> List[Tuple[Dict[str, str], List[dict]]]:
    """``[(group key values, runs)]`` in order of the values (:func:`value_order`: numbers and lists
    of numbers numerically); a key a run lacks reads ``—``; an input file reads as its name
    (:func:`file_labels`)."""
    groups: Dict[Tuple[str, ...], List[dict]] = {}
    order: Dict[Tuple[str, ...], tuple] = {}
    labels = {k: file_labels(runs, k) for k in keys if k.endswith("#content")}
    for run in runs:
        flat = run_config(run)
        values = tuple(
            labels[k].get(str(flat.get(k)), group_value(flat.get(k), k)) if k in labels else group_value(flat.get(k), k)
            for k in keys
        )
        groups.setdefault(values, []).append(run)
        order.setdefault(
            values, tuple(value_order(v if k.endswith("#content") else flat.get(k)) for k, v in zip(keys, values))
        )
    return [(dict(zip(keys, values)), groups[values]) for values in sorted(groups, key=lambda v: (order[v], v))]


def run_seed(run):
    return run.get("config", {}).get("seed")


def seeds_text(runs) -> str:
    seeds = sorted({run_seed(r) for r in runs if run_seed(r) is not None})
    return ",".join(str(s) for s in seeds)


def run_label(run) -> str:
    """A run as a report names it: its seed, else its folder's name."""
    seed = run_seed(run)
    return f"seed {seed}" if seed is not None else Path(str(run.get("_path", "?"))).name


@dataclass
class Stat:
    mean: float
    se: Optional[float]
    n: int
    values: List[float] = field(default_factory=list)
    # the runs whose value was NaN or infinite, each as "seed 1: NaN": named in the cell, not averaged
    left_out: List[str] = field(default_factory=list)

    def text(self, sig: int = 4, signed: bool = False, scientific: bool = True) -> str:
        number = format_mean_se(self.mean, self.se, sig=sig, signed=signed, scientific=scientific) if self.n else ""
        return f"{number} {self.note()}".strip() if self.left_out else number

    def note(self) -> str:
        """``(1 of 2 runs; left out seed 1: NaN)`` where a run's value was not finite; else ``""``."""
        if not self.left_out:
            return ""
        total = self.n + len(self.left_out)
        return f"({self.n} of {total} runs; left out {listing(self.left_out, 3)})"


def _why(value: float) -> str:
    return "NaN" if math.isnan(value) else "infinite"


def stat(values, labels: Optional[Sequence[str]] = None) -> Stat:
    """Mean ± standard error (``sd / sqrt(n)``, none for one value) of the finite ``values``;
    a NaN or infinite value is left out and named (``labels[i]``: the run it came from)."""
    kept, left_out = [], []
    values = list(values)
    labels = list(labels) if labels is not None else [f"run {i + 1}" for i in range(len(values))]
    for label, value in zip(labels, values):
        if value is None:  # not applicable to this run
            continue
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            number = math.inf if value > 0 else -math.inf
        if math.isfinite(number):
            kept.append(number)
        else:
            left_out.append(f"{label}: {_why(number)}")
    n = len(kept)
    if not n:
        return Stat(math.nan, None, 0, [], left_out)
    mean = sum(kept) / n
    # d * d, not d ** 2: a float power raises OverflowError past 1e154 where a product gives inf
    se = math.sqrt(sum((v - mean) * (v - mean) for v in kept) / (n - 1) / n) if n > 1 else None
    if se is not None and not math.isfinite(se):  # the spread of values near float's limit
        se = None
    return Stat(mean, se, n, kept, left_out)


def metric_stat(runs, name) -> Stat:
    return stat([run["metrics"].get(name) for run in runs], [run_label(run) for run in runs])


def summarize(runs: Sequence[dict]) -> pd.DataFrame:
    """Long table: one row per (group, metric) with mean, se, n."""
    keys = swept_keys(runs)
    rows = []
    for group, members in group_runs(runs, keys):
        metrics = sorted({m for run in members for m in run["metrics"]})
        for metric in metrics:
            s = metric_stat(members, metric)
            left_out = "; ".join(s.left_out)
            rows.append({**group, "metric": metric, "mean": s.mean, "se": s.se, "n": s.n, "left_out": left_out})
    return pd.DataFrame(rows, columns=[*keys, "metric", "mean", "se", "n", "left_out"])
