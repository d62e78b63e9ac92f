"""Triton kernels of the activation moments: the CUDA side of the ``cfbnn::`` operators.

Numerics are those of the reference path (:func:`cfbnn_cli.moments.relu_reference.relu_forward_block`),
computed in float64 whatever the input dtype (as the reference does for float32):

* with ``x = |mean|/std`` the Normal mass on the far side of 0 is the *small tail*
  ``s_0 = Phi_N(-x)``, ``s_1 = phi(x) - x s_0``, ``s_2 = s_0 - x s_1`` (``std`` units);
* for ``x < 2`` from ``erf`` (``1 - erf`` keeps >= 14 digits there) and that recursion;
* for ``x >= 2`` from the Mills-ratio continued fraction (``paper/ERRATA.md``, "Numerics";
  :func:`cfbnn_cli.moments.gaussian._continued_fraction`): ``r_j = j/(x + r_{j+1})``
  evaluated backwards from depth ``CF_DEPTH`` (Miller's algorithm), then
  ``s_0 = phi(x)/(x + r_1)``, ``s_1 = s_0 r_1``, ``s_2 = s_1 r_2`` -- only positive terms,
  no cancellation, and only ``exp`` (which the Triton interpreter has on the CPU, so CI tests
  these very kernels with ``TRITON_INTERPRET=1``).

Every element takes both branches and selects (no divergence; a depth of 80 divisions
costs less than the memory traffic of one more pass).
"""

import math

import triton
import triton.language as tl

T_MAX = 1e4  # gaussian.T_MAX: beyond, every Gaussian factor is 0 in float64
TINY = 2.2250738585072014e-308
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
CF_SWITCH = 2.0  # gaussian._RECURSION_LIMIT_F64
CF_DEPTH = 80  # gaussian._CF_BANDS_F64's depth from x = 2 on: ~1e-15 relative (50-digit check)
# for float32 results: from x = 2 on, depth 24 is within 4e-10 of the Mills ratio (against
# scipy's erfc), far inside float32's rounding; a third of the divisions, done in float32
CF_DEPTH_F32 = 24
BLOCK = 1024


# Clamps that keep a NaN: tl.maximum / tl.minimum compile to IEEE maxNum / minNum on a GPU, which
# return the other operand for a NaN (the interpreter's numpy propagates it), so a NaN mean or
# standard deviation would leave finite moments; these selects give NaN on every device.
@triton.jit
def at_least(value, bound):
    return tl.where(value < bound, bound, value)


@triton.jit
def at_most(value, bound):
    return tl.where(value > bound, bound, value)


@triton.jit
def small_tail_orders(mean, std, CF_DEPTH: tl.constexpr, ORDER4: tl.constexpr):
    """``(x, pdf, s0, s1, s2, s3, s4)`` in float64 for float64 ``mean``, ``std`` (``std >= 0``);
    ``s3``, ``s4`` (``s_k = (k - 1) s_{k-2} - x s_{k-1}``; far out ``s_k = s_{k-1} r_k``) only
    with ``ORDER4`` (ReLU^2), else zeros."""
    x = at_most(tl.abs(mean) / at_least(std, 2.2250738585072014e-308), 1e4)
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    # near 0: erf and the recursion
    near_s0 = 0.5 * (1.0 - tl.math.erf(x * 0.7071067811865476))
    near_s1 = pdf - x * near_s0
    near_s2 = near_s0 - x * near_s1
    # far: the continued fraction, x kept >= 2 so that the unselected lanes stay finite
    xf = at_least(x, 2.0)
    # for float32 results (a depth of at most 32: CF_DEPTH_F32) the divisions run in float32: the
    # fraction has only positive terms, so its rounding stays a few float32 ulps
    if CF_DEPTH <= 32:
        xc = xf.to(tl.float32)
    else:
        xc = xf
    r = 0.5 * (tl.sqrt(xc * xc + 4.0 * (CF_DEPTH + 1)) - xc)
    r2 = r
    r3 = r
    r4 = r
    for j in tl.static_range(CF_DEPTH, 0, -1):
        r = j / (xc + r)
        if j == 2:
            r2 = r
        if j == 3:
            r3 = r
        if j == 4:
            r4 = r
    r = r.to(tl.float64)
    r2 = r2.to(tl.float64)
    far_s0 = tl.exp(-0.5 * xf * xf) * 0.3989422804014327 / (xf + r)
    far_s1 = far_s0 * r
    far_s2 = far_s1 * r2
    far = x >= 2.0
    s0 = tl.where(far, far_s0, near_s0)
    s1 = tl.where(far, far_s1, near_s1)
    s2 = tl.where(far, far_s2, near_s2)
    if ORDER4:
        near_s3 = 2.0 * near_s1 - x * near_s2
        near_s4 = 3.0 * near_s2 - x * near_s3
        far_s3 = far_s2 * r3.to(tl.float64)
        far_s4 = far_s3 * r4.to(tl.float64)
        s3 = tl.where(far, far_s3, near_s3)
        s4 = tl.where(far, far_s4, near_s4)
    else:
        s3 = tl.zeros_like(s2)
        s4 = tl.zeros_like(s2)
    return x, pdf, s0, s1, s2, s3, s4


@triton.jit
def small_tail(mean, std, CF_DEPTH: tl.constexpr):
    """``(x, pdf, s0, s1, s2)`` in float64 for float64 ``mean``, ``std`` (``std >= 0``)."""
    x, pdf, s0, s1, s2, _, _ = small_tail_orders(mean, std, CF_DEPTH, False)
    return x, pdf, s0, s1, s2


@triton.jit
def relu_from_tail(mean, std, x, s1, s2):
    """``(Phi, Upsilon, Var)`` of ``relu(z)``, ``z ~ N(mean, std^2)``, float64, from the small tail
    (paper eq. (20), the cancellation-free form of ``relu_reference.relu_forward_block``)."""
    upper = mean >= 0.0
    phi = at_least(mean, 0.0) + std * s1
    # the bracket of Var / std^2: above 0, 1 - s2 - 2 x s1 - s1^2 (>= 0.34); below, s2 - s1^2
    bracket = tl.where(upper, 1.0 - s2 - 2.0 * x * s1 - s1 * s1, s2 - s1 * s1)
    var = at_least(std * std * bracket, 0.0)
    return phi, var + phi * phi, var


@triton.jit
def relu_core(mean, std, CF_DEPTH: tl.constexpr):
    """:func:`relu_from_tail` with the small tail computed here."""
    x, pdf, s0, s1, s2 = small_tail(mean, std, CF_DEPTH)
    return relu_from_tail(mean, std, x, s1, s2)


@triton.jit
def relu_vjp_from_tail(mean, std, phi, pdf, s0, g_phi, g_ups, g_var):
    """``(d mean, d std)``: the vector-Jacobian product of :func:`relu_from_tail` (heat-equation
    identities): ``dPhi/dmean = Phi_N(t)``, ``dPhi/dstd = phi(t)``, ``dUps/dmean = 2 Phi``,
    ``dUps/dstd = 2 std Phi_N(t)``, ``dVar = dUps - 2 Phi dPhi`` (as
    ``relu_reference.ReLUMomentsReference``)."""
    upper = mean >= 0.0
    cdf = tl.where(upper, 1.0 - s0, s0)  # Phi_N(t)
    cdf_neg = tl.where(upper, s0, 1.0 - s0)  # Phi_N(-t), without 1 - cdf's cancellation
    twice_phi = 2.0 * phi
    g_mean = g_phi * cdf + twice_phi * (g_ups + g_var * cdf_neg)
    g_std = g_phi * pdf + 2.0 * std * cdf * (g_ups + g_var) - twice_phi * pdf * g_var
    return g_mean, g_std


@triton.jit
def relu_vjp(mean, std, phi, g_phi, g_ups, g_var, CF_DEPTH: tl.constexpr):
    """:func:`relu_vjp_from_tail` with the Gaussian factors recomputed here."""
    x, pdf, s0, s1, s2 = small_tail(mean, std, CF_DEPTH)
    return relu_vjp_from_tail(mean, std, phi, pdf, s0, g_phi, g_ups, g_var)


@triton.jit
def block_operands(mean_ptr, spread_ptr, n, BLOCK: tl.constexpr):
    """This program's block of an elementwise kernel: ``(offsets, inside, mean as stored, mean and
    spread in float64)``; lanes past ``n`` read a mean of 0 and a spread of 1 (finite arithmetic)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    m_in = tl.load(mean_ptr + offsets, mask=inside, other=0.0)
    spread = tl.load(spread_ptr + offsets, mask=inside, other=1.0).to(tl.float64)
    return offsets, inside, m_in, m_in.to(tl.float64), spread


@triton.jit
def output_gradients(g_phi_ptr, g_ups_ptr, g_var_ptr, offsets, inside):
    """The block's gradients of ``(Phi, Upsilon, Var)``, float64."""
    g_phi = tl.load(g_phi_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_ups = tl.load(g_ups_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_var = tl.load(g_var_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    return g_phi, g_ups, g_var


@triton.jit
def relu_moments_kernel(
    mean_ptr,
    spread_ptr,
    phi_ptr,
    ups_ptr,
    var_ptr,
    n,
    FROM_VARIANCE: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    CF_DEPTH: tl.constexpr,
):
    """``(Phi, Upsilon, Var)`` of ``relu(z)`` elementwise (:func:`relu_core`); ``spread`` is the
    standard deviation, or with ``FROM_VARIANCE`` the variance (the square root taken here, the
    variance kept at or above ``FLOOR``, the dtype's smallest normal number, as the CPU kernel
    ``hidden_pass`` does)."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, spread_ptr, n, BLOCK)
    if FROM_VARIANCE:
        std = tl.sqrt(at_least(std, FLOOR))
    phi, ups, var = relu_core(mean, std, CF_DEPTH)
    tl.store(phi_ptr + offsets, phi.to(m_in.dtype), mask=inside)
    tl.store(ups_ptr + offsets, ups.to(m_in.dtype), mask=inside)
    tl.store(var_ptr + offsets, var.to(m_in.dtype), mask=inside)


@triton.jit
def relu_mean_kernel(mean_ptr, std_ptr, phi_ptr, n, BLOCK: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``E[relu(z)]`` elementwise alone (:func:`relu_core`'s Phi; what a prediction needs): one
    output written instead of three."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, std_ptr, n, BLOCK)
    phi, _, _ = relu_core(mean, std, CF_DEPTH)
    tl.store(phi_ptr + offsets, phi.to(m_in.dtype), mask=inside)


@triton.jit
def relu_moments_backward_kernel(
    mean_ptr,
    spread_ptr,
    phi_ptr,
    g_phi_ptr,
    g_ups_ptr,
    g_var_ptr,
    g_mean_ptr,
    g_spread_ptr,
    n,
    FROM_VARIANCE: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    CF_DEPTH: tl.constexpr,
):
    """Vector-Jacobian product of :func:`relu_moments_kernel` (:func:`relu_vjp`); with
    ``FROM_VARIANCE`` Phi is recomputed (``phi_ptr`` unused) and ``d variance = d std / (2 std)``."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, spread_ptr, n, BLOCK)
    if FROM_VARIANCE:
        std = tl.sqrt(at_least(std, FLOOR))
    x, pdf, s0, s1, s2 = small_tail(mean, std, CF_DEPTH)  # once, for Phi and the derivatives
    if FROM_VARIANCE:
        phi, _, _ = relu_from_tail(mean, std, x, s1, s2)
    else:
        phi = tl.load(phi_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_phi, g_ups, g_var = output_gradients(g_phi_ptr, g_ups_ptr, g_var_ptr, offsets, inside)
    g_mean, g_std = relu_vjp_from_tail(mean, std, phi, pdf, s0, g_phi, g_ups, g_var)
    if FROM_VARIANCE:
        g_std = 0.5 * g_std / std
    tl.store(g_mean_ptr + offsets, g_mean.to(m_in.dtype), mask=inside)
    tl.store(g_spread_ptr + offsets, g_std.to(m_in.dtype), mask=inside)


@triton.jit
def leaky_from_tail(mean, std, pdf, s0, s1, s2, eps):
    """Leaky ReLU's ``(Phi, Var before its clamp at 0, dPhi/dmean, dPhi/dstd, dVar/dmean,
    dVar/dstd)``, float64, from the small tail (the C++ ``leaky_combine``; paper eqs. (21), (22),
    written around the far side of 0 so that nothing cancels): with ``w ~ N(-|mean|, std^2)``,
    ``S1 = E[w 1{w>0}] = std s1``, ``S2 = E[w^2 1{w>0}] = std^2 s2``, ``u0 = P(w > 0) = s0``."""
    om = 1.0 - eps
    big_s1 = std * s1
    big_s2 = std * std * s2
    variance = std * std
    upper = mean >= 0.0
    # mean >= 0: g - mean = (z - mean) + (eps - 1) z 1{z<0};  mean < 0: g - eps mean = eps (z - mean) + (1 - eps) z 1{z>0}
    phi = tl.where(upper, mean + om * big_s1, eps * mean + om * big_s1)
    second = tl.where(
        upper,
        variance + 2.0 * (eps - 1.0) * (big_s2 + mean * big_s1) + om * om * big_s2,
        eps * eps * variance + 2.0 * eps * om * (big_s2 - mean * big_s1) + om * om * big_s2,
    )
    var = second - om * om * big_s1 * big_s1
    cdf = tl.where(upper, 1.0 - s0, s0)  # Phi_N(mean/std)
    cdf_neg = tl.where(upper, s0, 1.0 - s0)  # Phi_N(-mean/std)
    d_phi_mean = eps + om * cdf  # E[g']
    d_phi_std = om * pdf  # std E[g''] (heat equation)
    # dVar/dmean = 2 Cov(g, g') = 2 (1 - eps) Cov(g, 1{z>0}), without cancellation
    d_var_mean = 2.0 * om * tl.where(upper, eps * big_s1 + s0 * phi, big_s1 * (1.0 - om * s0) - eps * mean * s0)
    # dVar/dstd = std E[(g^2)''] - 2 Phi std E[g''] = 2 std E[g'^2] - 2 (1 - eps) Phi phi(t)
    d_var_std = 2.0 * std * (eps * eps * cdf_neg + cdf) - 2.0 * om * phi * pdf
    return phi, var, d_phi_mean, d_phi_std, d_var_mean, d_var_std


@triton.jit
def relu_squared_from_tail(mean, std, pdf, s0, s1, s2, s3, s4):
    """ReLU^2's ``(Phi, Var before its clamp at 0, dPhi/dmean, dPhi/dstd, dVar/dmean, dVar/dstd)``,
    float64, from the small tail (the C++ ``relusq_combine``; paper eqs. (28), (29), errata 1, 2):
    ``S_k = E[w^k 1{w>0}] = std^k s_k``, ``w ~ N(-|mean|, std^2)``, and the truncated moments
    ``M_k = E[z^k 1{z>0}]``: ``dPhi/dmean = 2 M_1``, ``dPhi/dstd = 2 std M_0``,
    ``dVar/dmean = 4 (M_3 - M_2 M_1)``, ``dVar/dstd = 4 std M_2 (3 - M_0)`` (heat equation)."""
    upper = mean >= 0.0
    variance = std * std
    mean_sq = mean * mean
    big_s1 = std * s1
    big_s2 = variance * s2
    big_s3 = variance * std * s3
    big_s4 = variance * variance * s4
    # mean >= 0: g - mean^2 = (z^2 - mean^2) - z^2 1{z<0}; mean < 0: all of g in the small tail
    phi = tl.where(upper, mean_sq + variance - big_s2, big_s2)
    var = tl.where(
        upper,
        4.0 * mean_sq * variance
        + 2.0 * variance * variance
        + 2.0 * variance * big_s2
        - big_s2 * big_s2
        - big_s4
        + 2.0 * mean_sq * big_s2,
        big_s4 - big_s2 * big_s2,
    )
    m0 = tl.where(upper, 1.0 - s0, s0)
    m1 = tl.where(upper, mean + big_s1, big_s1)
    covariance = tl.where(
        upper,
        2.0 * mean * variance + big_s3 + mean * big_s2 - (mean_sq + variance) * big_s1 + big_s1 * big_s2,
        big_s3 - big_s2 * big_s1,
    )
    return phi, var, 2.0 * m1, 2.0 * std * m0, 4.0 * covariance, 4.0 * std * phi * (3.0 - m0)


@triton.jit
def family_partials(mean, std, eps, ACTIVATION: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``(Phi, Var before its clamp at 0, dPhi/dmean, dPhi/dstd, dVar/dmean, dVar/dstd)``, float64,
    of leaky ReLU (``ACTIVATION`` 1, slope ``eps``: :func:`leaky_from_tail`) or ReLU^2 (2:
    :func:`relu_squared_from_tail`), from the small tail computed here."""
    if ACTIVATION == 1:
        x, pdf, s0, s1, s2 = small_tail(mean, std, CF_DEPTH)
        phi, var, pm, ps, vm, vs = leaky_from_tail(mean, std, pdf, s0, s1, s2, eps)
    else:
        x, pdf, s0, s1, s2, s3, s4 = small_tail_orders(mean, std, CF_DEPTH, True)
        phi, var, pm, ps, vm, vs = relu_squared_from_tail(mean, std, pdf, s0, s1, s2, s3, s4)
    return phi, var, pm, ps, vm, vs


@triton.jit
def partials_vjp(phi, raw_var, pm, ps, vm, vs, g_phi, g_ups, g_var):
    """``(d mean, d std)`` from the partials (``Upsilon = Var + Phi^2``); no gradient through Var
    where its clamp at 0 bites, as the reference's ``clamp_min``."""
    a = g_phi + 2.0 * phi * g_ups
    b = (g_ups + g_var) * tl.where(raw_var < 0.0, 0.0, 1.0)
    return pm * a + vm * b, ps * a + vs * b


@triton.jit
def family_moments_kernel(
    mean_ptr,
    std_ptr,
    slope_ptr,
    phi_ptr,
    ups_ptr,
    var_ptr,
    n,
    BLOCK: tl.constexpr,
    CF_DEPTH: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """``(Phi, Upsilon, Var)`` of leaky ReLU (``ACTIVATION`` 1) or ReLU^2 (2) elementwise
    (:func:`family_partials`), Var clamped at 0; the slope read as float64 from ``slope_ptr`` (one
    launch for any slope; unused by ReLU^2)."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, std_ptr, n, BLOCK)
    eps = tl.load(slope_ptr).to(tl.float64)
    phi, var, _, _, _, _ = family_partials(mean, std, eps, ACTIVATION, CF_DEPTH)
    var = at_least(var, 0.0)
    tl.store(phi_ptr + offsets, phi.to(m_in.dtype), mask=inside)
    tl.store(ups_ptr + offsets, (var + phi * phi).to(m_in.dtype), mask=inside)
    tl.store(var_ptr + offsets, var.to(m_in.dtype), mask=inside)


@triton.jit
def family_moments_backward_kernel(
    mean_ptr,
    std_ptr,
    slope_ptr,
    phi_ptr,
    g_phi_ptr,
    g_ups_ptr,
    g_var_ptr,
    g_mean_ptr,
    g_std_ptr,
    n,
    BLOCK: tl.constexpr,
    CF_DEPTH: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """Vector-Jacobian product of :func:`family_moments_kernel` (:func:`partials_vjp` with the
    saved Phi)."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, std_ptr, n, BLOCK)
    eps = tl.load(slope_ptr).to(tl.float64)
    _, var, pm, ps, vm, vs = family_partials(mean, std, eps, ACTIVATION, CF_DEPTH)
    phi = tl.load(phi_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_phi, g_ups, g_var = output_gradients(g_phi_ptr, g_ups_ptr, g_var_ptr, offsets, inside)
    g_mean, g_std = partials_vjp(phi, var, pm, ps, vm, vs, g_phi, g_ups, g_var)
    tl.store(g_mean_ptr + offsets, g_mean.to(m_in.dtype), mask=inside)
    tl.store(g_std_ptr + offsets, g_std.to(m_in.dtype), mask=inside)


@triton.jit
def family_moments(mean, std, eps, g_phi, g_ups, g_var, ACTIVATION: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``(Phi, Upsilon, Var, d mean, d std)`` of the ReLU family's ``ACTIVATION`` (0 ReLU, 1 leaky
    ReLU of slope ``eps``, 2 ReLU^2), float64, and the vector-Jacobian product for the output
    gradients ``g_phi``, ``g_ups``, ``g_var`` (zeros for a forward pass: the compiler drops what
    they feed). Var clamped at 0, without a gradient where the clamp bites (the reference's
    ``clamp_min``); the small tail computed once for both."""
    if ACTIVATION == 0:
        x, pdf, s0, s1, s2 = small_tail(mean, std, CF_DEPTH)
        phi, ups, var = relu_from_tail(mean, std, x, s1, s2)
        g_mean, g_std = relu_vjp_from_tail(mean, std, phi, pdf, s0, g_phi, g_ups, g_var)
    else:
        phi, raw_var, pm, ps, vm, vs = family_partials(mean, std, eps, ACTIVATION, CF_DEPTH)
        var = at_least(raw_var, 0.0)
        ups = var + phi * phi
        g_mean, g_std = partials_vjp(phi, raw_var, pm, ps, vm, vs, g_phi, g_ups, g_var)
    return phi, ups, var, g_mean, g_std


def cf_depth(dtype) -> int:
    """The continued fraction's depth for results of ``dtype`` (float32 or float64)."""
    return CF_DEPTH_F32 if str(dtype).endswith("float32") else CF_DEPTH


def grid(n: int):
    return (triton.cdiv(max(n, 1), BLOCK),)


@triton.jit
def diagonal_kl_sums_kernel(
    loc_ptr,
    log_scale_ptr,
    partial_ptr,
    variance_ptr,
    loc_square_ptr,
    n,
    WRITE_VARIANCE: tl.constexpr,
    WRITE_LOC_SQUARE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per block of ``BLOCK`` elements, the float64 sums ``(sum exp(2 log_scale), sum loc^2, sum
    log_scale)`` that ``KL(N(loc, diag exp(2 log_scale)) || N(0, s^2 I))`` needs, into
    ``partial[3 * block + k]`` (summed in block order afterwards: the result does not depend on
    the launch's scheduling); with ``WRITE_VARIANCE``, ``exp(2 log_scale)`` into ``variance`` too,
    and with ``WRITE_LOC_SQUARE`` ``loc^2`` into ``loc_square`` (an output layer's tail-pass weight)."""
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    l_in = tl.load(loc_ptr + offsets, mask=inside, other=0.0)
    loc = l_in.to(tl.float64)
    if WRITE_LOC_SQUARE:
        tl.store(loc_square_ptr + offsets, l_in * l_in, mask=inside)
    s_in = tl.load(log_scale_ptr + offsets, mask=inside, other=0.0)
    log_scale = s_in.to(tl.float64)
    variance = tl.where(inside, tl.exp(2.0 * log_scale), 0.0)
    if WRITE_VARIANCE:
        tl.store(variance_ptr + offsets, variance.to(s_in.dtype), mask=inside)
    tl.store(partial_ptr + 3 * block, tl.sum(variance, axis=0))
    tl.store(partial_ptr + 3 * block + 1, tl.sum(loc * loc, axis=0))
    tl.store(partial_ptr + 3 * block + 2, tl.sum(log_scale, axis=0))


@triton.jit
def diagonal_kl_finish_kernel(
    partial_ptr,
    out_ptr,
    blocks,
    count: tl.float64,
    prior_variance: tl.float64,
    log_prior_variance: tl.float64,
    BLOCK: tl.constexpr,
):
    """One program: the blocks' sums added in a fixed order, then the KL from its three sums
    (:func:`cfbnn_cli.moments.elbo_kernels.kl_from_sums`) into ``out[0]``."""
    variance_sum = tl.zeros([BLOCK], dtype=tl.float64)
    loc_sum = tl.zeros([BLOCK], dtype=tl.float64)
    log_scale_sum = tl.zeros([BLOCK], dtype=tl.float64)
    for b0 in range(0, blocks, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        inside = b < blocks
        variance_sum += tl.load(partial_ptr + 3 * b, mask=inside, other=0.0)
        loc_sum += tl.load(partial_ptr + 3 * b + 1, mask=inside, other=0.0)
        log_scale_sum += tl.load(partial_ptr + 3 * b + 2, mask=inside, other=0.0)
    sums = tl.sum(variance_sum, axis=0) + tl.sum(loc_sum, axis=0)
    kl = 0.5 * (sums / prior_variance - count + count * log_prior_variance)
    tl.store(out_ptr, (kl - tl.sum(log_scale_sum, axis=0)).to(out_ptr.dtype.element_ty))


@triton.jit
def fold_kl(loc, variance, d_loc, d_variance, kl_grad, prior_variance):
    """A mean-field layer's ``(dL/d loc, dL/d log_scale)`` (float64) from the data term's ``dL/d
    loc`` and ``dL/d Var`` and ``dL/dKL = kl_grad``: ``d_loc + kl_grad loc / s^2`` and ``2 Var
    d_variance + kl_grad (Var / s^2 - 1)`` (``Var = exp(2 log_scale)``)."""
    kl_grad = kl_grad.to(tl.float64)
    scaled = kl_grad / prior_variance
    return d_loc + scaled * loc, 2.0 * variance * d_variance + scaled * variance - kl_grad


@triton.jit
def diagonal_gradients_kernel(
    loc_ptr,
    variance_ptr,
    g_loc_ptr,
    g_variance_ptr,
    g_log_scale_ptr,
    kl_grad_ptr,
    kl_sign: tl.float64,
    n,
    prior_variance: tl.float64,
    BLOCK: tl.constexpr,
):
    """A mean-field layer's gradients finished in one pass: from ``dL/d loc`` (``g_loc``, updated in
    place) and ``dL/d Var`` (``g_variance``) of the data term, and ``dL/dKL = kl_sign *
    kl_grad[0]``: ``g_loc += dL/dKL loc / s^2`` and ``g_log_scale = 2 Var dL/dVar + dL/dKL (Var /
    s^2 - 1)``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    l_in = tl.load(loc_ptr + offsets, mask=inside, other=0.0)
    loc = l_in.to(tl.float64)
    variance = tl.load(variance_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_loc = tl.load(g_loc_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_variance = tl.load(g_variance_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_loc, g_log_scale = fold_kl(loc, variance, g_loc, g_variance, kl_sign * tl.load(kl_grad_ptr), prior_variance)
    tl.store(g_loc_ptr + offsets, g_loc.to(l_in.dtype), mask=inside)
    tl.store(g_log_scale_ptr + offsets, g_log_scale.to(l_in.dtype), mask=inside)


@triton.jit
def diagonal_kl_backward_kernel(
    loc_ptr, log_scale_ptr, grad_ptr, g_loc_ptr, g_log_scale_ptr, n, prior_variance: tl.float64, BLOCK: tl.constexpr
):
    """The KL's gradients for ``grad = dL/dKL`` (a one-element tensor): ``grad / s^2 * loc`` and
    ``grad / s^2 * exp(2 log_scale) - grad``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    l_in = tl.load(loc_ptr + offsets, mask=inside, other=0.0)
    loc = l_in.to(tl.float64)
    log_scale = tl.load(log_scale_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    grad = tl.load(grad_ptr).to(tl.float64)
    scaled = grad / prior_variance
    tl.store(g_loc_ptr + offsets, (scaled * loc).to(l_in.dtype), mask=inside)
    tl.store(g_log_scale_ptr + offsets, (scaled * tl.exp(2.0 * log_scale) - grad).to(l_in.dtype), mask=inside)
