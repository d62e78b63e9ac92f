"""Two cfbnn jobs started together against one alone: does sharing the cores work?

    python benchmarks/bench_threads.py                 # 2 jobs, runtime.threads=auto vs all cores each
    python benchmarks/bench_threads.py --jobs 3 --epochs 4

Each job is a small ``cfbnn train regression`` (its own run dir under a temporary
folder). For each setting it times one job alone and ``--jobs`` jobs started at once
(the median job), and prints the ratio concurrent / alone. The target (issue "fast CPU
path"): with the default ``runtime.threads=auto`` each of two concurrent jobs takes
<= 1.5x its time alone. ``runtime.threads=<all cores>`` is what every job did before
(torch's default of one thread per core in each process). Not a test: timings on a
shared machine vary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_jobs(count: int, overrides, folder: Path) -> list:
    started = time.perf_counter()
    processes = []
    for index in range(count):
        run_dir = folder / f"job{index}-{time.monotonic_ns()}"
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", f"hydra.run.dir={run_dir}", *overrides],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    seconds = []
    for process in processes:
        _, error = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"a job failed:\n{error[-2000:]}")
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="alone/concurrent measurements per setting (median)")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    job = ["device=cpu", f"trainer.epochs={args.epochs}", "data.n_train=3000", "gradient_variance.num_samples=300"]
    print(f"{cores} cores; {args.jobs} concurrent `cfbnn train regression` jobs ({' '.join(job)}) against one alone")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, threads in (
            ("runtime.threads=auto (default)", "auto"),
            (f"runtime.threads={cores} (each job all cores)", cores),
        ):
            overrides = job + [f"runtime.threads={threads}"]
            alone = statistics.median(run_jobs(1, overrides, Path(tmp))[0] for _ in range(args.repeats))
            together = statistics.median(
                statistics.median(run_jobs(args.jobs, overrides, Path(tmp))) for _ in range(args.repeats)
            )
            results[label] = together / alone
            print(
                f"  {label:<40} alone {alone:6.1f} s   {args.jobs} together {together:6.1f} s each (median)   "
                f"ratio {together / alone:4.2f}x"
            )
    ratio = results["runtime.threads=auto (default)"]
    print(
        f"  target: each of {args.jobs} concurrent jobs <= 1.5x its time alone: {ratio:.2f}x "
        f"({'met' if ratio <= 1.5 else 'missed'})"
    )


if __name__ == "__main__":
    main()
