"""The pipelines' Adam (torch's fused implementation, ``cfbnn_cli.train.optimizers.adam``) against
torch's default and for-each implementations, alone and inside a whole closed-form training step.

    python benchmarks/bench_optimizer.py                  # D=90/H=200 and D=2048/H=1000, batch 500
    python benchmarks/bench_optimizer.py --device cuda

For each size: the median time of one Adam step over a ``ClosedFormBNN``'s parameters (gradients
in place), and of one training step (zero_grad, the ELBO's forward and backward, Adam) with each
implementation, all timed round-robin in one process (one of each per round), as ratios to the
fused one. Not a test.
"""

from __future__ import annotations

import argparse

import torch
from bench_elbo import median_times  # round-robin medians after two warm-up rounds

from cfbnn_cli.bnn import ClosedFormBNN
from cfbnn_cli.moments import set_validate_args
from cfbnn_cli.runtime.threads import tune_allocator
from cfbnn_cli.train.optimizers import adam

IMPLEMENTATIONS = {
    "fused (the pipelines')": lambda params: adam(params, lr=1e-3),
    "for-each": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "default": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def _training_step(model, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        (-model.elbo(x, y, num_data=10 * len(y))).backward()
        optimizer.step()

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["90x200", "2048x1000"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    tune_allocator()
    set_validate_args(False)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, batch 500, float32, medians of {args.repeats} round-robin rounds")
    for size in args.sizes:
        dim, hidden = (int(v) for v in size.split("x"))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(500, dim, generator=g).to(device)
        y = torch.randn(500, generator=g).to(device)
        optimizer_steps, training_steps = {}, {}
        for name, make in IMPLEMENTATIONS.items():
            model = ClosedFormBNN(dim, hidden).to(device)
            optimizer = make(model.parameters())
            for parameter in model.parameters():
                parameter.grad = torch.randn_like(parameter) * 1e-3
            optimizer_steps[name] = optimizer.step
            trained = ClosedFormBNN(dim, hidden).to(device)
            training_steps[name] = _training_step(trained, make(trained.parameters()), x, y)
        alone = median_times(optimizer_steps, args.repeats, device)
        whole = median_times(training_steps, args.repeats, device)
        fused = next(iter(IMPLEMENTATIONS))
        print(f"\nD={dim}, H={hidden} ({sum(p.numel() for p in ClosedFormBNN(dim, hidden).parameters()):,} parameters)")
        print(f"  {'Adam implementation':<24} {'Adam step':>12} {'ratio':>7} {'training step':>15} {'ratio':>7}")
        for name in IMPLEMENTATIONS:
            print(
                f"  {name:<24} {alone[name] * 1e3:9.3f} ms {alone[name] / alone[fused]:6.2f}x "
                f"{whole[name] * 1e3:12.3f} ms {whole[name] / whole[fused]:6.2f}x"
            )


if __name__ == "__main__":
    main()
