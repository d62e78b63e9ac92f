"""The CPU's two routes to the same C++ kernels: through the ``cfbnn::`` operators (the default)
against called directly, side by side in one process.

    python benchmarks/bench_routes.py                    # both sections
    python benchmarks/bench_routes.py --repeats 100      # quicker

1. ``Activation.moments`` of ReLU, leaky ReLU (slope 0.1) and ReLU^2 on a 500 x 200 float32 block,
   forward + backward (dense gradients for Phi and Upsilon) and without autograd: through the
   operator (its C++ kernel and C++ autograd) against ``fast.moments`` (the same kernels through
   ``ctypes``, what the activations call where the library's operators' unit did not build), both
   behind the same entry, ``Activation.moments`` (its argument checks included either way).
2. One forward + backward step of a one-hidden-layer leaky ReLU and ReLU^2 network (batch 500,
   the Normal ELBO): on the operators (``NormalELBO``) against the C++ single node
   (``bnn/fused/single_node.py``, what these networks took before, and take where the operators'
   unit did not build), at D=90/H=200 and D=2048/H=1000.
3. The same for deeper ReLU, leaky ReLU and ReLU^2 networks with every layer integrated
   (``deterministic``): on the operators (``DeepNormalELBO``) against the C++ single node, at
   90-200-200-1, 90-50-50-50-1 and 512-500-500-1.

Every row is the median of ``--repeats`` timings, the rows of a section (of a size, in section 2)
timed round-robin (one of each per round) so that a slow spell of a shared machine hits them
alike. Not a test.
"""

from __future__ import annotations

import argparse

import torch
from bench_elbo import configure_like_cli, median_times  # the benchmarks' helpers (benchmarks/ on sys.path)

from cfbnn_cli.bnn import BayesianNetwork, fused
from cfbnn_cli.moments import fast, get_activation, set_validate_args

ACTIVATIONS = (("relu", {}), ("leaky_relu", {"negative_slope": 0.1}), ("relu_squared", {}))


def moments_rows(repeats: int) -> dict:
    """Section 1: ``{label: seconds}``."""
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(500, 200, generator=g).requires_grad_()
    std = (torch.rand(500, 200, generator=g) + 0.1).requires_grad_()
    grad_phi, grad_upsilon = torch.randn(500, 200, generator=g), torch.randn(500, 200, generator=g)

    def call(activation, through_operator, autograd):
        route = activation.operator_applies

        def run():
            # declining the operator sends Activation.moments to fast.moments, past the same checks
            activation.operator_applies = route if through_operator else (lambda mean: False)
            try:
                if autograd:
                    phi, upsilon = activation.moments(mean, std)
                    torch.autograd.backward([phi, upsilon], [grad_phi, grad_upsilon])
                else:
                    with torch.no_grad():
                        activation.moments(mean, std)
            finally:
                activation.operator_applies = route

        return run

    rows = {}
    # with and without autograd in rounds of their own: a call just after a backward pass pays for
    # it (measured: ~20 us), which would tilt whichever row follows one
    for autograd in (True, False):
        steps = {}
        for name, params in ACTIVATIONS:
            activation = get_activation(name, **params)
            assert activation.operator is not None and activation.operator_applies(mean), name
            kind = "fwd+bwd" if autograd else "no autograd"
            steps[f"{name}.moments {kind}, operator"] = call(activation, True, autograd)
            steps[f"{name}.moments {kind}, direct"] = call(activation, False, autograd)
        rows.update(median_times(steps, repeats, torch.device("cpu")))
    return rows


def elbo_rows(repeats: int, shapes, activations, estimator: str = "analytic") -> dict:
    """Sections 2 and 3: ``{label: seconds}`` for networks ``(D, hidden widths)``, each shape
    timed on its own."""
    operators_apply = fused.operators_apply
    rows = {}
    for D, hidden in shapes:
        steps = {}
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(500, D, generator=g), torch.randn(500, generator=g)
        shape = "-".join(str(width) for width in (D, *hidden, 1))
        for name, params in activations:
            network = BayesianNetwork(D, hidden, activation=get_activation(name, **params))

            def step(network=network, x=x, y=y, on_operators=True):
                # the estimator asks fused.operators_apply; declining sends it to the single node
                fused.operators_apply = operators_apply if on_operators else (lambda *a, **k: False)
                try:
                    for parameter in network.parameters():
                        parameter.grad = None
                    (-network.elbo(x, y, num_data=10 * len(x), estimator=estimator)).backward()
                finally:
                    fused.operators_apply = operators_apply

            steps[f"{name} {shape} step, operators"] = step
            steps[f"{name} {shape} step, single node"] = lambda step=step: step(on_operators=False)
        rows.update(median_times(steps, repeats, torch.device("cpu")))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300, help="timed rounds of section 1 (section 2: a tenth)")
    parser.add_argument("--sizes", nargs="*", default=["90x200", "2048x1000"])
    args = parser.parse_args(argv)
    settings = configure_like_cli()
    set_validate_args(False)
    if fast.load_kernels() is None or not fast.cpu_operators_registered():
        raise SystemExit("bench_routes: the C++ library's operators did not build here; nothing to compare")
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads, float32, {settings}")
    print("\n1. Activation.moments on a 500x200 block (us)")
    for label, seconds in moments_rows(args.repeats).items():
        print(f"   {label:48s} {seconds * 1e6:8.1f}")
    shapes = [(int(size.split("x")[0]), [int(size.split("x")[1])]) for size in args.sizes]
    print("\n2. one-hidden-layer network, forward + backward at batch 500 (ms)")
    for label, seconds in elbo_rows(max(args.repeats // 10, 5), shapes, ACTIVATIONS[1:]).items():
        print(f"   {label:48s} {seconds * 1e3:8.3f}")
    print("\n3. deeper networks, every layer integrated (deterministic), forward + backward at batch 500 (ms)")
    deep = [(90, [200, 200]), (90, [50, 50, 50]), (512, [500, 500])]
    for label, seconds in elbo_rows(max(args.repeats // 10, 5), deep, ACTIVATIONS, "deterministic").items():
        print(f"   {label:48s} {seconds * 1e3:8.3f}")


if __name__ == "__main__":
    main()
