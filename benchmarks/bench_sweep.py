"""Wall time of a 4-job sweep: Hydra's basic (sequential) launcher vs joblib with 2 workers.

    python benchmarks/bench_sweep.py            # 4 jobs of `cfbnn train regression experiment=uci` (seed=0..3)

Each job is a small but real training run. Under joblib every job gets
cores/n_jobs torch threads (cfbnn sets this), so the two workers do not
oversubscribe the machine. Prints both wall times and their ratio. Not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

# a typical laptop sweep: the UCI protocol on diabetes (small networks: per-step Python
# overhead, not arithmetic, bounds each job, so one process cannot use both cores)
JOB = [
    "experiment=uci",
    "uci.n_splits=2",
    "trainer.epochs=60",
    "uci.methods=[closed_form_diagonal,local_reparameterization,plain_mlp]",
    "device=cpu",
    "~hydra.callbacks.report",
]


def sweep(launcher_args, folder):
    start = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cfbnn_cli.cli",
            "train",
            "regression",
            "-m",
            "seed=0,1,2,3",
            *JOB,
            *launcher_args,
            f"hydra.sweep.dir={folder}",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        basic = sweep([], os.path.join(scratch, "basic"))
        parallel = sweep(
            ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.workers}"], os.path.join(scratch, "joblib")
        )
    print(f"{os.cpu_count()} cores; 4 jobs of `cfbnn train regression {' '.join(JOB[:4])}`")
    print(f"  basic launcher (sequential):   {basic:7.1f} s")
    print(
        f"  joblib, {args.workers} workers:             {parallel:7.1f} s   ratio {parallel / basic:.2f} (target <= 0.65)"
    )


if __name__ == "__main__":
    main()
