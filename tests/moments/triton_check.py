"""The Triton kernels against the independent references, on one device: compiled on CUDA, or on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported, so
test_ops.py runs :func:`triton_errors` in a subprocess for that).

References: scipy quadrature for the ReLU moments (the grid and tolerances of
test_moments_quadrature.py, through test_ops.worst_error), the reference path's analytic
backward in float64 for their gradients, and ``torch.distributions.kl_divergence`` in float64 for
the mean-field KL. :func:`assert_within_tolerances` holds the tolerances both callers assert."""

from __future__ import annotations

import math

import torch
from prediction_check import assert_prediction_tolerances, prediction_errors
from relu_grid import POINTS, _quadrature, worst_error

from cfbnn_cli.moments import elbo_ops, elbo_reference, moment_ops, predict_ops
from cfbnn_cli.moments.operators import OPERATORS
from cfbnn_cli.moments.relu_family import family_moments_vjp, reference_moments


def _relative(got, want):
    """Largest ``|got - want| / max(|want|, 1)`` (want in float64 on the CPU)."""
    return float(((got.cpu().double() - want).abs() / want.abs().clamp_min(1.0)).max())


def _scaled(got, want):
    """Largest ``|got - want|`` over ``max(max |want|, 1)`` (sums that may cancel)."""
    return float((got.cpu().double() - want).abs().max() / want.abs().max().clamp_min(1.0))


def _tail_inputs(dtype, generator):
    """A (37, 150) tail pass: five row blocks of the forward, two column blocks of the backward
    (the last ones partial), means out to |t| = 40 and a zero variance (floored)."""
    mean = torch.randn(37, 150, generator=generator, dtype=torch.float64) * 3
    mean[0, :3] = torch.tensor([40.0, -40.0, 0.0], dtype=torch.float64)
    variance = torch.rand(37, 150, generator=generator, dtype=torch.float64) * 2
    variance[1, 0] = 0.0
    w_phi = torch.randn(150, generator=generator, dtype=torch.float64)
    w_second = torch.rand(150, generator=generator, dtype=torch.float64)
    return [t.to(dtype) for t in (mean, variance, w_phi, w_phi.square(), w_second)]


def tail_errors(device: str, dtype, generator) -> dict:
    """The tail pass's Triton kernels against the float64 reference ops and their autograd, for
    each of the ReLU family (ReLU, leaky ReLU at two slopes, ReLU^2); the worst of them."""
    worst = {"values": 0.0, "grads": 0.0}
    for family in ((0, 0.0), (1, 0.125), (1, -0.5), (2, 0.0)):
        tensors = _tail_inputs(dtype, generator)
        on = [t.to(device) for t in tensors]
        reference = [t.double().clone().requires_grad_() for t in tensors]
        want = elbo_reference.relu_tail(*reference, *family)
        got = elbo_ops.triton_relu_tail(*on, *family)
        rows = [torch.randn(37, generator=generator, dtype=torch.float64) for _ in range(2)]
        torch.autograd.backward(want, rows)
        grads = elbo_ops.triton_relu_tail_backward(*on, *[r.to(dtype).to(device) for r in rows], *family)
        columns = grads[2].cpu()
        worst["values"] = max(worst["values"], *(_scaled(g, w.detach()) for g, w in zip(got, want)))
        worst["grads"] = max(
            worst["grads"],
            _scaled(grads[0], reference[0].grad),
            _scaled(grads[1], reference[1].grad),
            *(_scaled(columns[i], reference[2 + i].grad) for i in range(3)),
        )
    return worst


def _kl64(loc, log_scale, prior_variance):
    q = torch.distributions.Normal(loc.double(), log_scale.double().exp())
    p = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), prior_variance**0.5)
    return torch.distributions.kl_divergence(q, p).sum()


def elbo_step_errors(device: str, dtype, generator) -> dict:
    """The ELBO's first step and its rows on their Triton kernels (``cfbnn::outer_layers_pass``,
    ``cfbnn::normal_elbo_rows``) against float64: every output of the first step against the
    reference kernel's on the same numbers in float64 (``values``; the KL sums table against the
    blocks' own sums), and the ELBO, whose KL the rows finish from that table, with and without a
    further layer's KL, against its definition with ``torch.distributions``' KL (``elbo``). A first
    layer of three blocks (the last one partial), an input of two augmented blocks."""
    x = torch.randn(37, 40, generator=generator, dtype=torch.float64).to(dtype)
    layers = []
    for shape in ((60, 41), (1, 61)):
        loc = torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
        log_scale = (torch.randn(*shape, generator=generator, dtype=torch.float64) * 0.5 - 1.5).to(dtype)
        layers.append((loc, log_scale))
    on = lambda t: t.to(device)  # noqa: E731
    got = OPERATORS["outer_layers_pass"].cuda(*map(on, (x, *layers[0], *layers[1])), True)
    want = elbo_reference.outer_layers_pass(x.double(), *(t.double() for layer in layers for t in layer), True)
    assert [t.dtype for t in got] == [dtype] * 5 + [torch.float64]
    worst = {"values": max(_scaled(g, w) for g, w in zip(got, want)), "elbo": 0.0}
    rows = [torch.randn(37, generator=generator, dtype=torch.float64).to(dtype) for _ in range(3)]
    rows[1] = rows[1].abs()
    output_loc, output_log_scale = layers[1]
    log_precision = torch.tensor(0.4, dtype=dtype)
    operands = (*rows, output_loc, output_log_scale, log_precision)
    kl = _kl64(*layers[0], 0.8) + _kl64(*layers[1], 0.8)
    _, _, ell = elbo_reference.normal_ell_rows(*(t.double() for t in operands), True)
    for extra in (None, torch.tensor(0.75, dtype=dtype)):
        elbo_terms = (got[5], None if extra is None else on(extra), 0.8, 3.0)
        _, _, elbo = OPERATORS["normal_elbo_rows"].cuda(*map(on, operands), *elbo_terms, True)
        reference = 3.0 * ell.sum() - kl - (0.0 if extra is None else 0.75)
        worst["elbo"] = max(worst["elbo"], abs(float(elbo) - float(reference)) / abs(float(reference)))
    return worst


LEAKY_SLOPES = (0.125, -0.5)  # test_moments_quadrature.py's: inside [0, 1] and outside


def leaky_errors(device: str, dtype, generator) -> dict:
    """Leaky ReLU's Triton kernels at two slopes: the values against quadrature on the ReLU grid
    (the tolerances of test_moments_quadrature.py), the gradients against the float64 reference
    ops' autograd."""
    values_worst = grads_worst = 0.0
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    grads = [torch.randn(len(POINTS), generator=generator, dtype=torch.float64).to(dtype) for _ in range(3)]
    positive = std > 0  # (the reference's autograd has no gradient at std = 0)
    for slope in LEAKY_SLOPES:
        references = _quadrature(POINTS, "leaky_relu", negative_slope=slope)
        phi, ups, var = moment_ops.triton_family_moments(mean.to(device), std.to(device), 1, slope, False)
        values_worst = max(values_worst, worst_error([t.cpu() for t in (phi, ups, var)], references, POINTS, dtype))
        m64, s64 = (t.double().clone().requires_grad_() for t in (mean, std))
        want = reference_moments(m64, s64, 1, slope if dtype == torch.float64 else float(torch.tensor(slope)))
        torch.autograd.backward(list(want), [t.double() for t in grads])
        gm, gs = moment_ops.triton_family_moments_backward(
            mean.to(device), std.to(device), phi, *[t.to(device) for t in grads], 1, slope, False
        )
        grads_worst = max(
            grads_worst,
            _relative(gm.cpu()[positive], m64.grad[positive]),
            _relative(gs.cpu()[positive], s64.grad[positive]),
        )
    return {"values": values_worst, "grads": grads_worst}


def relu_squared_errors(device: str, dtype, generator) -> dict:
    """ReLU^2's Triton kernels: the values against quadrature on the ReLU grid (the tolerances of
    test_moments_quadrature.py), the gradients against the float64 reference ops' autograd."""
    mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
    std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
    grads = [torch.randn(len(POINTS), generator=generator, dtype=torch.float64).to(dtype) for _ in range(3)]
    positive = std > 0  # (the reference's autograd has no gradient at std = 0)
    phi, ups, var = moment_ops.triton_family_moments(mean.to(device), std.to(device), 2, 0.0, False)
    values = worst_error([t.cpu() for t in (phi, ups, var)], _quadrature(POINTS, "relu_squared"), POINTS, dtype)
    m64, s64 = (t.double().clone().requires_grad_() for t in (mean, std))
    torch.autograd.backward(list(reference_moments(m64, s64, 2)), [t.double() for t in grads])
    gm, gs = moment_ops.triton_family_moments_backward(
        mean.to(device), std.to(device), phi, *[t.to(device) for t in grads], 2, 0.0, False
    )
    grads_worst = max(
        _relative(gm.cpu()[positive], m64.grad[positive]), _relative(gs.cpu()[positive], s64.grad[positive])
    )
    return {"values": values, "grads": grads_worst}


def _on(kernel, device: str):
    """``kernel`` taking its tensor, the first argument, to ``device``."""
    return lambda tensor, *numbers: kernel(tensor.to(device), *numbers)


def _relu_gradients(mean64, std64, grads64):
    """ReLU's reference backward in float64: the heat-equation identities of
    :func:`~cfbnn_cli.moments.relu_family.family_moments_vjp` (the backward operator's formula)."""
    phi = reference_moments(mean64, std64, 0)[0]
    return family_moments_vjp(mean64, std64, phi, *grads64, 0, 0.0, False)


def triton_errors(device: str, dtypes=("float64", "float32")) -> dict:
    """Errors of every Triton kernel launched on ``device``, in the units the tolerances use
    (of the ``dtypes`` named: each one's checks are independent of the other's)."""
    references = _quadrature(POINTS)
    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        mean = torch.tensor([p[0] for p in POINTS], dtype=dtype)
        std = torch.tensor([p[1] for p in POINTS], dtype=dtype)
        on = lambda t: t.to(device)  # noqa: E731
        phi, ups, var = moment_ops.triton_family_moments(on(mean), on(std), 0, 0.0, False)
        assert phi.dtype == dtype and phi.device.type == torch.device(device).type
        values = [t.cpu() for t in (phi, ups, var)]
        # the backward against the reference path's analytic backward (float64 oracle)
        g = torch.Generator().manual_seed(3)
        grads = [torch.randn(len(POINTS), generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
        want_mean, want_std = _relu_gradients(mean.double(), std.double(), [t.double() for t in grads])
        gm, gs = moment_ops.triton_family_moments_backward(on(mean), on(std), phi, *map(on, grads), 0, 0.0, False)
        out[name] = {
            "values": worst_error(values, references, POINTS, dtype),
            "grads": max(_relative(gm, want_mean), _relative(gs, want_std)),
        }
        # from the variances: the same references; the gradients where std > 0 (at 0 sqrt has none)
        variance = std.double().square().to(dtype)
        values = [t.cpu() for t in moment_ops.triton_family_moments(on(mean), on(variance), 0, 0.0, True)]
        positive = std > 0
        root = variance.double().sqrt()
        want_mean, want_std = _relu_gradients(mean.double(), root, [t.double() for t in grads])
        want_variance = want_std / (2.0 * root)  # d std / d variance
        gm, gv = moment_ops.triton_family_moments_backward(
            on(mean), on(variance), on(values[0]), *map(on, grads), 0, 0.0, True
        )
        keep = [i for i, p in enumerate(POINTS) if p[1] > 0]  # (a variance of 0 is floored)
        out[name + "_from_variance"] = {
            "values": worst_error(
                [v[keep] for v in values], [references[i] for i in keep], [POINTS[i] for i in keep], dtype
            ),
            "grads": max(
                _relative(gm.cpu()[positive], want_mean[positive]),
                _relative(gv.cpu()[positive], want_variance[positive]),
            ),
        }
        # the KL of a mean-field matrix (3 x 1500: two blocks, the last one partial)
        loc = torch.randn(3, 1500, generator=g, dtype=torch.float64).to(dtype)
        log_scale = (torch.randn(3, 1500, generator=g, dtype=torch.float64) - 2).to(dtype)
        l64, s64 = loc.double().clone().requires_grad_(), log_scale.double().clone().requires_grad_()
        q = torch.distributions.Normal(l64, s64.exp())
        p = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), 0.8**0.5)
        reference = torch.distributions.kl_divergence(q, p).sum()
        reference.backward()
        kl = elbo_ops.triton_diagonal_kl(on(loc), on(log_scale), 0.8)
        gl, gs = elbo_ops.triton_diagonal_kl_backward(on(loc), on(log_scale), on(torch.tensor(1.0, dtype=dtype)), 0.8)
        out[name + "_kl"] = {
            "value": abs(float(kl) - float(reference.detach())) / abs(float(reference.detach())),
            "grads": max(_relative(gl, l64.grad), _relative(gs, s64.grad)),
        }
        # ReLU's mean alone (cfbnn::relu_mean) against the same quadrature
        phi_alone = moment_ops.triton_relu_mean(on(mean), on(std)).cpu()
        out[name + "_mean"] = {"values": worst_error([phi_alone], references, POINTS, dtype)}
        out[name + "_tail"] = tail_errors(device, dtype, g)
        out[name + "_elbo_steps"] = elbo_step_errors(device, dtype, g)
        out[name + "_leaky"] = leaky_errors(device, dtype, g)
        out[name + "_relu_squared"] = relu_squared_errors(device, dtype, g)
        # the prediction's two passes (cfbnn::prediction_operand, cfbnn::prediction_hidden_mean)
        kernels = (predict_ops.triton_prediction_operand, predict_ops.triton_prediction_hidden_mean)
        out[name + "_prediction"] = prediction_errors(*(_on(kernel, device) for kernel in kernels), dtype, g)
    return out


def assert_within_tolerances(errors: dict) -> None:
    """The tolerances of the CPU kernels (test_ops.test_cpu_operator_matches_quadrature and
    test_cpu_diagonal_kl_matches_torch_distributions)."""
    for name in (
        "float64",
        "float32",
        "float64_from_variance",
        "float32_from_variance",
        "float64_mean",
        "float32_mean",
    ):
        assert errors[name]["values"] <= 1.0, (name, errors)
    for name, tolerance in (("float64", 1e-10), ("float32", 1e-5)):
        assert errors[name]["grads"] < tolerance, (name, errors)
        assert errors[name + "_from_variance"]["grads"] < tolerance, (name, errors)
    assert errors["float64_kl"]["value"] < 1e-12 and errors["float64_kl"]["grads"] < 1e-12, errors
    assert errors["float32_kl"]["value"] < 1e-5 and errors["float32_kl"]["grads"] < 1e-5, errors
    for name, tolerance in (("float64_tail", 1e-10), ("float32_tail", 1e-5)):
        assert errors[name]["values"] < tolerance and errors[name]["grads"] < tolerance, (name, errors)
    for name, tolerance in (("float64_elbo_steps", 1e-12), ("float32_elbo_steps", 1e-6)):
        assert errors[name]["values"] < tolerance and errors[name]["elbo"] < tolerance, (name, errors)
    for kind in ("leaky", "relu_squared"):
        for name, tolerance in ((f"float64_{kind}", 1e-10), (f"float32_{kind}", 1e-5)):
            assert errors[name]["values"] <= 1.0 and errors[name]["grads"] < tolerance, (name, errors)
    for name in ("float64", "float32"):
        assert_prediction_tolerances(errors[name + "_prediction"], getattr(torch, name))
    assert all(math.isfinite(v) for d in errors.values() for v in d.values()), errors
