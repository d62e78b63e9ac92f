"""Training-epoch time of the VAE variants v1/v2/v3 at the paper's sizes, as ratios to v1.

    python benchmarks/bench_vae.py                  # batch 2000, 90 dims, encoder 2x500, latent 30, decoder 500
    python benchmarks/bench_vae.py --device cuda

Times ``--steps`` Adam steps of each variant on random 90-dimensional data and
extrapolates to one epoch of MSD's 7:2:1 training split (360,741 rows = 181 steps of
2000). Then times one trial of the importance-weighted test log-likelihood with
K = 100 inner samples on ``--eval-rows`` rows (vectorized over K). Not a test.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from cfbnn_cli.bnn.vae import VARIANTS, BayesianDecoderVAE
from cfbnn_cli.moments import validate_args
from cfbnn_cli.train.optimizers import adam  # the pipelines' Adam (fused)

MSD_TRAIN_ROWS = 360_741  # 70% of 515,345


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-rows", type=int, default=2000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="also time each variant's loss under torch.compile")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; 90-(500-500)-30-(500)-90, batch {args.batch}")
    x = torch.randn(args.steps, args.batch, 90, device=device)
    steps_per_epoch = math.ceil(MSD_TRAIN_ROWS / args.batch)
    times = {}
    with validate_args(False):
        for variant in VARIANTS:
            torch.manual_seed(0)
            model = BayesianDecoderVAE(90, variant=variant).to(device)
            optimizer = adam(model.parameters(), lr=1e-3)
            generator = torch.Generator(device=device).manual_seed(0)

            def loss_fn(batch):
                return -model.elbo(batch, MSD_TRAIN_ROWS, generator) / MSD_TRAIN_ROWS

            def timed(loss_fn):
                def step(batch):
                    loss = loss_fn(batch)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()

                for i in range(3):
                    step(x[i])
                sync()
                start = time.perf_counter()
                for i in range(args.steps):
                    step(x[i])
                sync()
                return (time.perf_counter() - start) / args.steps

            per_step = timed(loss_fn)
            times[variant] = per_step
            if args.compile:
                times[variant + "+compile"] = timed(torch.compile(loss_fn))
            rows = torch.randn(args.eval_rows, 90, device=device)
            model.importance_weighted_log_likelihood(rows[:10], 100, generator)
            sync()
            start = time.perf_counter()
            model.importance_weighted_log_likelihood(rows, 100, generator)
            sync()
            evaluation = time.perf_counter() - start
            print(
                f"  {variant}: {per_step * 1e3:8.1f} ms/step -> {per_step * steps_per_epoch:7.1f} s/epoch of MSD   "
                f"{per_step / times['v1']:5.2f}x v1   IW test LL (K=100, {args.eval_rows} rows): {evaluation * 1e3:7.1f} ms"
            )
            if args.compile:
                compiled = times[variant + "+compile"]
                print(
                    f"  {variant} torch.compile: {compiled * 1e3:6.1f} ms/step   {compiled / times['v1+compile']:5.2f}x compiled v1"
                    f"   {compiled / times['v1']:5.2f}x eager v1"
                )


if __name__ == "__main__":
    main()
