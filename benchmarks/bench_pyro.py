"""One SVI step with ClosedFormELBO against one with Trace_ELBO, on the README's Pyro example.

    python benchmarks/bench_pyro.py                       # the README example: 300 rows, 3 inputs, 50 hidden
    python benchmarks/bench_pyro.py --covariance full     # the guide with full-covariance rows
    python benchmarks/bench_pyro.py --rows 353 --inputs 10 --threads 1

The same ``BNNRegressionModel`` (learned noise precision) and ``BNNRegressionGuide``
(diagonal by default), as the README builds them, are stepped by ``SVI`` with Pyro's Adam
under

  (i)   ``ClosedFormELBO()`` (the exact ELBO, no weight draws),
  (ii)  ``Trace_ELBO()`` (one weight draw per step, Pyro's default),

and (iii) ``ClosedFormBNN`` with the same network, prior, initial scales and learned
precision stepped by ``torch.optim.Adam`` (the library without Pyro). Each SVI pair has
its own parameter store scope. The steps are timed round-robin (one of each per round, so
that a slow spell of a shared machine hits all alike) after two warm-up rounds, and the
medians of ``--repeats`` rounds and their ratios are printed. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from cfbnn_cli.bnn import ClosedFormBNN
from cfbnn_cli.bnn.pyro_glue import BNNRegressionGuide, BNNRegressionModel, ClosedFormELBO


def svi_step(loss, x, y, hidden, covariance, store):
    """A step function of a fresh model/guide pair under ``loss``, inside its own param store scope."""
    state = {"params": {}, "constraints": {}}
    with store.scope(state):
        model = BNNRegressionModel(x.shape[1], hidden)
        guide = BNNRegressionGuide(x.shape[1], hidden, a_covariance=covariance, b_covariance=covariance)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), loss)
        svi.step(x, y)  # registers the parameters in this scope

    def step():
        with store.scope(state):
            start = time.perf_counter()
            svi.step(x, y)
            return time.perf_counter() - start

    return step


def library_step(x, y, hidden, covariance):
    """A step function of ``ClosedFormBNN`` (no Pyro) with the same network and Adam."""
    network = ClosedFormBNN(
        x.shape[1], hidden, a_covariance=covariance, b_covariance=covariance, init_scale=0.1, output_bias=False
    )
    optimizer = torch.optim.Adam(network.parameters(), lr=0.03)

    def step():
        start = time.perf_counter()
        optimizer.zero_grad()
        (-network.elbo(x, y, num_data=len(x))).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--inputs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=50)
    parser.add_argument("--covariance", choices=("diagonal", "full"), default="diagonal")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    x = torch.randn(args.rows, args.inputs)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(args.rows)
    store = pyro.get_param_store()
    steps = {
        "ClosedFormELBO": svi_step(ClosedFormELBO(), x, y, args.hidden, args.covariance, store),
        "Trace_ELBO": svi_step(Trace_ELBO(), x, y, args.hidden, args.covariance, store),
        "ClosedFormBNN": library_step(x, y, args.hidden, args.covariance),
    }
    times = {name: [] for name in steps}
    for round_index in range(args.repeats + 2):  # two untimed warm-up rounds
        for name, step in steps.items():
            seconds = step()
            if round_index >= 2:
                times[name].append(seconds)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{args.rows} rows, {args.inputs} inputs, {args.hidden} hidden, {args.covariance} guide, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} round-robin steps (torch {torch.__version__}, "
        f"pyro {pyro.__version__})"
    )
    for name, seconds in median.items():
        print(f"  {name:15s} {seconds * 1e3:8.3f} ms/step")
    print(f"  ClosedFormELBO / Trace_ELBO    {median['ClosedFormELBO'] / median['Trace_ELBO']:.2f}x")
    print(f"  ClosedFormELBO / ClosedFormBNN {median['ClosedFormELBO'] / median['ClosedFormBNN']:.2f}x")
    return median


if __name__ == "__main__":
    main()
