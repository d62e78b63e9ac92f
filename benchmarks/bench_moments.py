"""Throughput of Activation.moments against the floor of one ndtr + one exp pass.

    python benchmarks/bench_moments.py            # 1e7 float32 elements, CPU (and CUDA if present)
    python benchmarks/bench_moments.py --n 1000000 --devices cpu

The floor is the cheapest conceivable pass for any Gaussian-moment formula: one
``torch.special.ndtr`` and one ``torch.exp`` over the same data. Target (issue 2):
ReLU ``.moments`` <= 3x the floor on CPU. Other activations are listed for reference.
Timings are the best of ``--repeats`` runs after one warm-up; not a test.
"""

from __future__ import annotations

import argparse
import time

import torch

from cfbnn_cli.moments import get_activation, set_validate_args


def best_time(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", nargs="*", default=None)
    parser.add_argument("--others-n", type=int, default=1_000_000, help="elements for the non-ReLU activations")
    args = parser.parse_args(argv)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    set_validate_args(True)  # timed as a user calls it, input checks included
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for name in devices:
        device = torch.device(name)
        label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        generator = torch.Generator(device=device).manual_seed(0)
        mean = torch.randn(args.n, generator=generator, device=device)
        std = 0.1 + 0.9 * torch.rand(args.n, generator=generator, device=device)
        floor = best_time(lambda: (torch.special.ndtr(mean), torch.exp(mean)), args.repeats, device)
        relu = get_activation("relu")
        relu_time = best_time(lambda: relu.moments(mean, std), args.repeats, device)
        relu_var_time = best_time(lambda: relu.moments(mean, std, return_variance=True), args.repeats, device)
        print(f"\n[{label}] n = {args.n:.0e} float32")
        print(f"  floor (ndtr + exp)          {floor * 1e3:9.1f} ms   {args.n / floor / 1e6:8.1f} M elem/s")
        print(f"  relu .moments               {relu_time * 1e3:9.1f} ms   ratio to floor {relu_time / floor:5.2f}x (target <= 3x)")
        print(f"  relu .moments(+variance)    {relu_var_time * 1e3:9.1f} ms   ratio to floor {relu_var_time / floor:5.2f}x")
        m, s = mean[: args.others_n], std[: args.others_n]
        small_floor = best_time(lambda: (torch.special.ndtr(m), torch.exp(m)), args.repeats, device)
        for other, params in [("leaky_relu", {}), ("relu_squared", {}), ("hard_sigmoid", {"alpha": 1.0})]:
            activation = get_activation(other, **params)
            elapsed = best_time(lambda: activation.moments(m, s), max(1, args.repeats // 2), device)
            print(
                f"  {other:<14} (n={args.others_n:.0e})  {elapsed * 1e3:9.1f} ms   ratio to floor {elapsed / small_floor:5.2f}x"
            )


if __name__ == "__main__":
    main()
