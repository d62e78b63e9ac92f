"""Throughput of Activation.moments: the fast CPU kernels against the reference torch path.

    python benchmarks/bench_moments.py                   # CPU, all sections
    python benchmarks/bench_moments.py --compile         # also torch.compile of the reference ops
    python benchmarks/bench_moments.py --n 1000000 --others-n 200000 --repeats 5   # quicker
    python benchmarks/bench_moments.py --plain-process   # without the CLI's process settings (allocator, denormals)

Everything is timed in one process, side by side, as the median of ``--repeats`` runs after
a warm-up (timings on a shared machine drift; compare ratios within one run). The
operators' own kernels are the default; the reference kernels are registered over them for the
device by tests/reference_kernels.py (benchmarks/seams.py).
"fwd+bwd" is ``moments(mean, std)`` followed by a backward pass with dense random
gradients for Phi and Upsilon (as from a loss), input gradients reset to None each time.

Targets (issue 15):

1. ``relu.moments`` forward+backward on a 500x200 float32 block <= 5x one ``erfc`` plus
   one ``exp`` over the same elements;
2. ``relu.moments`` forward on 1e7 float32 elements <= 1.5x one pass of
   ``t = mean/std``, ``ndtr(t)``, ``exp(t)``;
3. leaky ReLU, ReLU^2 and the piecewise-polynomial engine (hard sigmoid, a user-defined
   piecewise polynomial) within 3x ReLU per element (forward, and forward+backward).

Not a test: it prints numbers and met/missed.
"""

from __future__ import annotations

import argparse
import statistics
import time

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    resource = None

import torch
from bench_elbo import configure_like_cli  # the benchmarks' helpers (benchmarks/ on sys.path)
from seams import reference_kernels

from cfbnn_cli.moments import extension, get_activation, piecewise_polynomial, set_validate_args


def median_time(fn, repeats: int, device: torch.device, warmup: int = 1) -> float:
    for _ in range(warmup):
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
    return statistics.median(times)


def forward_fn(activation, mean, std):
    return lambda: activation.moments(mean, std)


def forward_backward_fn(activation, mean, std):
    leaf_mean = mean.clone().requires_grad_()
    leaf_std = std.clone().requires_grad_()
    generator = torch.Generator(device=mean.device).manual_seed(1)
    grad_phi = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    grad_ups = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)

    def run():
        leaf_mean.grad = None
        leaf_std.grad = None
        phi, ups = activation.moments(leaf_mean, leaf_std)
        torch.autograd.backward((phi, ups), (grad_phi, grad_ups))

    return run


def user_piecewise():
    """A discontinuous user-defined piecewise polynomial with a cubic piece (as in the tests)."""
    return piecewise_polynomial([-1.0, 0.5, 2.0], [[1.0], [0.0, -1.0, 0.5], [2.0, 0.0, 0.0, 1.0], [-3.0]])


def verdict(value, limit):
    return f"{'met' if value <= limit else 'MISSED'} ({value:.2f}x, target <= {limit:g}x)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000_000, help="elements for target 2")
    parser.add_argument("--block", type=int, nargs=2, default=(500, 200), help="block shape for target 1")
    parser.add_argument(
        "--others-n", type=int, default=1_000_000, help="elements per activation in the table (same n for all)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the reference ops (relu)")
    parser.add_argument("--devices", nargs="*", default=None)
    parser.add_argument(
        "--plain-process",
        action="store_true",
        help="skip the settings the CLI makes before any work (denormals flushed, glibc's "
        "allocator kept from returning freed memory: runtime.threads.tune_allocator); "
        "shows how much of a time is the allocator's page faults",
    )
    args = parser.parse_args(argv)
    if args.plain_process:
        print("process as Python starts it (no CLI settings)")
    else:
        print(f"process settings: {configure_like_cli()}")
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    set_validate_args(True)  # timed as a user calls it, input checks included
    info = extension.status()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if info["loaded"]:
        print(f"C++ CPU kernels: {info['path']}")
    else:
        print(f"C++ CPU kernels NOT LOADED ({info['reason']}): on the CPU both columns run the reference kernels")

    for name in devices:
        device = torch.device(name)
        label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        generator = torch.Generator(device=device).manual_seed(0)
        relu = get_activation("relu")
        print(f"\n===== {label} =====")
        reference = device.type.upper()  # the dispatch key the reference kernels are registered for

        # ---- target 1: a 500x200 block, forward + backward
        rows, cols = args.block
        mean = torch.randn(rows, cols, generator=generator, device=device)
        std = 0.1 + 0.9 * torch.rand(rows, cols, generator=generator, device=device)
        n_block = mean.numel()
        floor1 = median_time(lambda: (torch.special.erfc(mean), torch.exp(mean)), 5 * args.repeats, device)
        fast_fb_fn = forward_backward_fn(relu, mean, std)
        fast_fb_fn()  # warm-up outside the count: the heap grows once, on first use
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0
        fast_fb = median_time(fast_fb_fn, 5 * args.repeats, device, warmup=0)
        faults = (
            ((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / (5 * args.repeats))
            if resource
            else float("nan")
        )
        fast_f = median_time(forward_fn(relu, mean, std), 5 * args.repeats, device)
        with reference_kernels(reference):
            ref_fb = median_time(forward_backward_fn(relu, mean, std), 5 * args.repeats, device)
        print(f"\n[target 1] relu.moments on a {rows}x{cols} float32 block ({n_block} elements)")
        print(f"  erfc + exp (floor)          {floor1 * 1e6:9.1f} us")
        print(f"  fast      fwd               {fast_f * 1e6:9.1f} us   {fast_f / floor1:6.2f}x floor")
        print(
            f"  fast      fwd+bwd           {fast_fb * 1e6:9.1f} us   {fast_fb / floor1:6.2f}x floor"
            f"   ({faults:.0f} page faults per call: fresh pages from the allocator, ~1 us each here)"
        )
        print(f"  reference fwd+bwd           {ref_fb * 1e6:9.1f} us   {ref_fb / floor1:6.2f}x floor")
        print(f"  target 1: {verdict(fast_fb / floor1, 5.0)}")

        # ---- target 2: 1e7 elements, forward
        mean = torch.randn(args.n, generator=generator, device=device)
        std = 0.1 + 0.9 * torch.rand(args.n, generator=generator, device=device)

        def floor_pass():
            t = mean / std
            return torch.special.ndtr(t), torch.exp(t)

        floor2 = median_time(floor_pass, args.repeats, device)
        floor_plain = median_time(lambda: (torch.special.ndtr(mean), torch.exp(mean)), args.repeats, device)
        fast_f = median_time(forward_fn(relu, mean, std), args.repeats, device)
        fast_fv = median_time(lambda: relu.moments(mean, std, return_variance=True), args.repeats, device)
        with torch.no_grad():
            fast_mean = median_time(lambda: relu.mean(mean, std), args.repeats, device)
        with reference_kernels(reference):
            ref_f = median_time(forward_fn(relu, mean, std), max(1, args.repeats // 2), device)
        print(f"\n[target 2] relu.moments forward on {args.n:.0e} float32 elements")
        print(f"  t = x/std, ndtr(t), exp(t)  {floor2 * 1e3:9.2f} ms   (floor)")
        print(f"  ndtr(x), exp(x)             {floor_plain * 1e3:9.2f} ms   {floor_plain / floor2:6.2f}x floor")
        print(f"  fast      .moments          {fast_f * 1e3:9.2f} ms   {fast_f / floor2:6.2f}x floor")
        print(f"  fast      .moments(+var)    {fast_fv * 1e3:9.2f} ms   {fast_fv / floor2:6.2f}x floor")
        print(f"  fast      .mean (no_grad)   {fast_mean * 1e3:9.2f} ms   {fast_mean / floor2:6.2f}x floor")
        print(f"  reference .moments          {ref_f * 1e3:9.2f} ms   {ref_f / floor2:6.2f}x floor")
        print(f"  target 2: {verdict(fast_f / floor2, 1.5)}")

        # ---- the table: every activation at one n, ns per element
        n = args.others_n
        mean = torch.randn(n, generator=generator, device=device)
        std = 0.1 + 0.9 * torch.rand(n, generator=generator, device=device)
        activations = [
            ("relu", relu),
            ("leaky_relu", get_activation("leaky_relu")),
            ("relu_squared", get_activation("relu_squared")),
            ("identity", get_activation("identity")),
            ("hard_sigmoid", get_activation("hard_sigmoid", alpha=1.0)),
            ("user piecewise", user_piecewise()),
        ]
        results = {}
        for dtype in (torch.float32, torch.float64):
            m, s = mean.to(dtype), std.to(dtype)
            for label_a, activation in activations:
                row = {}
                row["fast fwd"] = median_time(forward_fn(activation, m, s), args.repeats, device)
                row["fast fwd+bwd"] = median_time(forward_backward_fn(activation, m, s), args.repeats, device)
                with reference_kernels(reference):
                    reps = max(1, args.repeats // 3)
                    row["ref fwd"] = median_time(forward_fn(activation, m, s), reps, device)
                    row["ref fwd+bwd"] = median_time(forward_backward_fn(activation, m, s), reps, device)
                results[(dtype, label_a)] = row
        for dtype in (torch.float32, torch.float64):
            print(
                f"\n[all activations] n = {n:.0e} {str(dtype).replace('torch.', '')}, ns per element (ratio to relu of the same column)"
            )
            print(
                f"  {'activation':<16}{'fast fwd':>16}{'fast fwd+bwd':>18}{'ref fwd':>16}{'ref fwd+bwd':>18}{'speed-up fwd+bwd':>18}"
            )
            base = results[(dtype, "relu")]
            for label_a, _ in activations:
                row = results[(dtype, label_a)]
                cells = []
                for key in ("fast fwd", "fast fwd+bwd", "ref fwd", "ref fwd+bwd"):
                    cells.append(f"{row[key] / n * 1e9:8.1f} ({row[key] / base[key]:4.1f}x)")
                speedup = row["ref fwd+bwd"] / row["fast fwd+bwd"]
                print(f"  {label_a:<16}{cells[0]:>16}{cells[1]:>18}{cells[2]:>16}{cells[3]:>18}{speedup:>17.1f}x")
        print("\n[target 3] per element, float32, fast path, ratio to relu")
        base = results[(torch.float32, "relu")]
        for label_a in ("leaky_relu", "relu_squared", "hard_sigmoid", "user piecewise"):
            row = results[(torch.float32, label_a)]
            print(
                f"  {label_a:<16} fwd {verdict(row['fast fwd'] / base['fast fwd'], 3.0)};"
                f" fwd+bwd {verdict(row['fast fwd+bwd'] / base['fast fwd+bwd'], 3.0)}"
            )

        if args.compile and device.type == "cpu":
            print(
                "\n[torch.compile] the reference ops compiled by inductor (the fast kernels are skipped while tracing)"
            )
            rows, cols = args.block
            block_mean = torch.randn(rows, cols, generator=generator)
            block_std = 0.1 + 0.9 * torch.rand(rows, cols, generator=generator)
            compiled = torch.compile(lambda m, s: relu.moments(m, s))
            start = time.perf_counter()
            compiled(block_mean, block_std)
            compile_seconds = time.perf_counter() - start
            steady = median_time(lambda: compiled(block_mean, block_std), 5 * args.repeats, device)
            eager = median_time(forward_fn(relu, block_mean, block_std), 5 * args.repeats, device)
            print(
                f"  relu fwd {rows}x{cols}: compiled {steady * 1e6:.1f} us (first call {compile_seconds:.1f} s),"
                f" fast kernel {eager * 1e6:.1f} us"
            )


if __name__ == "__main__":
    main()
