"""`cfbnn report PATH [--paper]`: every ``results.json`` under a run or sweep dir, one table per
pipeline and protocol.

* One table per pipeline, and per protocol where a pipeline has several
  (``train regression``: Table 1's ``gradient_variance`` runs and the ``uci`` runs are
  separate tables). Within a table, runs are grouped by the configuration keys whose
  values differ between them (the swept keys); ``seed`` and keys that follow it (such
  as ``data.seed: ${seed}``) are the replicates.
* Each number is mean ± standard error over the runs of a group (``sd / sqrt(n)``,
  rounded by :func:`cfbnn_cli.report.numbers.format_mean_se`); ``runs`` and ``seeds``
  columns say what was averaged. A number from one run has no ± (a UCI run keeps its
  own s.e. over splits, and says so).
* Runs with the same configuration *and* the same seed are duplicates, not
  replicates: the first (by path) is kept, the others are named and left out.
* Pipeline tables: Table 1 (gradient variances and their ratio by layer and epoch; and
  its runs' test metrics), the UCI protocol (method x test LL / RMSE), Table 2 (VAE
  variant x test LL and the ELBO's terms), Figure 1 (MC by N_inner vs the deterministic
  prediction), a fit to one's own data (``train regression`` with ``protocol: fit``, and
  Table 1's runs that measured no gradient variance: test RMSE, LL and 90 %-interval
  coverage; ``train classification``: test accuracy and NLL) with a figure of them per
  configuration; any other pipeline gets a table of its headline metrics. Figures where
  one helps. Configurations are in numeric order (:func:`.grouping.value_order`).
* ``--paper`` adds ``paper_reproduction.{md,csv}``: one row per claim of the paper (Table
  1's ratios at initialization, Table 2's ordering, Figure 1's deterministic vs MC-512)
  with the paper's number, cfbnn's from these runs, whether the runs show the effect,
  and the command that produced them (rebuilt from the runs' ``.hydra/overrides.yaml``).

Written beside the runs (or under ``--out``): ``report_<name>.csv`` (long form: every
metric's mean, s.e. and n per group), ``report_<name>_table.{csv,md,tex}`` and
``report_<name>.png`` (Table 1's runs also ``report_<name>_test_metrics_table.*`` and
``.png``; runs that measured no gradient variance are never named ``gradient_variance``). A corrupt ``results.json`` and a failed run are named and
skipped; a path with none is an error, and so is a table that would come out empty.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from ..runtime.command_line import OneLineParser
from ..runtime.errors import CfbnnError, DataError, one_line
from ..runtime.io import atomic_write_text, file_set
from ..runtime.safefs import describe_file, output_error, shown_path
from .grouping import drop_duplicates, group_runs, run_seed, summarize
from .records import collect, skip_file
from .reproduction import paper_reproduction
from .section_tables import plural
from .sections import FIGURES, TITLES, Section, section_table, sections
from .tables import write_table


def report(path, out: Optional[Path] = None, paper: bool = False) -> Dict[str, List[str]]:
    """Aggregate ``path``; returns ``{table key: [written files]}`` (the key is the pipeline,
    or ``pipeline/protocol`` where the pipeline has protocols)."""
    out = report_folder(path, out)
    try:
        if os.path.lexists(out) and not out.is_dir():
            what = "a file" if out.is_file() else describe_file(out)
            raise DataError(f"--out {shown_path(out)} is {what}, not a folder; name a folder (it is made if missing)")
        with file_set():  # the report's files appear together, or none of them (a full disk, Ctrl-C)
            written, shown = _report(path, out, paper)
    except OSError as error:  # the report's folder or a file in it cannot be made or written
        message = output_error(error, out, "pass --out a folder you can write (it is made if missing)")
        if message is None:
            raise
        raise DataError(message) from None
    for text in shown:  # once the files are there: a failed write shows no "-> file" line
        print(text)
    return written


def report_folder(path, out: Optional[Path] = None) -> Path:
    """Where the report of ``path`` goes: ``out``, else ``path`` (a folder) or its folder."""
    return Path(out) if out is not None else (Path(path) if Path(path).is_dir() else Path(path).parent)


def _report(path, out: Path, paper: bool) -> Tuple[Dict[str, List[str]], List[str]]:
    """``(written files by table key, the text to print)``: the tables written into ``out``."""
    runs = collect(path)
    runs, duplicates = drop_duplicates(runs)
    for duplicate, kept in duplicates:
        message = (
            f"duplicate of {kept['_path']} (the same configuration and seed {run_seed(kept)}): left out, "
            f"not averaged as a replicate"
        )
        skip_file(Path(duplicate["_path"]) / "results.json", message)
    written: Dict[str, List[str]] = {}
    used_names: set = set()
    built: List[Tuple[Section, pd.DataFrame]] = []
    shown: List[str] = []
    for section in sections(runs):
        name = section.name
        while name in used_names:  # two odd names that clean up alike must not overwrite each other
            name += "_"
        used_names.add(name)
        files: List[str] = []
        for suffix, kind in section.parts():
            table, keys = section_table(section, kind)
            if table.empty or len(table.columns) <= len(keys) + 2:  # only the group keys, runs and seeds
                if suffix:  # an extra table with nothing in it is left out
                    continue
                raise DataError(
                    f"the {len(section.runs)} {section.key} runs under {path} have no metric to "
                    f"tabulate (e.g. {section.runs[0]['_path']})"
                )
            stem = f"{name}{suffix}"
            if not suffix:
                atomic_write_text(out / f"{stem}.csv", summarize(section.runs).to_csv(index=False))
                files.append(f"{stem}.csv")
                built.append((section, table))
            group_keys = [k for k in keys if not (kind == "table2" and k == "variant")]
            n_groups = len(group_runs(section.runs, group_keys))
            title = (
                f"{section.key}{section.note}: {TITLES[kind]}; {plural(len(section.runs), 'run')}"
                + (f" in {n_groups} groups by {', '.join(group_keys)}" if group_keys else "")
                + "; mean ± s.e. over the runs of a row (seeds are replicates)"
            )
            part_files = list(write_table(table, out, f"{stem}_table", caption=title, index=False))
            figure = FIGURES.get(kind)
            if figure is not None and figure(section.runs, out / f"{stem}.png", keys):
                part_files.append(f"{stem}.png")
            files += part_files
            shown.append(
                f"{title}\n\n{table.to_markdown(index=False)}\n\n-> {', '.join(str(out / f) for f in part_files)}\n"
            )
        written[section.key] = files
    if duplicates:
        shown.append(
            f"{len(duplicates)} duplicate run(s) left out (same configuration and seed as a kept run); see the lines above\n"
        )
    if paper:
        frame = paper_reproduction(built)
        if frame.empty:
            raise DataError(
                f"--paper: no Table 1 (train regression), Table 2 (vae) or Figure 1 "
                f"(imagenet-predict) runs under {path}"
            )
        atomic_write_text(out / "paper_reproduction.csv", frame.to_csv(index=False))
        text = frame.to_markdown(index=False)
        atomic_write_text(out / "paper_reproduction.md", text + "\n")
        written["paper"] = ["paper_reproduction.md", "paper_reproduction.csv"]
        shown.append(
            f"Reproducing the paper (paper_reproduction.md):\n\n{text}\n\n-> {out / 'paper_reproduction.md'}\n"
        )
    return written, shown


HELP = """Aggregate every results.json under PATH (a run dir, a sweep dir, any folder): one table per
pipeline and protocol, each number the mean +- standard error over the runs of a group (runs grouped
by the config keys whose values differ; seeds are replicates; a run repeating another's config and
seed is left out as a duplicate).

Writes beside the runs (or under --out): report_<name>.csv (every metric's mean, s.e. and n per
group), report_<name>_table.{csv,md,tex} and report_<name>.png (a fit's: test RMSE, LL and
90%-interval coverage, or accuracy and NLL, per configuration). Unreadable records and failed runs
are named on stderr and skipped.

  cfbnn report outputs/train_regression/multirun/2026-11-27/10-00-00-000000
  cfbnn report repro --paper        # also paper_reproduction.{md,csv}: the paper's numbers beside
"""


def main(argv: Sequence[str]) -> int:
    import argparse

    parser = OneLineParser(prog="cfbnn report", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run dir, a sweep dir or any folder holding results.json files")
    parser.add_argument("--out", default=None, help="where to write the report (default: PATH)")
    parser.add_argument(
        "--paper",
        action="store_true",
        help="also write paper_reproduction.md: the paper's numbers beside these runs' (one row per claim)",
    )
    args = parser.parse_args(list(argv))
    try:
        report(args.path, args.out, paper=args.paper)
    except CfbnnError as error:
        print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:  # each file is written whole (atomically) or not at all
        print("cfbnn: interrupted; no report file was written (they appear together)", file=sys.stderr)
        return 130
    return 0
