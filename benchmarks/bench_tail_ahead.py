"""The tail pass's backward taken ahead (``cfbnn::relu_tail_with_gradients``) against the tail pass's
own backward in the backward pass, inside the closed-form ELBO's training step, and both against the
plain MLP's step.

    python benchmarks/bench_tail_ahead.py                  # D=90/H=200 and D=2048/H=1000, batch 500
    python benchmarks/bench_tail_ahead.py --sizes 90x200   # one size

An ELBO's upstream gradient is one number, so its node (``cfbnn::normal_elbo``,
``bnn/fused/normal_elbo.py``) takes the tail pass's backward in the forward pass and scales it
afterwards, evaluating the activation's moments once a step. For the comparison this script turns
that off in the same process (the ``ahead`` argument of the node's ``_tail_pass``, wrapped here) and
times the three steps interleaved, one of each per round, medians of
``--rounds`` (the CPU's speed drifts between runs; interleaving keeps the ratios comparable).
Both steps run as the CLI runs (threads, allocator, denormals flushed). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_elbo import configure_like_cli
from torch import nn

import cfbnn_cli.bnn.fused.normal_elbo as normal_elbo
from cfbnn_cli.bnn import ClosedFormBNN
from cfbnn_cli.moments import set_validate_args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["90x200", "2048x1000"])
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=200, help="rounds at the first size; a tenth at D >= 1000")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads, {configure_like_cli()}")
    set_validate_args(False)
    tail_pass = normal_elbo._tail_pass
    ahead_allowed = [True]

    def tail_pass_switched(*arguments):  # the node asks for ahead; the switch may refuse it
        *rest, ahead = arguments
        return tail_pass(*rest, ahead and ahead_allowed[0])

    normal_elbo._tail_pass = tail_pass_switched
    for size in args.sizes:
        dim, hidden = (int(v) for v in size.split("x"))
        torch.manual_seed(0)
        x, y = torch.randn(args.batch, dim), torch.randn(args.batch)
        model = ClosedFormBNN(dim, hidden)
        mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def closed_form():
            (-model.elbo(x, y, num_data=10 * args.batch)).backward()

        def plain():
            (mlp(x).squeeze(-1) - y).pow(2).mean().backward()

        steps = {"ahead": closed_form, "plain MLP": plain, "tail backward in the backward": closed_form}
        times = {name: [] for name in steps}
        for _ in range(5):
            closed_form(), plain()
        rounds = args.rounds if dim < 1000 else max(args.rounds // 10, 5)
        for _ in range(rounds):
            for name, step in steps.items():
                ahead_allowed[0] = name == "ahead"
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
        mlp_ms = ms["plain MLP"]
        print(f"D={dim}, H={hidden}, batch {args.batch}: medians of {rounds} interleaved rounds")
        for name, value in ms.items():
            print(f"  {name:32s} {value:8.3f} ms  {value / mlp_ms:5.2f}x the plain MLP")
        print(f"  the backward taken ahead: {ms['ahead'] / ms['tail backward in the backward']:.2f}x the step")
    normal_elbo._tail_pass = tail_pass


if __name__ == "__main__":
    main()
