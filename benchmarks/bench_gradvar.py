"""Gradient-variance measurement (paper Table 1) speed, and the MSD epoch-time estimate.

    python benchmarks/bench_gradvar.py                       # 10^4 draws, 90-200-200-1, batch 500
    python benchmarks/bench_gradvar.py --samples 2000 --loop-samples 100

For both estimators it times ``--samples`` single-sample gradients of the negative
ELBO drawn with ``torch.func.vmap(grad(...))`` (cfbnn_cli.bnn.gradient_variance),
and a plain per-sample Python loop of backward passes on ``--loop-samples`` draws,
extrapolated to ``--samples``; it prints the ratio. It then times
``--train-steps`` Adam steps of the analytic estimator at batch 500 and
extrapolates to one epoch of YearPredictionMSD (463,715 rows = 928 steps).

On CUDA the vmapped draws should take the Triton kernels of the ``cfbnn::`` operators (the tail
node's vmap rule calls its kernel on the draws' rows): the Triton launches of the analytic
estimator's warm-up draws are counted (tests/kernel_count.py; target: at least one), printed as the
machine-readable line ``TARGET vmap_triton_launches <count> >= 1 launches met|MISSED``
(benchmarks/targets.py) that gpu_suite.sh collects.
Not a test; numbers depend on the machine (print includes threads and device).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from seams import count_kernels
from targets import report_target

from cfbnn_cli.bnn.gradient_variance import gradient_variance
from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.moments import set_validate_args
from cfbnn_cli.train.optimizers import adam  # the pipelines' Adam (fused)

MSD_TRAIN = 463_715


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--loop-samples", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=None, help="draws per vmap call (default 25 on CPU, 1000 on CUDA)")
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    set_validate_args(False)
    device = torch.device(args.device)
    if args.chunk is None:
        # CPU: small chunks keep the working set in cache; GPU: large chunks fill the device
        args.chunk = 1000 if device.type == "cuda" else 25
    torch.manual_seed(0)
    x = torch.randn(500, 90, device=device)
    y = torch.randn(500, device=device)
    model = BayesianNetwork(90, [200, 200]).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, 90-200-200-1, batch 500, vmap chunk {args.chunk}")
    launches = 0
    for estimator in ("analytic", "sampling"):
        with count_kernels() as kernels:  # the warm-up
            gradient_variance(model, x, y, MSD_TRAIN, estimator, 2 * args.chunk, args.chunk, generator)
        if estimator == "analytic":
            launches = sum(n for name, n in kernels.items() if name.startswith("triton::"))
        sync()
        start = time.perf_counter()
        gradient_variance(model, x, y, MSD_TRAIN, estimator, args.samples, args.chunk, generator)
        sync()
        vectorized = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(args.loop_samples):
            model.zero_grad(set_to_none=True)
            # the same objective as the vectorized draws: the scaled ELL (the KL's gradient is constant)
            (
                -MSD_TRAIN / 500 * model.expected_log_likelihood(x, y, estimator=estimator, generator=generator)
            ).backward()
        sync()
        loop = (time.perf_counter() - start) / args.loop_samples * args.samples
        print(
            f"  {estimator:<9} {args.samples} draws: vmap {vectorized:7.1f} s   per-sample loop ~{loop:7.1f} s "
            f"(from {args.loop_samples})   speed-up {loop / vectorized:5.2f}x"
        )
    optimizer = adam(model.parameters(), lr=1e-3)
    xs = torch.randn(args.train_steps, 500, 90, device=device)
    ys = torch.randn(args.train_steps, 500, device=device)
    for step in range(3):
        optimizer.zero_grad()
        (-model.elbo(xs[step], ys[step], num_data=MSD_TRAIN, estimator="analytic", generator=generator)).backward()
        optimizer.step()
    sync()
    start = time.perf_counter()
    for step in range(args.train_steps):
        optimizer.zero_grad()
        (-model.elbo(xs[step], ys[step], num_data=MSD_TRAIN, estimator="analytic", generator=generator)).backward()
        optimizer.step()
    sync()
    per_step = (time.perf_counter() - start) / args.train_steps
    steps = math.ceil(MSD_TRAIN / 500)
    print(
        f"  MSD epoch estimate (analytic, {steps} steps of 500): {per_step * 1e3:.1f} ms/step -> {per_step * steps:.1f} s/epoch"
    )
    report_target(
        "vmap_triton_launches",
        launches,
        ">=",
        1,
        "launches",
        device,
        label="Triton launches of the analytic draws under vmap(grad) (vmap over the operators takes the kernels)",
    )


if __name__ == "__main__":
    main()
