"""``cfbnn report --paper``: one row per claim of the paper, the paper's number beside these runs',
whether the runs show the effect, and the command that produced them."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from . import paper as paper_values
from . import table1_schema
from .grouping import Stat, group_runs, metric_stat, run_label, run_seed, seeds_text, stat, swept_keys
from .metric_keys import deterministic_key, monte_carlo_key, vae_key
from .numbers import format_value
from .records import config_value
from .section_tables import inner_samples_of, paired_stat, plural, top_k_of, vae_variants_of
from .sections import COMMAND_WORDS, Section

# ----------------------------------------------------------------------------- --paper


def run_overrides(run) -> Optional[List[str]]:
    file = Path(run["_path"]) / ".hydra" / "overrides.yaml"
    try:
        import yaml

        values = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, ImportError):
        return None
    except Exception:  # a YAML error: the command is then unknown
        return None
    return [str(v) for v in values] if isinstance(values, list) else None


def sort_config_values(values):
    def key(v):
        try:
            return (0, float(v), v)
        except ValueError:
            return (1, 0.0, v)

    return sorted(values, key=key)


def command_for(runs: Sequence[dict]) -> str:
    """The ``cfbnn`` command that made ``runs``, rebuilt from their ``.hydra/overrides.yaml``:
    an override every run shares is written once, one whose value differs becomes a sweep
    (``-m seed=0,1,2``); run and sweep dirs are left out."""
    pipeline = runs[0]["pipeline"]
    words = COMMAND_WORDS.get(pipeline, pipeline)
    values: Dict[str, List[str]] = {}
    recorded = [o for o in (run_overrides(run) for run in runs) if o is not None]
    if not recorded:
        return f"cfbnn {words} (overrides not recorded)"
    for overrides in recorded:
        for item in overrides:
            key, _, value = item.partition("=")
            if key.startswith(("hydra.run.dir", "hydra.sweep.dir", "hydra.job")):
                continue
            if value not in values.setdefault(key, []):
                values[key].append(value)
    in_every_run = {k for k in values if all(any(o.startswith(f"{k}=") for o in overrides) for overrides in recorded)}
    sweep = len(recorded) > 1 or any(len(v) > 1 for v in values.values())
    parts = [
        f"{k}={','.join(sort_config_values(v))}" + ("" if k in in_every_run else " (some runs)")
        for k, v in sorted(values.items())
    ]
    return f"cfbnn {words}{' -m' if sweep else ''}{' ' + ' '.join(parts) if parts else ''}"


def runs_text(runs) -> str:
    names = sorted({str(config_value(run, "data.name", "?")) for run in runs})
    minutes = sum(float(run.get("timing", {}).get("wall_s") or 0.0) for run in runs) / 60
    return (
        f"{', '.join(names)}; {plural(len(runs), 'run')} (seeds {seeds_text(runs) or '?'}); {minutes:.1f} min of runs"
    )


def verdict_text(s: Stat, expect: str) -> str:
    """Whether ``s`` shows the expected direction: ``"> 1"``, ``"≈ 1"``, ``"> 0"``, ``"< 0"``."""
    if not s.n:
        return "no runs"
    lo, hi = (s.mean - 2 * s.se, s.mean + 2 * s.se) if s.se else (s.mean, s.mean)
    note = "" if s.n > 1 else " (one run: no s.e.)"
    if expect == "> 1":
        return ("yes" if lo > 1 else "no (reversed)" if hi < 1 else "not resolved (within 2 s.e. of 1)") + note
    if expect == "≈ 1":
        return ("yes (within a factor 1.5 of 1)" if 1 / 1.5 <= s.mean <= 1.5 else "no") + note
    # expect "> 0" or "< 0": the whole 2-s.e. interval on the expected side
    if (expect == "> 0" and lo > 0) or (expect == "< 0" and hi < 0):
        return "yes" + note
    if (expect == "> 0" and hi < 0) or (expect == "< 0" and lo > 0):
        return "no (reversed)" + note
    return "not resolved (within 2 s.e. of 0)" + note


def table1_rows(section: Section) -> List[dict]:
    runs = section.runs
    rows = []
    command, data = command_for(runs), runs_text(runs)
    for layer in ("first", "second", "final"):
        for kind in ("mean", "scale"):
            s = metric_stat(runs, table1_schema.ratio_key(0, layer, kind))
            if not s.n:
                continue
            ratio = paper_values.table1_ratio("init", layer, kind)
            cell = paper_values.TABLE1[("init", layer, kind)]
            expect = "> 1" if ratio >= 1.5 else "≈ 1"
            rows.append(
                {
                    "Claim": f"Table 1, at initialization, {layer} layer, {'weight means' if kind == 'mean' else 'log σ'}: "
                    f"gradient variance sampling / analytic {expect}",
                    "Paper": f"{format_value(ratio, sig=2)} ({cell['sampling']:g} / {cell['analytic']:g})",
                    "cfbnn (stand-in data)": s.text(sig=2),
                    "Shown?": verdict_text(s, expect),
                    "Runs": data,
                    "Command": command,
                }
            )
    return rows


def table2_rows(section: Section) -> List[dict]:
    """Table 2's claims for each group of runs (runs that differ in a config key other than
    the variant and the seed -- the data, its rows, the patience -- are separate groups, never
    pooled): each variant's test LL, then the paired differences V3 − V1, V3 − V2 and V2 − V1
    over seeds. Where the runs also hold the other reading of a Bayesian decoder's test LL
    (its weights at their posterior means), its differences follow."""
    keys = [k for k in swept_keys(section.runs) if k != "variant"]
    rows = []
    for values, runs in group_runs(section.runs, keys):
        label = ", ".join(f"{k}={v}" for k, v in values.items())
        rows += _table2_group_rows(runs, label)
    return rows


def _table2_group_rows(runs: List[dict], label: str) -> List[dict]:
    by_variant = {v: [r for r in runs if v in vae_variants_of(r)] for v in ("v1", "v2", "v3")}
    rows = []
    command, data = command_for(runs), runs_text(runs) + (f"; {label}" if label else "")
    for variant, name in (
        ("v1", "point-estimate decoder"),
        ("v2", "Bayesian decoder, weights sampled"),
        ("v3", "Bayesian decoder in closed form"),
    ):
        s = metric_stat(by_variant[variant], vae_key(variant, "test_ll"))
        if s.n:
            rows.append(
                {
                    "Claim": f"Table 2, test LL of {variant.upper()} ({name})",
                    "Paper": f"{paper_values.TABLE2[variant]:.2f} ({paper_values.TABLE2_DATA})",
                    "cfbnn (stand-in data)": s.text(sig=5),
                    "Shown?": "— (a level, not an effect: it depends on the data)",
                    "Runs": data,
                    "Command": command,
                }
            )
    readings = [("test_ll", "")]
    if any(m.endswith("/test_ll_posterior_mean") for run in runs for m in run["metrics"]):
        readings.append(("test_ll_posterior_mean", " [decoder weights at their posterior means]"))
    for metric, reading in readings:
        for a, b, claim in (
            ("v3", "v1", "V3 ≥ V1: a Bayesian decoder (integrated) beats a point estimate"),
            ("v3", "v2", "V3 ≥ V2: integrating the weights out beats sampling them"),
            ("v2", "v1", "V2 vs V1 (the paper: V1 slightly better)"),
        ):
            both = [r for r in runs if a in vae_variants_of(r) and b in vae_variants_of(r)]
            if both:  # paired by run (same seed, same split)
                s = paired_stat(both, vae_key(a, f"{metric}"), vae_key(b, f"{metric}"))
            else:  # single-variant runs: the difference of the means, paired by seed where possible
                s = seed_paired(by_variant[a], by_variant[b], vae_key(a, f"{metric}"), vae_key(b, f"{metric}"))
            if not s.n:
                continue
            difference = paper_values.TABLE2[a] - paper_values.TABLE2[b]
            expect = "> 0" if difference > 0 else "< 0"
            rows.append(
                {
                    "Claim": f"Table 2, {claim}: test LL {a.upper()} − {b.upper()}{reading}",
                    "Paper": f"{difference:+.2f} (no s.e. given)",
                    "cfbnn (stand-in data)": median_and_signs(s, s.text(sig=3, signed=True)),
                    "Shown?": verdict_text(s, expect),
                    "Runs": data,
                    "Command": command,
                }
            )
    return rows


def median_and_signs(s: Stat, mean_text: str) -> str:
    """``mean_text`` and, for two or more paired differences, `` (median +2.0; 7 of 10 > 0)``, the
    median to the mean's decimals: a mean over seeds can be carried by one seed, so the cell also
    says where the middle seed lies and how many seeds agree."""
    if s.n < 2:
        return mean_text
    median = statistics.median(s.values)
    mean_number = mean_text.split(" ")[0]
    if "e" in mean_number:  # scientific: no decimals to match
        shown = format_value(median, sig=3, signed=True)
    else:
        digits = f"{abs(median):.{len(mean_number.partition('.')[2])}f}"
        shown = digits if float(digits) == 0 else ("+" if median > 0 else "-") + digits
    above = sum(value > 0 for value in s.values)
    return f"{mean_text} (median {shown}; {above} of {s.n} > 0)"


def seed_paired(runs_a, runs_b, metric_a, metric_b) -> Stat:
    b_by_seed = {run_seed(r): r["metrics"].get(metric_b) for r in runs_b}
    paired = [
        r
        for r in runs_a
        if run_seed(r) in b_by_seed and r["metrics"].get(metric_a) is not None and b_by_seed[run_seed(r)] is not None
    ]
    return stat([r["metrics"][metric_a] - b_by_seed[run_seed(r)] for r in paired], [run_label(r) for r in paired])


def figure1_rows(section: Section) -> List[dict]:
    runs = section.runs
    k = top_k_of(runs)
    inner = inner_samples_of(runs)
    if not inner:
        return []
    top = max(inner)
    command, data = command_for(runs), runs_text(runs)
    rows = []
    for kk in (1, k):
        s = paired_stat(runs, deterministic_key(f"top{kk}"), monte_carlo_key(top, f"top{kk}_mean"))
        det, mc = (
            metric_stat(runs, deterministic_key(f"top{kk}")),
            metric_stat(runs, monte_carlo_key(top, f"top{kk}_mean")),
        )
        paper = (
            "deterministic ≥ MC-512 (qualitative)"
            if kk == 1
            else "deterministic > MC-512 on top-5 (qualitative)"
            if kk == 5
            else f"top-5: deterministic > MC-512 (qualitative; cfbnn shows top-{kk})"
        )
        rows.append(
            {
                "Claim": f"Figure 1, top-{kk} accuracy: deterministic − Monte Carlo with N_inner = {top}",
                "Paper": paper,
                "cfbnn (stand-in data)": f"{s.text(sig=3, signed=True, scientific=False)} ({det.text(sig=3)} vs "
                f"{mc.text(sig=3)})",
                "Shown?": verdict_text(s, "> 0"),
                "Runs": data,
                "Command": command,
            }
        )
    for kk in (1, k):
        det = metric_stat(runs, deterministic_key(f"top{kk}"))
        reach = next(
            (n for n in inner if metric_stat(runs, monte_carlo_key(n, f"top{kk}_mean")).mean >= det.mean), None
        )
        small = paired_stat(runs, deterministic_key(f"top{kk}"), monte_carlo_key(inner[0], f"top{kk}_mean"))
        found = (
            f"MC (mean over runs) reaches the deterministic accuracy at N_inner = {reach}"
            if reach is not None
            else f"MC (mean over runs) stays below the deterministic accuracy up to N_inner = {top}"
        )
        shown = (
            "yes"
            if reach is None or reach >= 128
            else "partly (MC catches up by N_inner = %d)" % reach
            if reach >= 8
            else "no (MC catches up by N_inner = %d)" % reach
        )
        rows.append(
            {
                "Claim": f"Figure 1, top-{kk}: Monte Carlo needs many samples to reach the deterministic accuracy",
                "Paper": "N_inner ≈ 512 (qualitative)",
                "cfbnn (stand-in data)": f"{found}; at N_inner = {inner[0]} "
                f"deterministic − MC = {small.text(sig=3, signed=True, scientific=False)}",
                "Shown?": shown,
                "Runs": data,
                "Command": command,
            }
        )
    return rows


def paper_reproduction(built: Sequence[Tuple[Section, pd.DataFrame]]) -> pd.DataFrame:
    """One row per claim of the paper that these runs can speak to (see the module docstring)."""
    rows = []
    for section, _ in built:
        if section.kind == "table1":
            rows += table1_rows(section)
    for section, _ in built:
        if section.kind == "table2":
            rows += table2_rows(section)
    for section, _ in built:
        if section.kind == "figure1":
            rows += figure1_rows(section)
    return pd.DataFrame(rows, columns=["Claim", "Paper", "cfbnn (stand-in data)", "Shown?", "Runs", "Command"])
