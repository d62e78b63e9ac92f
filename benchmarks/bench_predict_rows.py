"""``cfbnn predict`` on a large file: wall time and peak memory against the number of rows.

Builds two models with save_model (random weights: time and memory do not depend on training),
the own-data fit's default (10-50-1, every layer integrated) and Table 1's default network
(10-200-200-1 under ``analytic``: the first layer sampled, 64 draws), writes CSVs of N rows and
runs ``cfbnn predict`` on each in a fresh process, reporting its wall time and peak resident
memory (``ru_maxrss`` of the child). Peak memory should not grow with N.

    python benchmarks/bench_predict_rows.py            # N = 10k, 50k, 200k
    python benchmarks/bench_predict_rows.py --rows 20000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from cfbnn_cli.bnn import BayesianNetwork, save_model


def child_peak_mib(command) -> tuple:
    """``(seconds, peak RSS in MiB)`` of ``command`` run as a child process on its own."""
    code = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "r = subprocess.run(sys.argv[1:]); s = time.perf_counter() - t; "
        "print(s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, r.returncode)"
    )
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, check=True)
    seconds, peak, returncode = out.stdout.split()[-3:]
    if returncode != "0":
        raise SystemExit(f"cfbnn predict failed: {out.stderr[-2000:]}")
    return float(seconds), float(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[10_000, 50_000, 200_000])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    columns = [f"f{i}" for i in range(10)]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        models = {
            "fit default 10-50-1 (exact)": BayesianNetwork(10, [50], 1, init_scale=0.1),
            "Table 1 default 10-200-200-1 (64 draws)": BayesianNetwork(10, [200, 200], 1),
        }
        for name, network in models.items():
            save_model(folder / f"{hash(name)}.pt", network, columns=columns)
        print("| model | rows | seconds | peak RSS (MiB) |\n|:--|--:|--:|--:|")
        for rows in args.rows:
            path = folder / f"new_{rows}.csv"
            header = ",".join(columns)
            np.savetxt(path, rng.standard_normal((rows, 10)), delimiter=",", header=header, comments="", fmt="%.6g")
            for name in models:
                seconds, peak = child_peak_mib(
                    ["cfbnn", "predict", str(folder / f"{hash(name)}.pt"), str(path), "--out", str(folder / "p.csv")]
                )
                print(f"| {name} | {rows:,} | {seconds:.1f} | {peak:.0f} |", flush=True)
    print(f"\n(torch {torch.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
