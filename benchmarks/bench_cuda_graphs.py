"""CUDA graphs: the training step, a VAE epoch, the default command and Figure 1's prediction, graphed
against eager, side by side in one process; the last lines say which targets are met.

    python benchmarks/bench_cuda_graphs.py            # needs CUDA (about 2 minutes on an H100)

Measured (medians of ``--repeats`` timings, each of ``--steps`` steps):

1. the closed-form training step (forward, backward, Adam) of the CLI's default CUDA path --
   :class:`cfbnn_cli.train.graphs.GraphedTrainingStep`, the Table 1 network with one hidden
   layer, ``analytic`` estimator, batch 500 -- graphed and eager (``trainer.cuda_graphs=false``,
   the code path before graphs), at D=90/H=200 and D=2048/H=1000; the plain MLP's step beside
   it; and the kernels one eager step launches (torch profiler);
2. one VAE V3 training epoch at Fashion-MNIST's size (49,000 rows of 784 pixels, random values:
   the time does not depend on them), batch 1000, through the training loop;
3. the default ``cfbnn train regression`` wall time with ``trainer.cuda_graphs=true`` and ``false``;
4. ``cfbnn imagenet-predict``'s own timing table: Monte Carlo with 512 samples against the
   deterministic prediction for the paper's 2048-1000-1000-1000 head at batch 256.

Every target is also printed as one machine-readable line (benchmarks/targets.py),
``TARGET <name> <value> <op> <threshold> <unit> met|MISSED``, which gpu_suite.sh collects.
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
from targets import print_targets, report_target

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.bnn.vae import BayesianDecoderVAE
from cfbnn_cli.moments import validate_args
from cfbnn_cli.train import TrainingLoop
from cfbnn_cli.train.graphs import BatchLoss, GraphedTrainingStep
from cfbnn_cli.train.optimizers import adam  # the pipelines' Adam (fused)


def _median_ms(step, steps, repeats, sync):
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def _kernel_names(step, times=None):
    """The CUDA kernels one call of ``step`` launches (torch profiler), by name: a ``Counter``;
    ``times`` (a dict), if given, receives each name's total GPU time in microseconds."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            names[event.name] += 1
            if times is not None:
                times[event.name] = times.get(event.name, 0.0) + event.time_range.elapsed_us()
    return names


def _kernels_per_step(step) -> int:
    return sum(_kernel_names(step).values())


def training_steps(args, device):
    sync = torch.cuda.synchronize
    print("1. training step, batch 500 (ms; graphed = the CLI's default CUDA path)")
    for dim, hidden, target in ((90, 200, 10.0), (2048, 1000, 5.0)):
        x = torch.randn(10_000, dim, device=device)
        y = torch.randn(10_000, device=device)
        rows = torch.randint(0, 10_000, (500,), device=device)
        results = {}
        for graphs in (False, True):
            torch.manual_seed(0)
            model = BayesianNetwork(dim, [hidden]).to(device)
            optimizer = adam(model.parameters(), lr=1e-3)
            # the batch's rows gathered outside the graph, before each replay, as the CLI's losses do
            loss = BatchLoss(
                (x, y), lambda xb, yb, model=model: -model.elbo(xb, yb, num_data=10_000, estimator="analytic")
            )
            if graphs:
                step = GraphedTrainingStep(model, optimizer, loss, device, label=f"D={dim}")
            else:  # the eager step as the loop ran it before graphs (plain Adam)

                def step(r, optimizer=optimizer, loss=loss):
                    optimizer.zero_grad(set_to_none=True)
                    value = loss(r)
                    value.backward()
                    optimizer.step()
                    return value.detach()

            with validate_args(False):
                for _ in range(3):
                    step(rows)
                results[graphs] = _median_ms(lambda: step(rows), args.steps, args.repeats, sync)
                if not graphs:
                    kernels = _kernels_per_step(lambda: step(rows))
            if graphs and not step.enabled:
                raise SystemExit(f"capture of the D={dim} step failed: {step.failure}")
        mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)).to(device)
        mlp_optimizer = adam(mlp.parameters(), lr=1e-3)
        mlp_loss = BatchLoss((x, y), lambda xb, yb: (mlp(xb).squeeze(-1) - yb).square().mean())
        mlp_step = GraphedTrainingStep(mlp, mlp_optimizer, mlp_loss, device, label="MLP")
        for _ in range(3):
            mlp_step(rows)
        mlp_ms = _median_ms(lambda: mlp_step(rows), args.steps, args.repeats, sync)
        speedup = results[False] / results[True]
        print(
            f"   D={dim:<5} H={hidden:<5} eager {results[False]:7.3f}   graphed {results[True]:7.3f}   "
            f"speed-up {speedup:5.1f}x   graphed plain MLP {mlp_ms:7.3f} ({results[True] / mlp_ms:4.2f}x)   "
            f"kernels per eager step {kernels}"
        )
        report_target(
            f"graphed_step_speedup/D={dim}",
            speedup,
            ">=",
            target,
            "x",
            device,
            label=f"closed-form step graphed vs eager, D={dim}/H={hidden}",
        )


def vae_epoch(args, device):
    print("2. VAE V3 epoch, 49,000 x 784 (random values), batch 1000, through the training loop (s)")
    x = torch.rand(49_000, 784, device=device)
    seconds = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = BayesianDecoderVAE(784, variant="v3").to(device)
        optimizer = adam(model.parameters(), lr=1e-3)
        sampler = torch.Generator(device=device).manual_seed(0)
        loop = TrainingLoop(
            model,
            optimizer,
            lambda r: -model.elbo(x[r], len(x), sampler) / len(x),
            len(x),
            1000,
            device,
            epochs=1 + args.repeats,
            data_generator=torch.Generator().manual_seed(0),
            generators={"sampler": sampler},
            cuda_graphs=graphs,
            label=f"v3 graphs={graphs}",
        )
        with validate_args(False):
            loop.run()
        seconds[graphs] = statistics.median(row["epoch_seconds"] for row in loop.history[1:])  # the first: warm-up
    print(f"   eager {seconds[False]:.3f}   graphed {seconds[True]:.3f}")
    report_target(
        "vae_v3_epoch_graphed_s",
        seconds[True],
        "<=",
        0.1,
        "s",
        device,
        label="VAE V3 epoch, 49k rows, batch 1000 (graphed)",
    )


def _cfbnn(*args):
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cfbnn_cli.cli", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cfbnn {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - started


def default_command(args, folder: Path):
    print("3. default `cfbnn train regression device=cuda` wall time (s), trainer.cuda_graphs false / true")
    walls = {
        flag: _cfbnn(
            "train",
            "regression",
            "device=cuda",
            f"trainer.cuda_graphs={str(flag).lower()}",
            f"hydra.run.dir={folder / f'regression-{flag}'}",
        )
        for flag in (False, True)
    }
    ratio = walls[True] / walls[False]
    print(f"   eager {walls[False]:.1f}   graphed {walls[True]:.1f}   ratio {ratio:.2f}")
    report_target(
        "train_regression_graphed_over_eager",
        ratio,
        "<=",
        0.5,
        "x",
        "cuda",
        label="default train regression wall time, graphed / eager",
    )


def figure1_timing(args, folder: Path):
    print("4. `cfbnn imagenet-predict device=cuda`: its timing table, paper-size head, batch 256")
    run = folder / "imagenet"
    _cfbnn("imagenet-predict", "device=cuda", f"hydra.run.dir={run}", f"features.cache_dir={folder / 'cache'}")
    print("   " + (run / "timing.md").read_text().replace("\n", "\n   "))
    metrics = json.loads((run / "results.json").read_text())["metrics"]
    ratio = metrics["paper_head/monte_carlo/N512/speed_ratio_mc_over_deterministic"]
    report_target(
        "mc512_over_deterministic/paper_head",
        ratio,
        ">=",
        100,
        "x",
        "cuda",
        label="MC-512 / deterministic, paper-size head, batch 256 (imagenet-predict's table)",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_graphs.py needs CUDA")
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    with tempfile.TemporaryDirectory() as folder:
        for part in (training_steps, vae_epoch):
            part(args, device)
        default_command(args, Path(folder))
        figure1_timing(args, Path(folder))
    print_targets("CUDA graph targets:")


if __name__ == "__main__":
    main()
