"""Forward+backward time of the ELBO: closed form vs Monte Carlo vs Pyro vs a plain MLP.

    python benchmarks/bench_elbo.py                    # D=90/H=200 and D=2048/H=1000, batch 500
    python benchmarks/bench_elbo.py --sizes 90x200     # one size
    python benchmarks/bench_elbo.py --compile          # add torch.compile rows

For each size (D inputs, H hidden units, one output, batch 500) it times one forward +
backward pass of

  (i)   the closed-form ELBO (the default path: the ``cfbnn::`` operators -- C++ kernels on
        the CPU, Triton kernels on CUDA -- and the fused hot path of bnn/fused/) with diagonal,
        full and low-rank (r=10) q(a_h); the diagonal one also on the operators' reference
        kernels (tests/reference_kernels.py registered for the device: no C++ or Triton kernel)
        and, with --compile, under torch.compile;
  (ii)  the 1-sample local-reparameterization ELBO (diagonal q);
  (iii) Pyro's Trace_ELBO on a PyroModule BNN with an AutoNormal guide (weight-space sampling);
  (iv)  a plain deterministic MLP of the same shape (MSE loss),

each as the median of --repeats timings after two warm-ups, as a ratio to (iv) measured in
the same run ((i) diagonal on both routes, (ii), (iii) and (iv) round-robin, one of each per
round), and prints the targets met/missed; the operators' route against the reference ops
(target on CUDA: not slower, issue #43) also as a machine-readable line (benchmarks/targets.py,
``TARGET <name> <value> <op> <threshold> <unit> met|MISSED``) that gpu_suite.sh collects. Beside them, in the same rounds, the diagonal closed form's
four matrix products alone (means and variances forward, their weights' gradients backward;
the MLP has two of the same size): the part of (i) no kernel of ours can shorten. Both sides run with the glibc allocator tuned as the
CLI tunes it (runtime.threads.tune_allocator). Full covariance
stores H*(D+1)^2 numbers; beyond --full-limit the row is skipped with the memory it would
need. Then the per-element Monte Carlo gradient variance of (ii), of "sample A, integrate
B" and of (i) (zero: deterministic) on one minibatch. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from seams import reference_kernels
from targets import report_target
from torch import nn

from cfbnn_cli.bnn import ClosedFormBNN
from cfbnn_cli.bnn.pyro_glue import PyroMLPRegression
from cfbnn_cli.moments import set_validate_args
from cfbnn_cli.runtime.checks import MATMUL_PRECISIONS
from cfbnn_cli.runtime.device import set_matmul_precision
from cfbnn_cli.runtime.threads import flush_denormals, tune_allocator


def median_time(fn, repeats, device):
    """Median seconds of ``fn`` over ``repeats`` timed calls after two warm-up calls."""
    return median_times({"step": fn}, repeats, device)["step"]


def median_times(steps, repeats, device):
    """``{name: median seconds}`` of several steps timed round-robin (one of each per round),
    so that a slow spell of a shared machine hits all of them alike and their ratios hold."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in steps}
    for round_index in range(repeats + 2):  # two untimed warm-up rounds
        for name, fn in steps.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_index >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def local_reparam_elbo(model, x, y, num_data, generator):
    return model.elbo(x, y, num_data=num_data, estimator="sampling", generator=generator)


def configure_like_cli(keep_denormals: bool = False, matmul_precision: str = "highest") -> str:
    """The process settings the CLI makes before any work (``runtime.flush_denormals``, the
    allocator, ``runtime.matmul_precision``); call first thing, before torch starts its threads.
    Returns a phrase for the header."""
    flush_denormals(not keep_denormals)
    tune_allocator()
    set_matmul_precision(matmul_precision)
    denormals = "denormals kept (--keep-denormals)" if keep_denormals else "denormals flushed, as the CLI runs"
    return f"{denormals}, matmul precision {matmul_precision}"


def gradient_variance(loss_fn, params, draws):
    grads = []
    for _ in range(draws):
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss_fn(), params)]))
    return torch.stack(grads).var(0).mean().item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["90x200", "2048x1000"])
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--full-limit", type=float, default=2e8)
    parser.add_argument("--variance-draws", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--compile", action="store_true", help="also time torch.compile'd closed form (diagonal) and plain MLP"
    )
    parser.add_argument("--keep-denormals", action="store_true", help="run with runtime.flush_denormals=false")
    parser.add_argument(
        "--matmul-precision",
        default="highest",
        choices=MATMUL_PRECISIONS,
        help="runtime.matmul_precision: highest (full float32, the default) | high (TF32 on Ampere+ GPUs) | medium",
    )
    args = parser.parse_args(argv)
    settings = configure_like_cli(args.keep_denormals, args.matmul_precision)
    set_validate_args(False)
    torch.manual_seed(0)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, batch {args.batch}, float32, median of {args.repeats}, {settings}")
    for size in args.sizes:
        D, H = (int(v) for v in size.split("x"))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, D, generator=g).to(device)
        y = torch.randn(args.batch, generator=g).to(device)
        num_data = 10 * args.batch
        rows = {}

        mlp = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, 1)).to(device)

        def mlp_step():
            loss = (mlp(x).squeeze(-1) - y).pow(2).mean()
            loss.backward()

        models = {
            covariance: ClosedFormBNN(D, H, a_covariance=covariance, rank=10).to(device)
            for covariance in ("diagonal", "full", "lowrank")
            if covariance != "full" or H * (D + 1) ** 2 <= args.full_limit
        }

        def closed_step(model):
            return lambda: (-model.elbo(x, y, num_data=num_data)).backward()

        def reference_step(model):
            # the reference kernels on either device: no C++ kernel (CPU), no Triton kernel (CUDA)
            def step():
                with reference_kernels(torch.device(device).type.upper()):
                    closed_step(model)()

            return step

        model = ClosedFormBNN(D, H).to(device)
        sampler = torch.Generator(device=device).manual_seed(1)

        def local_step():
            (-local_reparam_elbo(model, x, y, num_data, sampler)).backward()

        pyro.clear_param_store()
        pyro_model = PyroMLPRegression(D, H, device=device)
        guide = AutoNormal(pyro_model)
        elbo = Trace_ELBO()

        def pyro_step():
            elbo.loss_and_grads(pyro_model, guide, x, y)

        # what the diagonal closed form cannot go below: its four matrix products of the MLP's first
        # layer's size -- the pre-activations' means and variances forward, the gradients of the
        # weights' means and variances backward -- where the MLP has two (its input needs no gradient)
        inputs = torch.randn(args.batch, D + 1, generator=g).to(device)
        weights = torch.randn(H, D + 1, generator=g).to(device)
        rows_grad = torch.randn(args.batch, H, generator=g).to(device)

        def four_products():
            for _ in range(2):
                torch.mm(inputs, weights.t())
                torch.mm(rows_grad.t(), inputs)

        # the steps the targets compare, timed round-robin (one of each per round): a slow spell of
        # this shared machine then hits them alike; the slower variants after, on their own
        core = median_times(
            {
                "(iv) plain MLP": mlp_step,
                "(i) closed form, diagonal": closed_step(models["diagonal"]),
                "(i) closed form, diagonal, reference kernels": reference_step(models["diagonal"]),
                "(ii) local reparameterization, 1 sample": local_step,
                "(iii) Pyro Trace_ELBO + AutoNormal": pyro_step,
                "floor": four_products,
            },
            args.repeats,
            device,
        )
        plain = core["(iv) plain MLP"]
        rows["(iv) plain MLP"] = plain
        for covariance in ("diagonal", "full", "lowrank"):
            if covariance not in models:
                numbers = H * (D + 1) ** 2
                rows[
                    f"(i) closed form, full  [skipped: {numbers:.1e} covariance entries, "
                    f"{numbers * 4 * 4 / 1e9:.0f} GB with Adam state]"
                ] = None
                continue
            name = f"(i) closed form, {covariance}"
            rows[name] = (
                core[name] if name in core else median_time(closed_step(models[covariance]), args.repeats, device)
            )
            if covariance == "diagonal":
                rows["(i) closed form, diagonal, reference kernels"] = core[
                    "(i) closed form, diagonal, reference kernels"
                ]
        rows["(ii) local reparameterization, 1 sample"] = core["(ii) local reparameterization, 1 sample"]
        if args.compile:
            compiled_mlp_loss = torch.compile(lambda: (mlp(x).squeeze(-1) - y).pow(2).mean())
            rows["(iv) plain MLP, torch.compile"] = median_time(
                lambda: compiled_mlp_loss().backward(), args.repeats, device
            )
            compiled_model = ClosedFormBNN(D, H).to(device)
            compiled_elbo = torch.compile(lambda: -compiled_model.elbo(x, y, num_data=num_data))
            rows["(i) closed form, diagonal, torch.compile"] = median_time(
                lambda: compiled_elbo().backward(), args.repeats, device
            )
        rows["(iii) Pyro Trace_ELBO + AutoNormal"] = core["(iii) Pyro Trace_ELBO + AutoNormal"]
        print(f"\nD={D}, H={H}: forward+backward per step, ratio to the plain MLP")
        for name, seconds in rows.items():
            if seconds is None:
                print(f"  {name}")
            else:
                print(f"  {name:<55} {seconds * 1e3:9.2f} ms   {seconds / plain:7.2f}x")
        closed = rows["(i) closed form, diagonal"]
        lowrank = rows["(i) closed form, lowrank"]
        print(
            f"  target: diagonal closed form <= 2.5x the plain MLP: {closed / plain:.2f}x "
            f"({'met' if closed <= 2.5 * plain else 'missed'})"
        )
        floor = core["floor"]
        print(
            f"  target: diagonal closed form <= 2.0x the plain MLP: {closed / plain:.2f}x "
            f"({'met' if closed <= 2.0 * plain else 'missed'}); its four matrix products alone take "
            f"{floor / plain:.2f}x the MLP's step, the rest {(closed - floor) / plain:.2f}x"
        )
        print(
            f"  target: faster than local reparameterization ({closed / rows['(ii) local reparameterization, 1 sample']:.2f}x) "
            f"and than Pyro ({closed / rows['(iii) Pyro Trace_ELBO + AutoNormal']:.2f}x): "
            f"{'met' if closed < min(rows['(ii) local reparameterization, 1 sample'], rows['(iii) Pyro Trace_ELBO + AutoNormal']) else 'missed'}"
        )
        reference = rows["(i) closed form, diagonal, reference kernels"]
        report_target(
            f"eager_elbo_operators_over_reference/D={D}",
            closed / reference,
            "<=",
            1,
            "x",
            device,
            label=f"eager closed-form ELBO fwd+bwd, operators' route / reference ops, D={D}/H={H}",
        )
        print(
            f"  target: low rank <= 2x the diagonal: {lowrank / closed:.2f}x ({'met' if lowrank <= 2 * closed else 'missed'}; "
            f"its variance pass alone is N*H*D*r multiply-adds, r={10} times the diagonal's)"
        )

        # gradient variance on one minibatch (diagonal q, the paper's mean field)
        model = ClosedFormBNN(D, H).to(device)
        params = [model.a.loc, model.a.log_scale, model.b.loc, model.b.log_scale]
        draws = max(10, args.variance_draws if D * H < 1e6 else args.variance_draws // 4)
        variance_local = gradient_variance(lambda: -local_reparam_elbo(model, x, y, num_data, sampler), params, draws)

        def sample_a_elbo():
            return -model.elbo(x, y, num_data=num_data, estimator="integrate_output_layer", generator=sampler)

        variance_sample_a = gradient_variance(sample_a_elbo, params, draws)
        variance_closed = gradient_variance(lambda: -model.elbo(x, y, num_data=num_data), params, 5)
        print(f"  gradient variance (mean over all parameters, {draws} draws):")
        print(f"    (ii) local reparameterization     {variance_local:.3e}")
        print(
            f"    sample A, integrate B             {variance_sample_a:.3e}   ({variance_local / max(variance_sample_a, 1e-300):.1f}x lower than (ii))"
        )
        print(f"    (i) closed form                   {variance_closed:.3e}   (deterministic)")


if __name__ == "__main__":
    main()
