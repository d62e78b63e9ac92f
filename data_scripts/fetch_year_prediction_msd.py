#!/usr/bin/env python
"""Download and verify UCI YearPredictionMSD for `cfbnn train regression data=year_prediction_msd`.

    python data_scripts/fetch_year_prediction_msd.py --out data
    python data_scripts/fetch_year_prediction_msd.py --verify-only data/YearPredictionMSD.txt.zip

Downloads the zip from the UCI repository (where the network allows), then checks
that it holds 515,345 rows of 91 numeric columns (year + 90 features) with years in
1922..2011 -- the file the paper's split (first 463,715 rows train) refers to.
"""

from __future__ import annotations

import argparse
import io
import sys
import urllib.request
import zipfile
from pathlib import Path

URL = "https://archive.ics.uci.edu/ml/machine-learning-databases/00203/YearPredictionMSD.txt.zip"
ROWS = 515_345
COLUMNS = 91


def verify(path: Path, rows: int = ROWS) -> int:
    """Check row count, column count and year range; return the number of rows."""
    path = Path(path)
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".txt"))
            lines = io.TextIOWrapper(archive.open(member), encoding="utf-8")
            count = _check_lines(lines, path)
    else:
        with open(path) as lines:
            count = _check_lines(lines, path)
    if rows is not None and count != rows:
        raise SystemExit(f"{path}: {count} rows, expected {rows}; delete it and download again")
    return count


def _check_lines(lines, path) -> int:
    count = 0
    for count, line in enumerate(lines, 1):
        cells = line.strip().split(",")
        if len(cells) != COLUMNS:
            raise SystemExit(f"{path}, line {count}: {len(cells)} columns, expected {COLUMNS}")
        year = float(cells[0])
        if not 1922 <= year <= 2011:
            raise SystemExit(f"{path}, line {count}: year {year} outside 1922..2011")
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data", help="directory to write YearPredictionMSD.txt.zip into")
    parser.add_argument("--verify-only", metavar="FILE", help="only verify an existing .txt or .txt.zip")
    parser.add_argument("--rows", type=int, default=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.verify_only:
        print(f"{args.verify_only}: {verify(Path(args.verify_only), args.rows)} rows, OK")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "YearPredictionMSD.txt.zip"
    if not target.exists():
        print(f"downloading {URL} -> {target}")
        try:
            with urllib.request.urlopen(URL, timeout=60) as response:
                data = response.read()
        except OSError as error:
            print(
                f"download failed ({error}); fetch {URL} by hand into {out}/ and re-run with --verify-only",
                file=sys.stderr,
            )
            return 1
        partial = target.with_suffix(".part")
        partial.write_bytes(data)
        partial.replace(target)
    print(f"{target}: {verify(target, args.rows)} rows, OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
