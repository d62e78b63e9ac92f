"""Forward+backward of the deterministic (nothing sampled) D-200-200-1 ELBO step.

Side by side in one run, median of ``--repeats`` rounds (each step once per round) after a warm-up, float32,
batch 500, D = 90 (paper Table 1's MSD width):

* ``deterministic``: both hidden layers' moments, the second propagated (diagonal);
* ``analytic``: the paper's Table 1 estimator (first layer sampled by local
  reparameterization, the last two integrated);
* ``sampling``: every layer sampled;
* a plain MLP of the same shape (MSE step), the yardstick;

then the cost of a full covariance per row of every Gaussian layer's q under
``deterministic`` at H = 50, 200 (one hidden width H-H), as a ratio to the diagonal (at H = 1000
its size); and the cost of carrying the activations' full covariance across units
(``deterministic_full``, DVI proper) at H = 50, 200 (batch 500) and 1000 (batch 8: at 500 one
``(N, H, H)`` tensor alone is 1.9 GiB), as a ratio to the diagonal propagation.

    python benchmarks/bench_deterministic.py [--repeats 15] [--device cpu]

Target (issue 18): deterministic step <= 3x the plain MLP on the CPU.
"""

from __future__ import annotations

import argparse

import torch
from bench_elbo import configure_like_cli, median_times  # the benchmarks' helpers (benchmarks/ on sys.path)

from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.moments import set_validate_args


def elbo_step(model, x, y, estimator):
    def step():
        model.zero_grad(set_to_none=True)
        (-model.elbo(x, y, num_data=10_000, estimator=estimator)).backward()

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keep-denormals", action="store_true", help="run with runtime.flush_denormals=false")
    args = parser.parse_args(argv)
    settings = configure_like_cli(args.keep_denormals)
    device = torch.device(args.device)
    set_validate_args(False)  # as training runs: argument checks off in the hot path
    torch.manual_seed(0)
    D, H = 90, 200
    x = torch.randn(args.batch, D, device=device)
    y = torch.randn(args.batch, device=device)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, 1)
    ).to(device)

    def mlp_step():
        mlp.zero_grad(set_to_none=True)
        (mlp(x)[:, 0] - y).square().mean().backward()

    network = BayesianNetwork(D, [H, H], 1).to(device)
    steps = {"plain MLP": mlp_step}
    steps.update(
        {estimator: elbo_step(network, x, y, estimator) for estimator in ("deterministic", "analytic", "sampling")}
    )
    rows = median_times(steps, args.repeats, device)
    print(
        f"# D={D}, H={H}-{H}, batch {args.batch}, float32, {device}, torch threads {torch.get_num_threads()}, "
        f"median of {args.repeats}, {settings}"
    )
    print("| step | ms | × plain MLP | × analytic (sample first layer) |")
    print("|---|---|---|---|")
    for name, seconds in rows.items():
        print(
            f"| {name} | {1e3 * seconds:.2f} | {seconds / rows['plain MLP']:.2f} | {seconds / rows['analytic']:.2f} |"
        )
    ratio = rows["deterministic"] / rows["plain MLP"]
    print(f"\ntarget deterministic <= 3x plain MLP: {ratio:.2f}x -> {'MET' if ratio <= 3 else 'MISSED'}\n")

    print("| H | q's covariance per row | diagonal ms | full-row q ms | full / diagonal |")
    print("|---|---|---|---|---|")
    for width in (50, 200, 1000):
        if width == 1000:  # a Cholesky factor per row: H (H + 1)^2 floats for the second layer alone
            gib = width * (width + 1) ** 2 * 4 / 2**30
            print(
                f"| {width} | full | — | not run: {gib:.1f} GiB of float32 parameters per layer (and its gradient) | — |"
            )
            continue
        models = {c: BayesianNetwork(D, [width, width], 1, covariance=c).to(device) for c in ("diagonal", "full")}
        times = median_times(
            {c: elbo_step(m, x, y, "deterministic") for c, m in models.items()}, max(3, args.repeats // 3), device
        )
        print(
            f"| {width} | full | {1e3 * times['diagonal']:.2f} | {1e3 * times['full']:.1f} | "
            f"{times['full'] / times['diagonal']:.1f} |"
        )

    # DVI proper: the activations' covariance across units carried layer to layer (estimator
    # deterministic_full): N H^2 pairs per hidden layer, each with a bivariate Normal CDF
    print(
        "\n| H | batch | diagonal propagation ms | full covariance across units ms | full / diagonal | "
        "largest (N, H, H) tensor |"
    )
    print("|---|---|---|---|---|---|")
    for width, batch in ((50, args.batch), (200, args.batch), (1000, 8)):
        xb, yb = x[:batch], y[:batch]
        model = BayesianNetwork(D, [width, width], 1).to(device)
        steps = {e: elbo_step(model, xb, yb, e) for e in ("deterministic", "deterministic_full")}
        times = median_times(steps, max(3, args.repeats // 5), device)
        mib = batch * width * width * 4 / 2**20
        print(
            f"| {width} | {batch} | {1e3 * times['deterministic']:.2f} | {1e3 * times['deterministic_full']:.1f} | "
            f"{times['deterministic_full'] / times['deterministic']:.0f} | {mib:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
