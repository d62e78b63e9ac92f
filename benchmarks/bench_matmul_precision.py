"""TF32 or not (``runtime.matmul_precision``): what each setting costs and gives, side by side.

    python benchmarks/bench_matmul_precision.py                       # CUDA: highest and high (TF32), ~1.5 min
    python benchmarks/bench_matmul_precision.py --device cpu --sizes 8x16 --epochs 1   # a smoke run

For each precision (``--precisions``, default ``highest,high``; torch.set_float32_matmul_precision's
values) it prints

1. the training step (forward, backward, Adam; batch 500, one hidden layer) of the closed form
   (``analytic`` estimator) and of the plain MLP of the same shape, eager and graphed (the CLI's
   default CUDA path, :class:`~cfbnn_cli.train.graphs.GraphedTrainingStep`), at D=90/H=200 and
   D=2048/H=1000 (bench_cuda_graphs.py's sizes), in ms: medians of ``--repeats`` timings of
   ``--steps`` steps each;
2. the test log-likelihood (closed-form and Monte Carlo predictive) and RMSE of a short Table 1
   run, ``cfbnn train regression device=<device> runtime.matmul_precision=<p>
   trainer.epochs=<--epochs>``, the same seed under each precision.

``highest`` (full float32 products) is the default and what the paper's tables use; ``high`` lets
Ampere and later GPUs run float32 matrix products in TF32 (10-bit mantissa). On a CPU the
setting changes nothing (both rows should agree). Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_operators import _eager_step as _eager  # the eager step every benchmark times

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.moments import validate_args
from cfbnn_cli.runtime.checks import MATMUL_PRECISIONS
from cfbnn_cli.runtime.device import set_matmul_precision, synchronize
from cfbnn_cli.runtime.threads import flush_denormals, tune_allocator
from cfbnn_cli.train.graphs import BatchLoss, GraphedTrainingStep
from cfbnn_cli.train.optimizers import adam  # the pipelines' Adam (fused)

ROWS, BATCH = 10_000, 500


def _median_ms(step, steps, repeats, device):
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def step_times(dim, hidden, device, args) -> dict:
    """``{(network, "eager" | "graphed"): ms}`` at the precision now set (graphed: None off CUDA)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, dim, generator=generator).to(device)
    y = torch.randn(ROWS, generator=generator).to(device)
    rows = torch.randint(0, ROWS, (BATCH,), generator=generator).to(device)
    out = {}
    for network in ("closed form", "plain MLP"):
        for mode in ("eager", "graphed"):
            if mode == "graphed" and device.type != "cuda":
                out[network, mode] = None
                continue
            torch.manual_seed(0)
            if network == "closed form":
                model = BayesianNetwork(dim, [hidden]).to(device)

                def loss(xb, yb, model=model):
                    return -model.elbo(xb, yb, num_data=ROWS, estimator="analytic")

            else:
                model = torch.nn.Sequential(
                    torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
                ).to(device)

                def loss(xb, yb, model=model):
                    return (model(xb).squeeze(-1) - yb).square().mean()

            optimizer = adam(model.parameters(), lr=1e-3)
            loss = BatchLoss((x, y), loss)  # the batch's gather outside the graph, as the CLI's losses
            if mode == "graphed":
                step = GraphedTrainingStep(model, optimizer, loss, device, label=f"{network} D={dim}")
            else:
                step = _eager(model, optimizer, loss)
            with validate_args(False):
                for _ in range(3):  # warm-up (and the graph's capture)
                    step(rows)
                if mode == "graphed" and not step.enabled:
                    raise SystemExit(f"capture of the {network} D={dim} step failed: {step.failure}")
                out[network, mode] = _median_ms(lambda: step(rows), args.steps, args.repeats, device)
    return out


def table1_run(precision, device, folder: Path, args) -> dict:
    """The test metrics of a short ``cfbnn train regression`` run at ``precision``."""
    run_dir = folder / f"table1-{precision}"
    command = [
        sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", f"device={device.type}",
        f"runtime.matmul_precision={precision}", f"trainer.epochs={args.epochs}",
        f"gradient_variance.num_samples={args.gradient_samples}", f"hydra.run.dir={run_dir}", *args.override,
    ]  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])} failed:\n{out.stderr[-3000:]}")
    record = json.loads((run_dir / "results.json").read_text())
    metrics = record["metrics"]
    return {
        "wall_s": time.perf_counter() - started,
        "test_ll_closed_form": metrics["final_test_ll_closed_form"],
        "test_ll_monte_carlo": metrics["final_test_ll_monte_carlo"],
        "test_rmse": metrics["final_test_rmse"],
        "in_effect": record["environment"].get("matmul_precision"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precisions", default="highest,high", help="comma-separated, from highest, high, medium")
    parser.add_argument("--sizes", nargs="*", default=["90x200", "2048x1000"], help="DxH of the timed steps")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20, help="trainer.epochs of the short Table 1 run")
    parser.add_argument("--gradient-samples", type=int, default=100, help="gradient_variance.num_samples of that run")
    parser.add_argument("--override", nargs="*", default=[], help="more KEY=VALUE overrides for the Table 1 run")
    args = parser.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or any(p not in MATMUL_PRECISIONS for p in precisions):
        parser.error(f"--precisions {args.precisions!r}: each one of {', '.join(MATMUL_PRECISIONS)}")
    flush_denormals(True)  # as the CLI runs
    tune_allocator()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; runtime.matmul_precision: {', '.join(precisions)}")
    print(f"1. training step, batch {BATCH}, one hidden layer (ms; median of {args.repeats} x {args.steps} steps)")
    times = {}
    previous = torch.get_float32_matmul_precision()
    try:
        for size in args.sizes:
            dim, hidden = (int(v) for v in size.split("x"))
            for precision in precisions:
                set_matmul_precision(precision)
                times[size, precision] = step_times(dim, hidden, device, args)
    finally:
        set_matmul_precision(previous)
    show = lambda ms: "      -" if ms is None else f"{ms:7.3f}"  # noqa: E731
    print(
        f"   {'D x H':<10} {'precision':<9} {'closed form eager':>18} {'graphed':>8} {'MLP eager':>10} {'graphed':>8}"
    )
    for (size, precision), row in times.items():
        print(
            f"   {size:<10} {precision:<9} {show(row['closed form', 'eager']):>18} {show(row['closed form', 'graphed']):>8} "
            f"{show(row['plain MLP', 'eager']):>10} {show(row['plain MLP', 'graphed']):>8}"
        )
    for size in args.sizes:
        base = times.get((size, "highest"))
        for precision in precisions:
            if base is None or precision == "highest":
                continue
            row = times[size, precision]
            ratios = [
                f"{network} {mode} {base[network, mode] / row[network, mode]:.2f}x"
                for network in ("closed form", "plain MLP")
                for mode in ("eager", "graphed")
                if row[network, mode] is not None
            ]
            print(f"   {size}: {precision} vs highest, speed-up: {', '.join(ratios)}")
    print(
        f"2. short Table 1 run: cfbnn train regression device={device.type} trainer.epochs={args.epochs} "
        f"gradient_variance.num_samples={args.gradient_samples} {' '.join(args.override)}".rstrip()
    )
    print(f"   {'precision':<9} {'test LL (closed form)':>22} {'test LL (MC)':>13} {'test RMSE':>10} {'wall s':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for precision in precisions:
            run = table1_run(precision, device, Path(folder), args)
            if run["in_effect"] != precision:
                raise SystemExit(f"the run asked for {precision} but recorded {run['in_effect']!r}")
            print(
                f"   {precision:<9} {run['test_ll_closed_form']:>22.5f} {run['test_ll_monte_carlo']:>13.5f} "
                f"{run['test_rmse']:>10.5f} {run['wall_s']:>7.1f}"
            )


if __name__ == "__main__":
    main()
