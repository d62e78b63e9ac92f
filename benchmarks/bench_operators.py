"""The ``cfbnn::`` operators: kernels per closed-form step, the step against the plain MLP and
against local reparameterization, and the ReLU moments against erfc + exp -- side by side in
one process; the last lines say which targets are met.

    python benchmarks/bench_operators.py                 # CPU part only where there is no GPU
    python benchmarks/bench_operators.py --device cuda   # both (about 1 minute on an H100)

Measured (medians of ``--repeats`` timings of ``--steps`` calls each):

1. CPU: ``relu.moments`` forward + backward on a 500 x 200 float32 block (the CLI's CPU path and
   the operator ``cfbnn::relu_moments`` called directly) against ``erfc`` + ``exp`` on the
   same block (target <= 5x). Beside it, what that measure cannot go below: the same harness
   (the two outputs summed, ``backward()``, the gradients accumulated into ``mean.grad`` and
   ``std.grad``) around torch's own autograd ops in place of the moments -- an identity
   (``mean * 1``, ``std * 1``) and ``exp`` + ``erfc`` themselves -- and the two kernels alone
   (``cfbnn::relu_moments`` and ``cfbnn::relu_moments_backward`` without autograd);
2. CUDA: the kernels one eager closed-form training step launches (forward, backward, Adam;
   batch 500, torch profiler), with the operators and with the reference torch ops
   (``ops.device_kernels(False)``) (target <= 30);
3. CUDA: the graphed closed-form step (the CLI's CUDA path) against the graphed plain MLP
   (target <= 1.5x) and the graphed local-reparameterization step (``sampling``; target: the
   closed form faster), at D=90/H=200 and D=2048/H=1000.
"""

from __future__ import annotations

import argparse

import torch
from bench_cuda_graphs import (  # the timing and kernel-count helpers of the graph benchmark
    _kernel_names,
    _median_ms,
)

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.moments import get_activation, ops, validate_args
from cfbnn_cli.train.graphs import GraphedTrainingStep
from cfbnn_cli.train.optimizers import adam  # the pipelines' Adam (fused)

TARGETS = []  # (name, value, target text, met)


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
        phi, ups, var = torch.ops.cfbnn.relu_moments(x, s)
        torch.ops.cfbnn.relu_moments_backward(x, s, phi, ones, ones, zeros)

    def erfc_exp():
        torch.special.erfc(x)
        torch.exp(x)

    calls = {
        "cli": harness(relu.moments),
        "operator": harness(ops.relu_moments_function),
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
        ("operator (cfbnn::relu_moments), in the harness", "operator"),
        ("floor: an identity (m * 1, s * 1), in the harness", "identity"),
        ("floor: torch.exp + torch.special.erfc, in the harness", "torch_erfc_exp"),
        ("the two operators' kernels alone, no autograd", "kernels"),
        ("erfc + exp (no autograd)", "erfc_exp"),
    )
    for label, name in rows:
        print(f"   {label:56s} {times[name]:8.1f}  {times[name] / base:5.1f}x")
    ratio = times["cli"] / base
    TARGETS.append(("CPU relu moments fwd+bwd / erfc+exp, 500x200", f"{ratio:.1f}x", "<= 5x", ratio <= 5.0))
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
            return model, optimizer, lambda r: -model.elbo(x[r], y[r], num_data=10_000, estimator=estimator)

        kernels = {}
        with validate_args(False):
            for enabled in (True, False):
                with ops.device_kernels(enabled):
                    step = _eager_step(*network("analytic"))
                    times = {}
                    names = _kernel_names(lambda step=step: step(rows), times)
                    kernels[enabled] = sum(names.values())
                    if enabled and args.list_kernels:
                        print(f"   D={dim} H={hidden}: the eager closed-form step's kernels (count, GPU us), by time")
                        for name in sorted(names, key=lambda n: -times[n]):
                            print(f"     {names[name]:3d} {times[name]:8.1f}  {name[:100]}")
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
        mlp_step = GraphedTrainingStep(
            mlp, mlp_optimizer, lambda r: (mlp(x[r]).squeeze(-1) - y[r]).square().mean(), device, label="MLP"
        )
        for _ in range(3):
            mlp_step(rows)
        mlp_ms = _median_ms(lambda: mlp_step(rows), args.steps, args.repeats, sync)
        closed, sampled = timings["closed form"], timings["local reparameterization"]
        print(
            f"   D={dim:<5} H={hidden:<5} kernels per eager step: {kernels[True]} with the operators, "
            f"{kernels[False]} with the reference ops"
        )
        print(
            f"   graphed (ms): closed form {closed:7.3f}   local reparameterization {sampled:7.3f}   "
            f"plain MLP {mlp_ms:7.3f}   closed form / MLP {closed / mlp_ms:4.2f}x"
        )
        TARGETS.append(
            (f"kernels per closed-form step, D={dim}/H={hidden}", str(kernels[True]), "<= 30", kernels[True] <= 30)
        )
        TARGETS.append(
            (
                f"graphed closed-form step / graphed MLP, D={dim}/H={hidden}",
                f"{closed / mlp_ms:.2f}x",
                "<= 1.5x",
                closed / mlp_ms <= 1.5,
            )
        )
        TARGETS.append(
            (
                f"graphed closed-form step vs local reparameterization, D={dim}/H={hidden}",
                f"{closed:.3f} vs {sampled:.3f} ms",
                "faster",
                closed < sampled,
            )
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
        cuda_steps(args)
    print("\nOperator targets:")
    for name, value, target, met in TARGETS:
        print(f"  {'met   ' if met else 'MISSED'}  {name}: {value} (target {target})")


if __name__ == "__main__":
    main()
