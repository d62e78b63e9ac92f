"""Prediction speed of the Bayesian head: deterministic vs Monte Carlo vs a plain head.

    python benchmarks/bench_predict.py                  # 2048-1000-1000-1000, batch 256
    python benchmarks/bench_predict.py --device cuda

Images per second, best of ``--repeats``, of (i) the deterministic prediction
``argmax y_hat`` (the logits' closed-form mean, which also gives their variance),
(ii) Monte Carlo with N = 1, 16, 512 logit samples per image (one batched draw,
softmax averaged), and (iii) a plain deterministic head of the same shape (the
Bayesian layers' mean weights). Printed side by side with the ratios. Not a test.
"""

from __future__ import annotations

import argparse
import time

import torch

from cfbnn_cli.bnn.head import BayesianHead
from cfbnn_cli.bnn.layers import augment
from cfbnn_cli.moments import validate_args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2048,1000,1000,1000")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--samples", type=int, nargs="*", default=[1, 16, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile(mode='reduce-overhead') of the deterministic and plain heads")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    F, H1, H2, O = (int(v) for v in args.sizes.split(","))
    torch.manual_seed(0)
    head = BayesianHead(F, [H1, H2], O).to(device).eval()
    x = torch.randn(args.batch, F, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    middle, last = head.bayesian.layers

    def plain(x):
        h = head.hidden(x)
        h = torch.relu(augment(h) @ middle.loc.T)
        return (augment(h) @ last.loc.T).argmax(-1)

    def deterministic(x):
        return head.logit_mean(x).argmax(-1)

    def monte_carlo(n):
        return lambda x: torch.softmax(head.sample_logits(x, n, generator), -1).mean(0).argmax(-1)

    def images_per_second(function):
        with torch.no_grad():
            function(x)
            best = float("inf")
            for _ in range(args.repeats):
                sync()
                start = time.perf_counter()
                function(x)
                sync()
                best = min(best, time.perf_counter() - start)
        return args.batch / best

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; head {F}-{H1}-{H2}-{O}, batch {args.batch}")
    with validate_args(False):
        rates = {"plain deterministic head": images_per_second(plain), "deterministic argmax y_hat": images_per_second(deterministic)}
        for n in args.samples:
            rates[f"Monte Carlo, N={n}"] = images_per_second(monte_carlo(n))
        if args.compile:
            # launch overhead dominates both small heads on a GPU; CUDA graphs remove it
            rates["plain head, compiled"] = images_per_second(torch.compile(plain, mode="reduce-overhead"))
            rates["deterministic, compiled"] = images_per_second(torch.compile(deterministic, mode="reduce-overhead"))
    reference = rates["deterministic argmax y_hat"]
    for name, rate in rates.items():
        print(f"  {name:<28} {rate:12.0f} images/s   deterministic is {reference / rate:8.2f}x faster")


if __name__ == "__main__":
    main()
