"""Moments of a Normal variable restricted to a half line.

Everything in this module is about a scalar ``z ~ N(mean, std**2)`` applied
elementwise with broadcasting. The paper's appendix reduces every expectation of
a piecewise-polynomial activation to two families of one-dimensional integrals:

* ``positive_part_moments``: ``M_k = E[z**k * 1{z > 0}]`` for ``k = 0..order``
  (the errata's truncated moments, ``M_k = mean*M_{k-1} + (k-1)*std**2*M_{k-2}``);
* ``abs_moment``: ``A_n = E[z**n * |z|]`` (the paper's Omega, Psi, zeta, rho, eqs. (18),
  (19), (33), (34), are ``n = 0, 1, 2, 3``; all orders via the errata's polynomials P and Q).

Numerics (see ``paper/ERRATA.md``, section "Numerics"). With ``t = mean/std``:

* ``t >= 0``: the forward recursion only adds positive numbers.
* ``t < 0``: the recursion subtracts nearly equal numbers (the relative error grows
  like ``t**(2k)/k!``). Far in the tail we instead write
  ``M_k = Phi_N(t) * prod_{j<=k} std * r_j(-t)`` where ``r_j = J_j / J_{j-1}`` are
  ratios of the upper-tail integrals ``J_j(x) = int_0^inf u^j exp(-x u - u^2/2) du``.
  They satisfy ``r_j = j / (x + r_{j+1})``, a continued fraction with only positive
  terms, evaluated backwards from a depth where the tail estimate no longer matters
  (Miller's algorithm). The product is formed in log space so that a Phi_N(t) that
  underflows does not take a representable ``M_k`` with it.
* float32 inputs use float32 where the recursion is well conditioned (``t >= -1``)
  and float64 on the (usually small) remaining subset.
* ``std == 0`` is the deterministic limit (``M_k = mean**k * 1{mean > 0}``,
  ``M_0 = 1/2`` at ``mean == 0``, the limit from ``std -> 0``).

Gradients use the identities ``dM_k/dmean = k M_{k-1}`` and, since the Normal
density solves the heat equation, ``dM_k/dstd = std * d^2 M_k / dmean^2 =
std k (k-1) M_{k-2}`` -- so the backward pass never differentiates through the
continued fraction, stays finite at ``std = 0`` and is itself differentiable.
"""

from __future__ import annotations

import contextlib
import math
from typing import Tuple

import torch

__all__ = [
    "abs_moment",
    "positive_part_moment",
    "positive_part_moments",
    "normal_raw_moment",
    "standard_normal_pdf",
    "standard_normal_cdf",
    "set_validate_args",
    "validate_args",
    "validating_args",
    "check_mean_std",
    "standardize",
    "is_transformed",
    "block_size",
    "T_MAX",
    "INV_SQRT_2",
]

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
# Standardized distances are clamped here: far beyond every tail that is
# representable (exp(-t^2/2) == 0 in float64), yet finite so that 0 * t stays 0
# in backward passes and t^2 does not overflow float32.
T_MAX = 1e4

# Where the forward recursion hands over to the continued fraction (the depths
# are in _CF_BANDS_F64). Chosen from a comparison with 50-digit quadrature:
# relative error <= 2e-11 for orders <= 8 on either side of the switch.
_RECURSION_LIMIT_F64 = 2.0
_RECURSION_LIMIT_F32 = 1.0
_F64_RECURSION_MAX_ORDER_FOR_F32 = 4

_VALIDATE_ARGS = True


def set_validate_args(value: bool) -> None:
    """Turn the (cheap but synchronizing) input checks on or off globally.

    Like ``torch.distributions.Distribution.set_default_validate_args``: checks are
    on by default; a training loop that has already validated its inputs can turn
    them off to avoid a host/device synchronization per call.
    """
    global _VALIDATE_ARGS
    _VALIDATE_ARGS = bool(value)


def validating_args() -> bool:
    """Whether the synchronizing input checks are on (see :func:`set_validate_args`)."""
    return _VALIDATE_ARGS


@contextlib.contextmanager
def validate_args(value: bool):
    """``with validate_args(False): ...`` -- :func:`set_validate_args` for a block, restored after."""
    previous = _VALIDATE_ARGS
    set_validate_args(value)
    try:
        yield
    finally:
        set_validate_args(previous)


def is_transformed(x: torch.Tensor) -> bool:
    """True inside torch.func transforms (vmap/grad), where data-dependent checks fail."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the functorch query; compiled code skips the checks
        return False
    try:
        if not torch._C._are_functorch_transforms_active():  # (the cheap global test first)
            return False
        return torch._C._functorch.maybe_get_level(x) != -1
    except AttributeError:  # pragma: no cover - very old torch
        return False


def _any_negative(x: torch.Tensor) -> bool:
    """``bool((x < 0).any())``: for float32/float64 one pass of ``cfbnn::count_negative`` (the C++
    kernel on the CPU), without the boolean temporary."""
    if x.dtype in (torch.float32, torch.float64):
        return torch.ops.cfbnn.count_negative(x) > 0
    return bool((x < 0).any())


def _assert_none_negative_compiled(std: torch.Tensor, std_name: str) -> None:
    """Inside ``torch.compile``, :func:`check_mean_std`'s sign check as a graph op: reading the
    answer back (``bool(...)``) would break the graph. On the CPU an assertion in the graph (a
    ``RuntimeError`` when it fails); on a GPU nothing (a device-side assertion would end the
    process's CUDA context; the eager calls check)."""
    if std.device.type == "cpu":
        torch._assert_async(~(std < 0).any(), f"`{std_name}` must be >= 0 (a standard deviation)")


def check_mean_std(mean, std, *, names: Tuple[str, str] = ("mean", "std")) -> Tuple[torch.Tensor, torch.Tensor]:
    """Convert ``mean`` and ``std`` to floating tensors of one dtype and device.

    Raises ``ValueError`` naming the argument when a value is negative or the two
    cannot be broadcast together. Returns the two tensors (not yet broadcast).
    """
    mean_name, std_name = names
    if not isinstance(mean, torch.Tensor):
        mean = torch.as_tensor(
            mean, dtype=std.dtype if isinstance(std, torch.Tensor) and std.is_floating_point() else None
        )
    if not isinstance(std, torch.Tensor):
        std = torch.as_tensor(std, dtype=mean.dtype if mean.is_floating_point() else None, device=mean.device)
    dtype = torch.promote_types(mean.dtype, std.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if mean.device != std.device and mean.dim() > 0 and std.dim() > 0:
        raise ValueError(
            f"`{mean_name}` is on {mean.device} but `{std_name}` is on {std.device}; move both to one device"
        )
    device = mean.device if mean.dim() > 0 or std.dim() == 0 else std.device
    if mean.dtype != dtype or mean.device != device:
        mean = mean.to(dtype=dtype, device=device)
    if std.dtype != dtype or std.device != device:
        std = std.to(dtype=dtype, device=device)
    try:
        if mean.shape != std.shape:  # (torch.broadcast_shapes costs ~15 us: skip it when trivial)
            torch.broadcast_shapes(mean.shape, std.shape)
    except RuntimeError:
        raise ValueError(
            f"`{mean_name}` has shape {tuple(mean.shape)} and `{std_name}` has shape {tuple(std.shape)}, "
            "which cannot be broadcast together"
        ) from None
    # (not while a CUDA graph records: reading a value waits for the GPU, which a capture forbids;
    # the eager warm-up before every capture checked the same shapes)
    if _VALIDATE_ARGS and not is_transformed(std) and std.numel() > 0 and not _capturing(std):
        if torch.compiler.is_compiling():
            _assert_none_negative_compiled(std, std_name)
        elif _any_negative(std):
            bad = float(std.detach().min())
            raise ValueError(f"`{std_name}` must be >= 0 (a standard deviation); got a value {bad!r}")
    return mean, std


def standard_normal_cdf(t: torch.Tensor) -> torch.Tensor:
    """Phi_N(t) = erfc(-t/sqrt 2)/2, accurate relative to its value in the lower tail.

    ``torch.special.ndtr`` is computed as ``(1 + erf)/2`` and loses every digit below
    t ~ -8 (float64) or t ~ -5 (float32); erfc does not.
    """
    return 0.5 * torch.special.erfc(t * -INV_SQRT_2)


def standard_normal_pdf(t: torch.Tensor) -> torch.Tensor:
    """phi(t) = exp(-t^2/2) / sqrt(2 pi)."""
    return torch.exp(-0.5 * t * t) * _INV_SQRT_2PI


def standardize(mean: torch.Tensor, std: torch.Tensor):
    """t = mean/std, clamped to +-T_MAX, with the std == 0 limit; safe to differentiate.

    Where ``|mean| >= T_MAX * std`` (std == 0 included) t is the constant
    ``sign(mean) * T_MAX`` and the division is done on a dummy denominator, so the
    unselected branch has no ``1/std^2`` that could turn a zero gradient into NaN.
    Beyond ``|t| = T_MAX`` every Gaussian factor is exactly 0 (or 1) in float64.
    Returns ``(t, std_safe, positive)`` with ``std_safe`` = std where std > 0, else 1.
    """
    positive = std > 0
    std_safe = torch.where(positive, std, torch.ones_like(std))
    far = mean.abs() >= T_MAX * std
    denominator = torch.where(far, torch.ones_like(std), std_safe)
    t = torch.where(far, torch.sign(mean) * T_MAX, mean / denominator)
    return t, std_safe, positive


def _recursion(mean, std, t, order):
    """Forward recursion M_k = mean M_{k-1} + (k-1) std^2 M_{k-2} (stable for t >= 0)."""
    m0 = standard_normal_cdf(t)
    moments = [m0]
    if order >= 1:
        moments.append(mean * m0 + std * standard_normal_pdf(t))
    var = std * std
    for k in range(2, order + 1):
        moments.append(mean * moments[k - 1] + (k - 1) * var * moments[k - 2])
    return torch.stack(moments, dim=-1)


def _continued_fraction(std, t, order, extra_depth):
    """M_k = Phi_N(t) prod_{j<=k} std r_j(-t) for t < 0, cancellation free."""
    x = -t
    depth = order + extra_depth
    # Tail start: the fixed point of r = (depth+1)/(x + r); its error is damped by
    # every level of the backward recursion.
    ratio = 0.5 * (torch.sqrt(x * x + 4.0 * (depth + 1)) - x)
    ratios = [None] * (order + 1)
    for j in range(depth, 0, -1):
        ratio = j / (x + ratio)
        if j <= order:
            ratios[j] = ratio
    log_moment = torch.special.log_ndtr(t)
    moments = [torch.exp(log_moment)]
    for j in range(1, order + 1):
        log_moment = log_moment + torch.log(std * ratios[j])
        moments.append(torch.exp(log_moment))
    return torch.stack(moments, dim=-1)


# (lower edge of x = -t, extra continued-fraction depth): the depth that reaches
# ~1e-15 relative accuracy for orders <= 9 from that edge on (50-digit check).
_CF_BANDS_F64 = ((_RECURSION_LIMIT_F64, 80), (3.0, 64), (4.5, 40), (8.0, 24))


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s work is being recorded into a CUDA graph: no branch on its values
    then (reading one waits for the GPU, which a capture forbids)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _positive_part_moments_f64(mean, std, order):
    t, _, _ = standardize(mean, std)
    out = _recursion(mean, std, t, order)
    edges = [edge for edge, _ in _CF_BANDS_F64[1:]] + [math.inf]
    branchless = _capturing(mean)
    for (lower, depth), upper in zip(_CF_BANDS_F64, edges):
        band = (t < -lower) & (t >= -upper)
        if branchless:  # the same elementwise values, computed everywhere (t kept in the band) and selected
            inside = torch.where(band, t, torch.full_like(t, -lower))
            out = torch.where(band.unsqueeze(-1), _continued_fraction(std, inside, order, depth), out)
        elif bool(band.any()):
            out[band] = _continued_fraction(std[band], t[band], order, depth)
    return out


_CPU_BLOCK = 1 << 16  # elements per block on CPU: the temporaries of one block stay in cache
_DEVICE_BLOCK = 1 << 24  # on an accelerator one kernel per op is what is fast; this only bounds the temporaries


def block_size(tensor: torch.Tensor) -> int:
    """Elements per block of the elementwise moment kernels on ``tensor``'s device.

    Small blocks win on CPU (cache); on CUDA every block costs a kernel launch per
    op, so blocks there are as large as memory allows (measured on an H200: 65k-element
    blocks made the ReLU moments 300x slower than one launch per op).
    """
    return _CPU_BLOCK if tensor.device.type == "cpu" else _DEVICE_BLOCK


def positive_part_moments_forward(mean: torch.Tensor, std: torch.Tensor, order: int) -> torch.Tensor:
    """``cfbnn::positive_part_moments``' reference kernel: ``mean``, ``std`` of one shape."""
    mean, std = torch.broadcast_tensors(mean, std)
    chunk = block_size(mean)
    if mean.numel() <= chunk:
        return _positive_part_moments_block(mean, std, order)
    flat_mean = mean.reshape(-1)
    flat_std = std.reshape(-1)
    out = torch.empty(flat_mean.shape + (order + 1,), dtype=mean.dtype, device=mean.device)
    for start in range(0, flat_mean.numel(), chunk):
        block = slice(start, start + chunk)
        out[block] = _positive_part_moments_block(flat_mean[block], flat_std[block], order)
    return out.reshape(mean.shape + (order + 1,))


def _positive_part_moments_block(mean: torch.Tensor, std: torch.Tensor, order: int) -> torch.Tensor:
    dtype = mean.dtype
    if dtype == torch.float64:
        return _positive_part_moments_f64(mean, std, order)
    work_mean = mean.float()
    work_std = std.float()
    t, _, _ = standardize(work_mean, work_std)
    out = _recursion(work_mean, work_std, t, order)
    tail = t < -_RECURSION_LIMIT_F32
    branchless = _capturing(mean)
    if branchless or bool(tail.any()):
        # inside a CUDA graph: every element through the tail's formulas, then selected
        tail_mean = (work_mean if branchless else work_mean[tail]).double()
        tail_std = (work_std if branchless else work_std[tail]).double()
        if order <= _F64_RECURSION_MAX_ORDER_FOR_F32:
            # The float64 recursion loses ~x^(2k)/k! ulps: < 1e-6 relative for k <= 4
            # out to x = 25, beyond which no float32 result is representable.
            tail_t, _, _ = standardize(tail_mean, tail_std)
            tail_out = _recursion(tail_mean, tail_std, tail_t, order)
        else:
            tail_out = _positive_part_moments_f64(tail_mean, tail_std, order)
        if branchless:
            out = torch.where(tail.unsqueeze(-1), tail_out.float(), out)
        else:
            out[tail] = tail_out.float()
    return out.to(dtype)


def positive_part_moments_vjp(mean, std, moments, grad_output, order: int):
    """``cfbnn::positive_part_moments``' gradients from its output ``moments``: ``dM_k/dmean = k M_{k-1}``
    and, since the Normal density solves the heat equation, ``dM_k/dstd = std k (k-1) M_{k-2}``, with
    the density at 0 for ``k = 0`` (the backward never differentiates through the continued fraction;
    it stays finite at ``std = 0`` and is itself differentiable)."""
    t, std_safe, positive = standardize(mean, std)
    phi_t = standard_normal_pdf(t)
    # Density of z at 0 (a delta at mean == 0 when std == 0; we return 0 there).
    density_at_zero = torch.where(positive, phi_t / std_safe, torch.zeros_like(phi_t))
    grad_mean = grad_output[..., 0] * density_at_zero
    grad_std = grad_output[..., 0] * (-t * density_at_zero)
    if order >= 1:
        grad_mean = grad_mean + grad_output[..., 1] * moments[..., 0]
        grad_std = grad_std + grad_output[..., 1] * phi_t
    for k in range(2, order + 1):
        grad_mean = grad_mean + grad_output[..., k] * (k * moments[..., k - 1])
        grad_std = grad_std + grad_output[..., k] * ((k * (k - 1)) * std * moments[..., k - 2])
    return grad_mean, grad_std


def _check_order(order, name="order") -> int:
    if isinstance(order, bool) or not isinstance(order, int) or order < 0:
        raise ValueError(f"`{name}` must be an integer >= 0; got {order!r}")
    return order


def positive_part_moments(order: int, mean, std) -> torch.Tensor:
    """``E[z^k 1{z>0}]`` for ``k = 0..order``, stacked along a new last dimension.

    ``z ~ N(mean, std^2)`` elementwise; ``mean`` and ``std`` broadcast. This is the
    errata's ``M_k`` (``M_0 = Phi_N(t)``, ``M_1 = mean Phi_N(t) + std phi(t)``) computed
    without cancellation for every ``t = mean/std`` (see the module docstring).
    Differentiable in both arguments (also twice) and usable under ``torch.func``: the operator
    ``cfbnn::positive_part_moments`` (:mod:`.moment_ops`).
    """
    _check_order(order)
    mean, std = check_mean_std(mean, std)
    return torch.ops.cfbnn.positive_part_moments(*torch.broadcast_tensors(mean, std), order)


def positive_part_moment(n: int, mean, std) -> torch.Tensor:
    """``E[z^n 1{z>0}]`` for ``z ~ N(mean, std^2)``: the truncated moment ``M_n``."""
    return positive_part_moments(n, mean, std)[..., n]


def _errata_polynomials(degree: int):
    """Coefficients (ascending powers of t) of the errata's P_degree and Q_degree.

    P_0 = 1, P_1 = t, P_{m+1} = t P_m + m P_{m-1}; Q_0 = 0, Q_1 = 1, same recursion,
    so that A_n = std^{n+1} [P_{n+1}(t) erf(t/sqrt 2) + sqrt(2/pi) Q_{n+1}(t) exp(-t^2/2)].
    All coefficients are non-negative and each polynomial has only even or only odd
    powers: evaluating them never cancels.
    """
    p_prev, p = [1], [0, 1]
    q_prev, q = [0], [1]
    if degree == 0:
        return p_prev, q_prev
    for m in range(1, degree):
        p_prev, p = p, _poly_add(_poly_shift(p), [m * c for c in p_prev])
        q_prev, q = q, _poly_add(_poly_shift(q), [m * c for c in q_prev])
    return p, q


def _poly_shift(coefficients):
    return [0] + list(coefficients)


def _poly_add(a, b):
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _homogeneous(coefficients, mean, std, degree):
    """sum_j c_j mean^j std^(degree - j) = std^degree * poly(mean/std), without dividing."""
    total = None
    for power, c in enumerate(coefficients):
        if c == 0:
            continue
        term = c * mean.pow(power) * std.pow(degree - power)
        total = term if total is None else total + term
    if total is None:
        return torch.zeros_like(mean)
    return total


def abs_moment(n: int, mean, std) -> torch.Tensor:
    """``E[z^n |z|]`` for ``z ~ N(mean, std^2)`` and any integer ``n >= 0``.

    ``n = 0, 1, 2, 3`` are the paper's Omega, Psi, zeta and rho (eqs. (18), (19), (33), (34);
    rho with the corrected coefficient 5, not 7: errata 1). General ``n`` uses the
    errata's closed form ``A_n = std^{n+1} [P_{n+1}(t) erf(t/sqrt2) +
    sqrt(2/pi) Q_{n+1}(t) exp(-t^2/2)]``, written as homogeneous polynomials in
    ``(mean, std)`` so that ``std -> 0`` needs no division; every term has the sign of
    the result, so nothing cancels for any ``t``.
    """
    _check_order(n, "n")
    mean, std = check_mean_std(mean, std)
    mean, std = torch.broadcast_tensors(mean, std)
    p_coefficients, q_coefficients = _errata_polynomials(n + 1)
    t, _, _ = standardize(mean, std)
    erf_term = torch.special.erf(t * INV_SQRT_2)
    gauss_term = torch.exp(-0.5 * t * t)
    p_value = _homogeneous(p_coefficients, mean, std, n + 1)
    q_value = _homogeneous(q_coefficients, mean, std, n)
    return p_value * erf_term + _SQRT_2_OVER_PI * std * q_value * gauss_term


def normal_raw_moment(n: int, mean, std) -> torch.Tensor:
    """``E[z^n]`` for ``z ~ N(mean, std^2)``: sum_j C(n, 2j) mean^{n-2j} std^{2j} (2j-1)!!."""
    _check_order(n, "n")
    mean, std = check_mean_std(mean, std)
    mean, std = torch.broadcast_tensors(mean, std)
    total = torch.zeros_like(mean)
    double_factorial = 1
    for j in range(0, n // 2 + 1):
        if j > 0:
            double_factorial *= 2 * j - 1
        total = total + math.comb(n, 2 * j) * double_factorial * mean.pow(n - 2 * j) * std.pow(2 * j)
    return total
