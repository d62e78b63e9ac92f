"""``cfbnn predict`` of a two-hidden-layer model: moments propagated in one pass (the default) against
64 Monte Carlo draws of the first layer (``--estimator analytic``, what it did before), side by side,
and what the one pass costs in accuracy against 4,096 draws.

A model trained under ``analytic`` (Table 1's default network, D-200-200-1: the first layer sampled,
the last two integrated) is trained on a real table (``data=computers``, 6,259 rows, 9 features;
``cfbnn train regression`` with Table 1's protocol, ``--epochs`` epochs). Then:

* speed: ``cfbnn predict`` on ``--rows`` rows (the table's rows resampled), each estimator in a fresh
  process, ``--repeats`` times interleaved: wall seconds, CPU seconds and peak resident memory of the
  child, medians, and the ratio old / new;
* accuracy: on the table's held-out rows, the predictive mean and s.d. of the one pass
  (``deterministic``) and of 64 draws against 4,096 draws (the reference: the analytic estimator is
  exact given the draws, so many draws converge to the posterior's predictive), in units of the
  reference s.d., and each one's held-out log-likelihood.

    python benchmarks/bench_deep_predict.py                  # 200,000 rows, 3 repeats
    python benchmarks/bench_deep_predict.py --rows 20000 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ESTIMATORS = {"old: analytic, 64 draws": "analytic", "new: deterministic, one pass": "deterministic"}


def child(command) -> tuple:
    """``(wall seconds, CPU seconds, peak RSS in MiB)`` of ``command`` run as a child process."""
    code = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); s = time.perf_counter() - t; "
        "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(r.stderr[-2000:], file=sys.stderr); "
        "print(s, u.ru_utime + u.ru_stime, u.ru_maxrss / 1024, r.returncode)"
    )
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, check=True)
    wall, cpu, peak, returncode = out.stdout.split()[-4:]
    if returncode != "0":
        raise SystemExit(f"{' '.join(command)} failed: {out.stderr[-2000:]}")
    return float(wall), float(cpu), float(peak)


def train(folder: Path, epochs: int) -> Path:
    run = folder / "run"
    command = [
        "cfbnn", "train", "regression", "data=computers", f"trainer.epochs={epochs}", "trainer.batch_size=100",
        "gradient_variance.num_samples=0", "gradient_variance.epochs=[]", "device=cpu", f"hydra.run.dir={run}",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"training failed: {out.stderr[-2000:]}")
    return run


def accuracy(run: Path) -> None:
    from omegaconf import OmegaConf

    from cfbnn_cli.bnn import load_model
    from cfbnn_cli.bnn.predictive import mixture_log_likelihood
    from cfbnn_cli.data.regression import load_regression_data

    saved = load_model(run / "model.pt")
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    data = load_regression_data(cfg.data)  # the run's own split: its held-out rows
    x = torch.as_tensor(data.x_test, dtype=torch.float32)
    y = data.y_test.double() * data.target_std + data.target_mean
    network = saved.network
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        reference = network.predict(x, estimator="analytic", num_samples=4096, generator=generator)
        draws = network.predict(x, estimator="analytic", num_samples=64, generator=generator)
        one_pass = network.predict(x, estimator="deterministic")
    sd = reference.stddev.double()
    print(f"\naccuracy on the {len(y)} held-out rows of {data.name} (model {saved.method or 'analytic, Table 1'}):")
    print(
        "| prediction | mean error / ref. s.d. (median, 95th pct) | s.d. / ref. s.d. (median, range) "
        "| weights' variance / ref. (median, range) | held-out LL |"
    )
    print("|:--|--:|--:|--:|--:|")
    for name, prediction in (("4,096 draws (reference)", reference), ("64 draws", draws), ("one pass", one_pass)):
        unscaled = prediction.unscaled(saved.target_mean, saved.target_std)
        error = ((prediction.mean.double() - reference.mean.double()).abs() / sd).numpy()
        ratio = (prediction.stddev.double() / sd).numpy()
        weights = (prediction.var_a + prediction.var_b).double() / (reference.var_a + reference.var_b).double()
        weights = weights.numpy()
        ll = float(mixture_log_likelihood(y, unscaled.mean.double()[None], unscaled.variance.double()[None]).mean())
        print(
            f"| {name} | {np.median(error):.3f}, {np.percentile(error, 95):.3f} | {np.median(ratio):.3f}, "
            f"{ratio.min():.3f}-{ratio.max():.3f} | {np.median(weights):.3f}, {weights.min():.3f}-{weights.max():.3f} "
            f"| {ll:.4f} |"
        )


def speed(run: Path, folder: Path, rows: int, repeats: int) -> None:
    import pandas as pd

    from cfbnn_cli.bnn import load_model

    saved = load_model(run / "model.pt")
    rng = np.random.default_rng(0)
    base = rng.standard_normal((rows, saved.input_dim)) * saved.feature_std.numpy() + saved.feature_mean.numpy()
    path = folder / "new.csv"
    pd.DataFrame(base, columns=saved.columns).to_csv(path, index=False)
    times = {name: [] for name in ESTIMATORS}
    for _ in range(repeats):
        for name, estimator in ESTIMATORS.items():
            command = ["cfbnn", "predict", str(run), str(path), "--out", str(folder / "p.csv")]
            times[name].append(child(command + ["--estimator", estimator]))
    print(f"\n`cfbnn predict` of D-200-200-1 on {rows:,} rows ({repeats} runs each, interleaved; medians):")
    print("| estimator | wall s | CPU s | peak RSS (MiB) |\n|:--|--:|--:|--:|")
    medians = {}
    for name, runs in times.items():
        medians[name] = [statistics.median(values) for values in zip(*runs)]
        wall, cpu, peak = medians[name]
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {peak:.0f} |")
    old, new = (medians[name] for name in ESTIMATORS)
    print(f"| old / new | {old[0] / new[0]:.1f}x | {old[1] / new[1]:.1f}x | {old[2] / new[2]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        run = train(folder, args.epochs)
        accuracy(run)
        speed(run, folder, args.rows, args.repeats)
    print(f"\n(torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
