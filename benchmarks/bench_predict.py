"""Prediction speed of the Bayesian head: deterministic vs Monte Carlo vs a plain head.

    python benchmarks/bench_predict.py                  # 2048-1000-1000-1000, batch 256
    python benchmarks/bench_predict.py --device cuda --compile

Times (i) the deterministic prediction ``argmax y_hat`` (the logits' closed-form
mean), (ii) Monte Carlo with N = 1, 16, 512 logit samples per image (one batched
draw by local reparameterization, softmax averaged), and (iii) a plain deterministic
head of the same shape (the Bayesian layers' mean weights), all under
``torch.inference_mode``. Two numbers per method, best of ``--repeats``:

* ``ms/batch``: one batch, synchronized before and after (latency);
* ``images/s``: a stream of batches back to back, synchronized once at the end
  (throughput, the issue's measure). On a GPU a single call of a small head is
  bounded by launch and synchronization latency (~0.2 ms on an H200), so only the
  stream shows what the work itself costs.

``--compile`` adds the plain head, the deterministic prediction and the largest
Monte Carlo under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs on a GPU;
compiled Monte Carlo draws from the global generator). The last lines check the
issue's targets, deterministic >= 100x MC-512 and within 2x of the plain head, eager
against eager and compiled against compiled.

A line also counts what one eager call launches (torch profiler, the weights cached): the CUDA
kernels of the plain head and of the deterministic prediction, each of the latter with its GPU time,
on a GPU; the top-level operations elsewhere.

Two targets of issue #46 are also printed as machine-readable lines (benchmarks/targets.py,
``TARGET <name> <value> <op> <threshold> <unit> met|MISSED``, the head and batch in the name),
which gpu_suite.sh collects:

* ``det_over_plain/<head>/b<batch>`` (<= 1.5x): the deterministic prediction's stream time
  over the plain head's, on CUDA both as ``cfbnn imagenet-predict`` predicts -- each a CUDA
  graph (:class:`cfbnn_cli.runtime.cuda_graphs.GraphedCall`), the weights cached
  (:func:`cfbnn_cli.bnn.layers.cached_weights`) -- and eager elsewhere;
* ``mc<N>_over_deterministic/<head>/b<batch>`` (>= 100x, N = the largest of ``--samples``): the
  ratio of ``imagenet-predict``'s timing table, from the function that fills it
  (:func:`cfbnn_cli.pipelines.imagenet.prediction.time_per_image`: one batch each, graphed on
  CUDA), median of ``--repeats`` calls.

Not a test.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from targets import report_target

from cfbnn_cli.bnn.layers import cached_weights
from cfbnn_cli.bnn.network import bayesian_head
from cfbnn_cli.moments import validate_args
from cfbnn_cli.pipelines.imagenet.prediction import time_per_image
from cfbnn_cli.runtime.cuda_graphs import GraphedCall


def kernels_of(function, x, device) -> dict:
    """What one eager call of ``function(x)`` launches, ``{name: GPU microseconds}`` (a name launched
    twice appears as ``name #2``): the CUDA kernels on a GPU (torch profiler); elsewhere the top-level
    operations that compute (views left out; their time 0)."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        function(x)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
            function(x)
            sync()
    launched = {}
    for event in prof.events():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            microseconds = event.time_range.elapsed_us()
        elif event.cpu_parent is None and event.name.startswith(("aten::", "cfbnn::")) and event.name not in _VIEWS:
            microseconds = 0.0
        else:
            continue
        name, copy = event.name[:60], 1
        while name in launched:
            copy += 1
            name = f"{event.name[:60]} #{copy}"
        launched[name] = microseconds
    return launched


_VIEWS = {
    "aten::transpose",
    "aten::t",
    "aten::reshape",
    "aten::view",
    "aten::select",
    "aten::unsqueeze",
    "aten::numpy_T",
}


def split_bias(layer):
    """``(weight, bias)`` of a layer's mean weights: the matrix without its bias column, and that
    column (``None`` for a layer without a bias), each contiguous."""
    if not layer.bias:
        return layer.loc.detach().contiguous(), None
    return layer.loc[:, :-1].detach().contiguous(), layer.loc[:, -1].detach().contiguous()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2048,1000,1000,1000")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--samples", type=int, nargs="*", default=[1, 16, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-seconds", type=float, default=0.5, help="length of each timed stream of batches")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile(mode='reduce-overhead') of the plain head, the deterministic prediction and MC-max(samples)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    F, H1, H2, O = (int(v) for v in args.sizes.split(","))
    torch.manual_seed(0)
    head = bayesian_head(F, [H1, H2], O).to(device).eval()
    x = torch.randn(args.batch, F, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    _, middle, last = head.layers

    # the plain head as a user writes it (nn.Linear's product with its bias, no ones column): the
    # Bayesian layers' mean weights split once into a weight matrix and a bias vector
    (middle_weight, middle_bias), (last_weight, last_bias) = (split_bias(layer) for layer in (middle, last))

    def plain(x):
        h = head.point_features(x)
        h = torch.relu(torch.nn.functional.linear(h, middle_weight, middle_bias))
        return torch.nn.functional.linear(h, last_weight, last_bias).argmax(-1)

    def deterministic(x):
        return head.output_mean(x).argmax(-1)

    def monte_carlo(n):
        return lambda x: torch.softmax(head.sample_outputs(x, n, generator=generator), -1).mean(0).argmax(-1)

    def timed(function, grad_mode=torch.inference_mode):
        """(seconds for one synchronized batch, seconds per batch in a stream): best of repeats."""

        def call():
            if device.type == "cuda":  # compiled functions: each call is a new CUDA-graph step
                torch.compiler.cudagraph_mark_step_begin()
            function(x)

        with grad_mode():
            for _ in range(3):  # warm-up; CUDA graphs are recorded on the second or third call
                call()
            latency = float("inf")
            for _ in range(args.repeats):
                sync()
                start = time.perf_counter()
                call()
                sync()
                latency = min(latency, time.perf_counter() - start)
            calls = max(1, math.ceil(args.stream_seconds / latency))
            stream = float("inf")
            for _ in range(args.repeats):
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                sync()
                stream = min(stream, (time.perf_counter() - start) / calls)
        return latency, stream

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"torch {torch.__version__}, {where}; head {F}-{H1}-{H2}-{O}, batch {args.batch}, "
        f"float32 matmul precision {torch.get_float32_matmul_precision()!r}"
    )
    with validate_args(False):
        times = {"plain deterministic head": timed(plain), "deterministic argmax y_hat": timed(deterministic)}
        for n in args.samples:
            times[f"Monte Carlo, N={n}"] = timed(monte_carlo(n))
        if args.compile:
            compiled = torch.compile(deterministic, mode="reduce-overhead")
            times["plain head, compiled"] = timed(torch.compile(plain, mode="reduce-overhead"))
            times["deterministic, compiled"] = timed(compiled)
            with torch.inference_mode():
                torch.compiler.cudagraph_mark_step_begin()
                agreement = float((compiled(x) == deterministic(x)).double().mean())
            print(f"  compiled and eager deterministic predictions agree on {100 * agreement:.1f}% of the batch")
            # the fair peer of the compiled deterministic head: MC-N compiled too (global RNG:
            # an explicit torch.Generator would break the graph)
            n = max(args.samples)
            try:
                times[f"Monte Carlo, N={n}, compiled"] = timed(
                    torch.compile(
                        lambda x: torch.softmax(head.sample_outputs(x, n), -1).mean(0).argmax(-1),
                        mode="reduce-overhead",
                    )
                )
            except Exception as error:  # report, do not hide, a compiler failure
                print(f"  Monte Carlo, N={n} could not be compiled: {type(error).__name__}: {str(error)[:200]}")
        if device.type == "cuda":  # as imagenet-predict predicts: a CUDA graph each, the weights cached
            graphed = {
                "plain head, graphed": GraphedCall(plain, device, label="plain head"),
                "deterministic, graphed": GraphedCall(deterministic, device, label="deterministic prediction"),
            }
            with cached_weights():
                for name, function in graphed.items():
                    times[name] = timed(function, torch.no_grad)  # no_grad, as the pipeline predicts
                    if function.failure:
                        print(f"  {name}: the capture failed ({function.failure}); timed eagerly")
        # imagenet-predict's timing table, from the function that fills it (one batch each)
        n = max(args.samples)
        table = [time_per_image(head, x, [n], args.batch, generator, device) for _ in range(args.repeats)]
        with cached_weights():  # as the pipeline predicts: the stacked means and variances kept
            counts = {
                name: kernels_of(function, x, device) for name, function in (("plain", plain), ("det", deterministic))
            }
    print(
        f"  kernels per call ({'CUDA kernels' if device.type == 'cuda' else 'operations'}, torch profiler, eager, "
        f"weights cached): plain head {len(counts['plain'])}, deterministic {len(counts['det'])}: "
        + ", ".join(f"{name} {us:.1f} us" if device.type == "cuda" else name for name, us in counts["det"].items())
    )
    reference = times["deterministic argmax y_hat"][1]
    print(f"  {'':<28} {'ms/batch':>9} {'images/s':>12}   stream: deterministic is")
    for name, (latency, stream) in times.items():
        print(f"  {name:<28} {1e3 * latency:9.3f} {args.batch / stream:12.0f}   {stream / reference:8.2f}x faster")
    mc = f"Monte Carlo, N={max(args.samples)}"
    pairs = [("eager", "deterministic argmax y_hat", "plain deterministic head")]
    if args.compile:
        pairs.append(("compiled", "deterministic, compiled", "plain head, compiled"))
    for label, det, plain_name in pairs:
        mc_peer = times.get(f"{mc}, compiled", times[mc]) if label == "compiled" else times[mc]
        for measure, index in (("stream", 1), ("one batch", 0)):
            speedup = mc_peer[index] / times[det][index]
            slowdown = times[det][index] / times[plain_name][index]
            print(
                f"  targets, {label} {measure}: deterministic is {speedup:.0f}x faster than MC-{max(args.samples)} "
                f"({'met' if speedup >= 100 else 'missed'}, >= 100x) and {slowdown:.2f}x the plain head's time "
                f"({'met' if slowdown <= 2 else 'missed'}, <= 2x)"
            )
    head_name = f"{F}-{H1}-{H2}-{O}/b{args.batch}"
    route = "graphed" if device.type == "cuda" else "eager"
    det, plain_name = (
        ("deterministic, graphed", "plain head, graphed")
        if device.type == "cuda"
        else ("deterministic argmax y_hat", "plain deterministic head")
    )
    report_target(
        f"det_over_plain/{head_name}",
        times[det][1] / times[plain_name][1],
        "<=",
        1.5,
        "x",
        device,
        label=f"deterministic prediction / plain head, {head_name.replace('/b', ', batch ')} ({route} stream)",
    )
    deterministic_seconds = statistics.median(row[0] for row in table)
    mc_seconds = statistics.median(row[1][n] for row in table)
    print(
        f"  imagenet-predict's timing table (time_per_image, median of {args.repeats}): deterministic "
        f"{1e6 * deterministic_seconds:.2f} us/image, MC-{n} {1e6 * mc_seconds:.2f} us/image"
    )
    report_target(
        f"mc{n}_over_deterministic/{head_name}",
        mc_seconds / deterministic_seconds,
        ">=",
        100,
        "x",
        device,
        label=f"MC-{n} / deterministic, {head_name.replace('/b', ', batch ')} (imagenet-predict's time_per_image)",
    )


if __name__ == "__main__":
    main()
