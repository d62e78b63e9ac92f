"""The ``cfbnn::`` operators: kernels per closed-form step, the step against the plain MLP and
against local reparameterization, and the ReLU moments against erfc + exp -- side by side in
one process; the last lines say which targets are met.

    python benchmarks/bench_operators.py                 # CPU part only where there is no GPU
    python benchmarks/bench_operators.py --device cuda   # both (about 1 minute on an H100)

Measured (medians of ``--repeats`` timings of ``--steps`` calls each):

1. CPU: ``relu.moments`` forward + backward on a 500 x 200 float32 block (the CLI's CPU path and
   the operator ``cfbnn::relu_family_moments`` called directly for ReLU) against ``erfc`` + ``exp`` on the
   same block (target <= 5x). Beside it, what that measure cannot go below: the same harness
   (the two outputs summed, ``backward()``, the gradients accumulated into ``mean.grad`` and
   ``std.grad``) around torch's own autograd ops in place of the moments -- an identity
   (``mean * 1``, ``std * 1``) and ``exp`` + ``erfc`` themselves -- and the two kernels alone
   (``cfbnn::relu_family_moments`` and its backward without autograd);
2. CUDA: the kernels one closed-form training step launches (batch 500, torch profiler): the
   work its CUDA graph holds (forward, backward, Adam; ``GraphedTrainingStep.captured_step``, run
   eagerly under the profiler), with the operators and with the reference kernels
   kernels (tests/reference_kernels.py, registered for CUDA) (targets <= 18, issue #46, and <= 27, issue #43's "no worse"), and
   beside it what runs before each replay, outside the graph (the batch's gather);
3. CUDA: the graphed closed-form step (the CLI's CUDA path) against the graphed plain MLP
   (targets <= 1.4x, issue #46, and no worse than issue #43's 1.66x at D=90 and 1.85x at D=2048)
   and the graphed local-reparameterization step (``sampling``; target: the closed form faster),
   at D=90/H=200 and D=2048/H=1000;
4. the tail pass forward + backward, ``cfbnn::relu_tail`` + ``cfbnn::relu_tail_backward`` on a
   500 x 1000 float32 block (target <= 20 us on CUDA): on CUDA the GPU time of a CUDA graph of
   ``--steps`` pairs replayed between CUDA events (launch costs amortized, as in the graphed
   training step), beside the eager calls' time; on the CPU the eager calls (C++ kernels).

Every target is also printed as one machine-readable line (benchmarks/targets.py),
``TARGET <name> <value> <op> <threshold> <unit> met|MISSED``, which gpu_suite.sh collects.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from bench_cuda_graphs import (  # the timing and kernel-count helpers of the graph benchmark
    _kernel_names,
    _median_ms,
)
from seams import reference_kernels
from targets import print_targets, report_target

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.moments import get_activation, validate_args
from cfbnn_cli.runtime.cuda_graphs import capture, on_side_stream
from cfbnn_cli.train.graphs import BatchLoss, GraphedTrainingStep, make_capturable
from cfbnn_cli.train.optimizers import adam  # the pipelines' Adam (fused)

# issue #43's "no worse than" bounds of the graphed closed-form step / graphed MLP, by D
NO_WORSE_RATIO = {90: 1.66, 2048: 1.85}


def cpu_moments(args):
    relu = get_activation("relu")
    g = torch.Generator().manual_seed(0)
    mean = (torch.randn(500, 200, generator=g) * 2).requires_grad_()
    std = (torch.rand(500, 200, generator=g) + 0.1).requires_grad_()
    x, s = mean.detach(), std.detach()

    def harness(function):
        # what the measure times around the moments: both outputs summed, backward, the gradients
        # accumulated into mean.grad and std.grad
        def call():
            first, second = function(mean, std)[:2]
            (first.sum() + second.sum()).backward()

        return call

    ones, zeros = torch.ones_like(x), torch.zeros_like(x)

    def kernels_alone():
        phi, ups, var = torch.ops.cfbnn.relu_family_moments(x, s, 0, 0.0, False)
        torch.ops.cfbnn.relu_family_moments_backward(x, s, phi, ones, ones, zeros, 0, 0.0, False)

    def erfc_exp():
        torch.special.erfc(x)
        torch.exp(x)

    calls = {
        "cli": harness(relu.moments),
        "operator": harness(lambda mean, std: torch.ops.cfbnn.relu_family_moments(mean, std, 0, 0.0, False)),
        "identity": harness(lambda m, v: (m * 1.0, v * 1.0)),
        "torch_erfc_exp": harness(lambda m, v: (torch.exp(m), torch.special.erfc(v))),
        "kernels": kernels_alone,
        "erfc_exp": erfc_exp,
    }
    for call in calls.values():
        call()
    times = {name: 1e3 * _median_ms(call, args.steps, args.repeats, sync=lambda: None) for name, call in calls.items()}
    base = times["erfc_exp"]
    print(
        f"1. CPU ({torch.get_num_threads()} threads), relu moments fwd+bwd on 500x200 float32 (us; ratio to erfc+exp)"
    )
    rows = (
        ("CLI path (relu.moments), in the harness", "cli"),
        ("operator (cfbnn::relu_family_moments), in the harness", "operator"),
        ("floor: an identity (m * 1, s * 1), in the harness", "identity"),
        ("floor: torch.exp + torch.special.erfc, in the harness", "torch_erfc_exp"),
        ("the two operators' kernels alone, no autograd", "kernels"),
        ("erfc + exp (no autograd)", "erfc_exp"),
    )
    for label, name in rows:
        print(f"   {label:56s} {times[name]:8.1f}  {times[name] / base:5.1f}x")
    ratio = times["cli"] / base
    report_target(
        "cpu_relu_moments_over_erfc_exp", ratio, "<=", 5, "x", label="CPU relu moments fwd+bwd / erfc+exp, 500x200"
    )
    floor = times["torch_erfc_exp"] / base
    print(
        f"   the harness around torch's own exp + erfc is {floor:.1f}x erfc+exp; the moments cost "
        f"{times['cli'] / times['torch_erfc_exp']:.2f}x that"
    )


def _eager_step(model, optimizer, loss):
    def step(rows):
        optimizer.zero_grad(set_to_none=True)
        value = loss(rows)
        value.backward()
        optimizer.step()
        return value.detach()

    return step


def _graph_kernels(model, optimizer, loss, rows, device, times):
    """``(in the graph, before each replay)``: the kernels (by name, a ``Counter``) of the work a
    CUDA graph of the training step holds and of the fill before its replay (the batch's gather),
    each run eagerly under the profiler after an eager step (Adam's state, Triton's first launches);
    ``times`` receives the first one's GPU time by name."""
    graphed = GraphedTrainingStep(model, optimizer, loss, device)
    make_capturable(optimizer)
    value = _eager_step(model, optimizer, loss)(rows)
    fill, step = graphed.captured_step(rows, value)

    def graph_work():
        optimizer.zero_grad(set_to_none=True)  # as before a capture: backward() writes the gradients
        return step()

    return _kernel_names(graph_work, times), _kernel_names(lambda: fill(rows))


def cuda_steps(args):
    device = torch.device("cuda")
    sync = torch.cuda.synchronize
    print("2./3. CUDA training step, batch 500")
    for dim, hidden in ((90, 200), (2048, 1000)):
        x = torch.randn(10_000, dim, device=device)
        y = torch.randn(10_000, device=device)
        rows = torch.randint(0, 10_000, (500,), device=device)

        def network(estimator):
            torch.manual_seed(0)
            model = BayesianNetwork(dim, [hidden]).to(device)
            optimizer = adam(model.parameters(), lr=1e-3)
            # the batch's rows gathered before each replay, outside the graph (BatchLoss)
            loss = BatchLoss((x, y), lambda xb, yb: -model.elbo(xb, yb, num_data=10_000, estimator=estimator))
            return model, optimizer, loss

        kernels, gathers = {}, 0
        with validate_args(False):
            for enabled in (True, False):
                with contextlib.nullcontext() if enabled else reference_kernels("CUDA"):
                    times = {}
                    names, filled = _graph_kernels(*network("analytic"), rows, device, times)
                    kernels[enabled] = sum(names.values())
                    if enabled:
                        gathers = sum(filled.values())
                    if enabled and args.list_kernels:
                        print(
                            f"   D={dim} H={hidden}: the closed-form step's kernels in its CUDA graph "
                            "(count, GPU us), by time"
                        )
                        for name in sorted(names, key=lambda n: -times[n]):
                            print(f"     {names[name]:3d} {times[name]:8.1f}  {name[:100]}")
                        print(f"     before each replay (the batch's gather): {dict(filled)}")
            timings = {}
            for name, estimator in (("closed form", "analytic"), ("local reparameterization", "sampling")):
                model, optimizer, loss = network(estimator)
                step = GraphedTrainingStep(model, optimizer, loss, device, label=name)
                for _ in range(3):
                    step(rows)
                if not step.enabled:
                    raise SystemExit(f"capture of the {name} step failed: {step.failure}")
                timings[name] = _median_ms(lambda step=step: step(rows), args.steps, args.repeats, sync)
        mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)).to(device)
        mlp_optimizer = adam(mlp.parameters(), lr=1e-3)
        mlp_loss = BatchLoss((x, y), lambda xb, yb: (mlp(xb).squeeze(-1) - yb).square().mean())
        mlp_step = GraphedTrainingStep(mlp, mlp_optimizer, mlp_loss, device, label="MLP")
        for _ in range(3):
            mlp_step(rows)
        mlp_ms = _median_ms(lambda: mlp_step(rows), args.steps, args.repeats, sync)
        closed, sampled = timings["closed form"], timings["local reparameterization"]
        print(
            f"   D={dim:<5} H={hidden:<5} kernels per step in its CUDA graph: {kernels[True]} with the operators, "
            f"{kernels[False]} with the reference ops; before each replay (the batch's gather): {gathers}"
        )
        print(
            f"   graphed (ms): closed form {closed:7.3f}   local reparameterization {sampled:7.3f}   "
            f"plain MLP {mlp_ms:7.3f}   closed form / MLP {closed / mlp_ms:4.2f}x"
        )
        size = f"D={dim}/H={hidden}"
        for bound, issue, suffix in ((18, "#46", ""), (27, "#43, no worse", "/no_worse")):
            report_target(
                f"kernels_per_step/D={dim}{suffix}",
                kernels[True],
                "<=",
                bound,
                "kernels",
                device,
                label=f"kernels per closed-form step, {size} ({issue})",
            )
        for bound, issue, suffix in ((1.4, "#46", ""), (NO_WORSE_RATIO[dim], "#43, no worse", "/no_worse")):
            report_target(
                f"graphed_step_over_mlp/D={dim}{suffix}",
                closed / mlp_ms,
                "<=",
                bound,
                "x",
                device,
                label=f"graphed closed-form step / graphed MLP, {size} ({issue})",
            )
        report_target(
            f"graphed_step_over_local_reparam/D={dim}",
            closed / sampled,
            "<",
            1,
            "x",
            device,
            label=f"graphed closed-form step / local reparameterization, {size} ({closed:.3f} vs {sampled:.3f} ms)",
        )


def tail_pass(args, device):
    """``cfbnn::relu_tail`` + ``cfbnn::relu_tail_backward`` on a 500 x 1000 float32 block (ReLU), and
    beside it, eager, ``cfbnn::relu_tail_with_gradients``: the same work as a training step's ELBO
    node runs it (the backward taken in the forward pass, the moments evaluated once)."""
    g = torch.Generator().manual_seed(0)
    rows, width = 500, 1000
    mean = (torch.randn(rows, width, generator=g) * 2).to(device)
    variance = (torch.rand(rows, width, generator=g) + 0.1).to(device)
    loc = torch.randn(width, generator=g) / width**0.5
    weights = [w.to(device) for w in (loc, loc.square(), torch.rand(width, generator=g) / width)]
    row_u, row_k = torch.randn(rows, generator=g).to(device), -torch.rand(rows, generator=g).to(device)

    def pair():
        torch.ops.cfbnn.relu_tail(mean, variance, *weights)
        return torch.ops.cfbnn.relu_tail_backward(mean, variance, *weights, row_u, row_k)

    y, output_loc = torch.randn(rows, generator=g).to(device), torch.cat([loc, torch.zeros(1)]).reshape(1, -1)
    log_precision = torch.zeros(1, device=device)

    def ahead():
        return torch.ops.cfbnn.relu_tail_with_gradients(
            mean, variance, *weights, y, output_loc.to(device), log_precision, 1.0, True
        )

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        on_side_stream(lambda: [pair() for _ in range(3)], device)  # warm-up (compiles the kernels)
        on_side_stream(lambda: [ahead() for _ in range(3)], device)
        eager_us = 1e3 * _median_ms(pair, args.steps, args.repeats, sync)
        ahead_us = 1e3 * _median_ms(ahead, args.steps, args.repeats, sync)
        where = "eager calls"
        value = eager_us
        if cuda:
            replay = capture(lambda: [pair() for _ in range(args.steps)])
            replay()
            times = []
            for _ in range(args.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    replay()
                end.record()
                end.synchronize()
                times.append(1e3 * start.elapsed_time(end) / (5 * args.steps))
            value = statistics.median(times)
            where = f"a CUDA graph of {args.steps} pairs"
    print(
        f"tail pass fwd+bwd (cfbnn::relu_tail + relu_tail_backward), {rows}x{width} float32, {device.type}: "
        f"eager {eager_us:.1f} us per pair" + (f", graphed {value:.1f} us per pair" if cuda else "")
    )
    print(
        f"  the same work in one call (cfbnn::relu_tail_with_gradients, a training step's): eager {ahead_us:.1f} us"
        f" ({ahead_us / eager_us:.2f}x the pair)"
    )
    report_target(
        "tail_fwd_bwd_us/500x1000",
        value,
        "<=",
        20,
        "us",
        device,
        label=f"tail pass fwd+bwd, 500x1000 float32 ({where})",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--list-kernels", action="store_true", help="print the eager step's kernels by name")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    cpu_moments(args)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs CUDA")
    tail_pass(args, torch.device(args.device))  # before the training steps: short, and a target of its own
    if args.device == "cuda":
        cuda_steps(args)
    print_targets("Operator targets:")


if __name__ == "__main__":
    main()
