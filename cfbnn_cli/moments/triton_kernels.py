"""Triton kernels of the activation moments: the CUDA side of the ``cfbnn::`` operators.

Numerics are those of the reference path (:func:`cfbnn_cli.moments.relu_reference.relu_forward_block`),
computed in the inputs' dtype: float64 for float64, float32 for float32 (issue #46: a GPU's
float64 runs at 1/32 to 1/64 of its float32; the launchers' ``cf_depth(dtype)`` tells the
kernels which, :func:`compute`):

* with ``x = |mean|/std`` the Normal mass on the far side of 0 is the *small tail*
  ``s_0 = Phi_N(-x)``, ``s_1 = phi(x) - x s_0``, ``s_2 = s_0 - x s_1`` (``std`` units);
* for ``x < 2`` (float32: ``x < 1``, ReLU^2 ``x < 0.75``) from ``erf`` (``1 - erf`` keeps >= 14
  digits there in float64) and that recursion;
* beyond, from the Mills-ratio continued fraction (``paper/ERRATA.md``, "Numerics";
  :func:`cfbnn_cli.moments.gaussian._continued_fraction`): ``r_j = j/(x + r_{j+1})``
  evaluated backwards from depth ``CF_DEPTH`` (Miller's algorithm), then
  ``s_0 = phi(x)/(x + r_1)``, ``s_1 = s_0 r_1``, ``s_2 = s_1 r_2`` -- only positive terms,
  no cancellation, and only ``exp`` (which the Triton interpreter has on the CPU, so CI tests
  these very kernels with ``TRITON_INTERPRET=1``).

In float32 the one ill-conditioned factor, ``exp(-x^2/2)`` (relative condition ``x^2``), takes
``x``'s rounding out through a few float64 multiplications and subtractions
(:func:`gaussian_f32`, :func:`std_from_variance`); everything else is float32 arithmetic, and
the tail pass adds its tiles' sums in float64 (:mod:`.triton_tail_kernels`).

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
# float32 results are computed in float32 (the depth tells the kernels which: F32_DEPTH). There the
# recursion from erf loses too much below x = 2 (1 - erf, then s_k's cancellations: with erf's 2
# ulps on a GPU, 1.6e-5 in s1 and 4.5e-4 in s4 at x = 2, 5e-6 in s4 at x = 1), so the fraction
# takes over from x = 1 on, where depth 64 is within 1.4e-8 of s_0 .. s_4 (40-digit quadrature);
# for ReLU^2 (s_3, s_4: more cancellation) from x = 0.75 on, depth 96 (1.3e-8 there)
F32_DEPTH = tl.constexpr(64)
CF_DEPTH_F32 = F32_DEPTH.value
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
def compute(value, CF_DEPTH: tl.constexpr):
    """``value`` in the arithmetic of results whose continued fraction has depth ``CF_DEPTH``
    (:func:`cf_depth`): float32 for float32 results, float64 for float64 ones."""
    if CF_DEPTH == F32_DEPTH:
        result = value.to(tl.float32)
    else:
        result = value.to(tl.float64)
    return result


@triton.jit
def gaussian_f32(mean, std, std_error, x, SCALED: tl.constexpr):
    """``phi(x)``, ``x = |mean| / (std (1 + std_error))``, for float32 ``mean``, ``std`` (``std``
    floored, ``x`` their float32 quotient; ``std_error`` the relative error of a ``std`` that is
    the rounded square root of a variance, else 0): ``exp(-x^2/2)`` has a relative condition of
    ``x^2``, so the half ulp of ``x`` alone would cost ``x^2 2^-24`` (1e-5 at x = 13, where the
    result is still a normal float32). The quotient's remainder ``|mean| - x std`` and ``x^2 log2(e) / 2`` are exact or
    one rounding in float64 (products of 24-bit numbers and subtractions: five float64 operations,
    no float64 division or exponential); ``exp2`` then takes a float32 argument exactly and the
    rest goes in as ``(1 - c)``, ``|c| <~ x^2 2^-24``. With ``SCALED``, times ``2^64`` (see
    :func:`small_tail_orders`)."""
    x64 = x.to(tl.float64)
    remainder = tl.abs(mean).to(tl.float64) - x64 * std.to(tl.float64)
    half_square = x64 * x64 * 0.7213475204444817  # x^2 log2(e) / 2
    if SCALED:
        half_square = half_square - 64.0  # (in float64: in float32 it would round)
    head = half_square.to(tl.float32)
    tail = (half_square - head.to(tl.float64)).to(tl.float32)
    # x's own error, x_lo = remainder / std, enters as 2 x x_lo / 2 = x^2 remainder / |mean| (no
    # overflow for a tiny std); a std from a variance, std (1 + std_error), as -x^2 std_error
    relative = remainder.to(tl.float32) / at_least(tl.abs(mean), 1.1754943508222875e-38) - std_error
    c = tail * 0.6931471805599453 + x * x * relative
    # past x ~ 100 (or at x's clamp, or for an infinite operand) c means nothing, and exp2 is 0
    # there, as it is NaN for a NaN operand: keep c only while it is a small correction
    c = tl.where(tl.abs(c) < 1e-3, c, 0.0)
    return tl.exp2(-head) * (1.0 - c) * 0.3989422804014327


@triton.jit
def std_from_variance(variance, FLOOR: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``(std, std_error)``: the square root of the variance floored at ``FLOOR`` (the dtype's
    smallest normal number, as the CPU kernels), and in float32 its relative error
    ``(variance - std^2) / (2 variance)`` (``std^2`` exact in float64), which
    :func:`gaussian_f32` takes out of ``exp(-x^2/2)`` (``x^2`` times it: 9e-6 at x = 12.5); 0 in
    float64."""
    variance = at_least(variance, FLOOR)
    std = tl.sqrt(variance)  # (a NaN stays NaN)
    if CF_DEPTH == F32_DEPTH:
        std64 = std.to(tl.float64)
        std_error = (variance.to(tl.float64) - std64 * std64).to(tl.float32) / variance * 0.5
    else:
        std_error = tl.zeros_like(std)
    return std, std_error


@triton.jit
def small_tail_orders(mean, std, std_error, CF_DEPTH: tl.constexpr, ORDER4: tl.constexpr):
    """``(x, pdf, s0, s1, s2, s3, s4)`` for ``mean``, ``std`` (``std >= 0``) in their dtype: float64
    (``CF_DEPTH`` 80, switch to the fraction at x = 2) or float32 (``F32_DEPTH``, switch at x = 1,
    the Gaussian factor through :func:`gaussian_f32`); ``s3``, ``s4``
    (``s_k = (k - 1) s_{k-2} - x s_{k-1}``; far out ``s_k = s_{k-1} r_k``) only with ``ORDER4``
    (ReLU^2), else zeros. In float32 with ``ORDER4``, ``pdf`` and every ``s_k`` come times ``2^64``
    (exact): ReLU^2's ``std^4 s_4`` is a normal float32 where ``s_4`` alone is not (``std`` = 1e3,
    x ~ 13); :func:`unscaled` takes the factor out."""
    if CF_DEPTH == F32_DEPTH:
        x = at_most(tl.abs(mean) / at_least(std, 1.1754943508222875e-38), 1e4)
        pdf = gaussian_f32(mean, at_least(std, 1.1754943508222875e-38), std_error, x, ORDER4)
        if ORDER4:  # (s_4's recursion cancels more: 2.2e-6 at x = 0.75, 5.5e-6 at x = 1)
            switch = 0.75
            depth: tl.constexpr = 96
        else:
            switch = 1.0
            depth: tl.constexpr = CF_DEPTH
    else:
        x = at_most(tl.abs(mean) / at_least(std, 2.2250738585072014e-308), 1e4)
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        switch = 2.0
        depth: tl.constexpr = CF_DEPTH  # (annotated: the loop needs a compile-time depth)
    # near 0: erf and the recursion
    near_s0 = 0.5 * (1.0 - tl.math.erf(x * 0.7071067811865476))
    if ORDER4 and CF_DEPTH == F32_DEPTH:
        near_s0 = near_s0 * 18446744073709551616.0  # 2^64, as pdf
    near_s1 = pdf - x * near_s0
    near_s2 = near_s0 - x * near_s1
    # far: the continued fraction, x kept >= the switch so that the unselected lanes stay finite
    xf = at_least(x, switch)
    r = 0.5 * (tl.sqrt(xf * xf + 4.0 * (depth + 1)) - xf)
    r2 = r
    r3 = r
    r4 = r
    for j in tl.static_range(depth, 0, -1):
        r = j / (xf + r)
        if j == 2:
            r2 = r
        if j == 3:
            r3 = r
        if j == 4:
            r4 = r
    if CF_DEPTH == F32_DEPTH:
        far_s0 = pdf / (xf + r)  # (pdf at x: below the switch an unselected lane, finite)
    else:
        far_s0 = tl.exp(-0.5 * xf * xf) * 0.3989422804014327 / (xf + r)
    far_s1 = far_s0 * r
    far_s2 = far_s1 * r2
    far = x >= switch
    s0 = tl.where(far, far_s0, near_s0)
    s1 = tl.where(far, far_s1, near_s1)
    s2 = tl.where(far, far_s2, near_s2)
    if ORDER4:
        near_s3 = 2.0 * near_s1 - x * near_s2
        near_s4 = 3.0 * near_s2 - x * near_s3
        far_s3 = far_s2 * r3
        far_s4 = far_s3 * r4
        s3 = tl.where(far, far_s3, near_s3)
        s4 = tl.where(far, far_s4, near_s4)
    else:
        s3 = tl.zeros_like(s2)
        s4 = tl.zeros_like(s2)
    return x, pdf, s0, s1, s2, s3, s4


@triton.jit
def unscaled(s, factor, CF_DEPTH: tl.constexpr):
    """``factor s`` for ``s`` from :func:`small_tail_orders` with ``ORDER4`` (``factor >= 0``): in
    float32 ``s`` carries ``2^64``, taken out of whichever of the two keeps the product normal
    (the factor when it is at least 1, else ``s``)."""
    if CF_DEPTH == F32_DEPTH:
        result = tl.where(factor >= 1.0, s * (factor * 5.421010862427522e-20), (s * 5.421010862427522e-20) * factor)
    else:
        result = s * factor
    return result


@triton.jit
def small_tail(mean, std, std_error, CF_DEPTH: tl.constexpr):
    """``(x, pdf, s0, s1, s2)`` in the dtype of ``mean``, ``std`` (``std >= 0``;
    :func:`small_tail_orders`)."""
    x, pdf, s0, s1, s2, _, _ = small_tail_orders(mean, std, std_error, CF_DEPTH, False)
    return x, pdf, s0, s1, s2


@triton.jit
def relu_from_tail(mean, std, x, s1, s2):
    """``(Phi, Upsilon, Var)`` of ``relu(z)``, ``z ~ N(mean, std^2)``, in their dtype, from the small tail
    (paper eq. (20), the cancellation-free form of ``relu_reference.relu_forward_block``)."""
    upper = mean >= 0.0
    phi = at_least(mean, 0.0) + std * s1
    # the bracket of Var / std^2: above 0, 1 - s2 - 2 x s1 - s1^2 (>= 0.34); below, s2 - s1^2
    bracket = tl.where(upper, 1.0 - s2 - 2.0 * x * s1 - s1 * s1, s2 - s1 * s1)
    var = at_least(std * std * bracket, 0.0)
    return phi, var + phi * phi, var


@triton.jit
def relu_core(mean, std, std_error, CF_DEPTH: tl.constexpr):
    """:func:`relu_from_tail` with the small tail computed here."""
    x, pdf, s0, s1, s2 = small_tail(mean, std, std_error, CF_DEPTH)
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
def block_operands(mean_ptr, spread_ptr, n, BLOCK: tl.constexpr, CF_DEPTH: tl.constexpr):
    """This program's block of an elementwise kernel: ``(offsets, inside, mean as stored, mean and
    spread in the arithmetic of the results`` (:func:`compute`)``)``; lanes past ``n`` read a mean of
    0 and a spread of 1 (finite arithmetic)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    m_in = tl.load(mean_ptr + offsets, mask=inside, other=0.0)
    spread = compute(tl.load(spread_ptr + offsets, mask=inside, other=1.0), CF_DEPTH)
    return offsets, inside, m_in, compute(m_in, CF_DEPTH), spread


@triton.jit
def output_gradients(g_phi_ptr, g_ups_ptr, g_var_ptr, offsets, inside, CF_DEPTH: tl.constexpr):
    """The block's gradients of ``(Phi, Upsilon, Var)`` (:func:`compute`)."""
    g_phi = compute(tl.load(g_phi_ptr + offsets, mask=inside, other=0.0), CF_DEPTH)
    g_ups = compute(tl.load(g_ups_ptr + offsets, mask=inside, other=0.0), CF_DEPTH)
    g_var = compute(tl.load(g_var_ptr + offsets, mask=inside, other=0.0), CF_DEPTH)
    return g_phi, g_ups, g_var


@triton.jit
def relu_mean_kernel(mean_ptr, std_ptr, phi_ptr, n, BLOCK: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``E[relu(z)]`` elementwise alone (:func:`relu_core`'s Phi; what a prediction needs): one
    output written instead of three."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, std_ptr, n, BLOCK, CF_DEPTH)
    phi, _, _ = relu_core(mean, std, 0.0, CF_DEPTH)
    tl.store(phi_ptr + offsets, phi.to(m_in.dtype), mask=inside)


@triton.jit
def leaky_from_tail(mean, std, pdf, s0, s1, s2, eps):
    """Leaky ReLU's ``(Phi, Var before its clamp at 0, dPhi/dmean, dPhi/dstd, dVar/dmean,
    dVar/dstd)``, in their dtype, from the small tail (the C++ ``leaky_combine``; paper eqs. (21), (22),
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
def relu_squared_from_tail(mean, std, s0, s1, s2, s3, s4, CF_DEPTH: tl.constexpr):
    """ReLU^2's ``(Phi, Var before its clamp at 0, dPhi/dmean, dPhi/dstd, dVar/dmean, dVar/dstd)``,
    in their dtype, from the small tail (the C++ ``relusq_combine``; paper eqs. (28), (29), errata 1, 2):
    ``S_k = E[w^k 1{w>0}] = std^k s_k``, ``w ~ N(-|mean|, std^2)``, and the truncated moments
    ``M_k = E[z^k 1{z>0}]``: ``dPhi/dmean = 2 M_1``, ``dPhi/dstd = 2 std M_0``,
    ``dVar/dmean = 4 (M_3 - M_2 M_1)``, ``dVar/dstd = 4 std M_2 (3 - M_0)`` (heat equation); the
    ``s_k`` as :func:`small_tail_orders` gives them with ``ORDER4`` (:func:`unscaled`)."""
    upper = mean >= 0.0
    variance = std * std
    mean_sq = mean * mean
    s0 = unscaled(s0, 1.0, CF_DEPTH)
    big_s1 = unscaled(s1, std, CF_DEPTH)
    big_s2 = unscaled(s2, variance, CF_DEPTH)
    big_s3 = unscaled(s3, variance * std, CF_DEPTH)
    big_s4 = unscaled(s4, variance * variance, CF_DEPTH)
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
def family_pointwise(z, slope_ptr, ACTIVATION: tl.constexpr):
    """``g(z)`` of the ReLU family's ``ACTIVATION`` (0 ReLU, 1 leaky ReLU of the float64 slope at
    ``slope_ptr``, 2 ReLU^2) in ``z``'s dtype; a NaN stays NaN (selects, not max)."""
    if ACTIVATION == 0:
        h = tl.where(z < 0.0, 0.0, z)
    elif ACTIVATION == 1:
        h = tl.where(z < 0.0, (tl.load(slope_ptr).to(z.dtype) * z).to(z.dtype), z)
    else:
        positive = tl.where(z < 0.0, 0.0, z)
        h = positive * positive
    return h


@triton.jit
def family_partials(mean, std, std_error, eps, ACTIVATION: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``(Phi, Var before its clamp at 0, dPhi/dmean, dPhi/dstd, dVar/dmean, dVar/dstd)``, in their dtype,
    of leaky ReLU (``ACTIVATION`` 1, slope ``eps``: :func:`leaky_from_tail`) or ReLU^2 (2:
    :func:`relu_squared_from_tail`), from the small tail computed here."""
    if ACTIVATION == 1:
        x, pdf, s0, s1, s2 = small_tail(mean, std, std_error, CF_DEPTH)
        phi, var, pm, ps, vm, vs = leaky_from_tail(mean, std, pdf, s0, s1, s2, eps)
    else:
        x, pdf, s0, s1, s2, s3, s4 = small_tail_orders(mean, std, std_error, CF_DEPTH, True)
        phi, var, pm, ps, vm, vs = relu_squared_from_tail(mean, std, s0, s1, s2, s3, s4, CF_DEPTH)
    return phi, var, pm, ps, vm, vs


@triton.jit
def partials_vjp(phi, raw_var, pm, ps, vm, vs, g_phi, g_ups, g_var):
    """``(d mean, d std)`` from the partials (``Upsilon = Var + Phi^2``); no gradient through Var
    where its clamp at 0 bites, as the reference's ``clamp_min``."""
    a = g_phi + 2.0 * phi * g_ups
    b = (g_ups + g_var) * tl.where(raw_var < 0.0, 0.0, 1.0)
    return pm * a + vm * b, ps * a + vs * b


@triton.jit
def family_moments(mean, std, std_error, eps, g_phi, g_ups, g_var, ACTIVATION: tl.constexpr, CF_DEPTH: tl.constexpr):
    """``(Phi, Upsilon, Var, d mean, d std)`` of the ReLU family's ``ACTIVATION`` (0 ReLU, 1 leaky
    ReLU of slope ``eps``, 2 ReLU^2), in their dtype, and the vector-Jacobian product for the output
    gradients ``g_phi``, ``g_ups``, ``g_var`` (zeros for a forward pass: the compiler drops what
    they feed). Var clamped at 0, without a gradient where the clamp bites (the reference's
    ``clamp_min``); the small tail computed once for both."""
    if ACTIVATION == 0:
        x, pdf, s0, s1, s2 = small_tail(mean, std, std_error, CF_DEPTH)
        phi, ups, var = relu_from_tail(mean, std, x, s1, s2)
        g_mean, g_std = relu_vjp_from_tail(mean, std, phi, pdf, s0, g_phi, g_ups, g_var)
    else:
        phi, raw_var, pm, ps, vm, vs = family_partials(mean, std, std_error, eps, ACTIVATION, CF_DEPTH)
        var = at_least(raw_var, 0.0)
        ups = var + phi * phi
        g_mean, g_std = partials_vjp(phi, raw_var, pm, ps, vm, vs, g_phi, g_ups, g_var)
    return phi, ups, var, g_mean, g_std


@triton.jit
def moments_kernel(
    mean_ptr,
    spread_ptr,
    slope_ptr,
    phi_ptr,
    ups_ptr,
    var_ptr,
    n,
    ACTIVATION: tl.constexpr,
    FROM_VARIANCE: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    CF_DEPTH: tl.constexpr,
):
    """``(Phi, Upsilon, Var)`` of the ReLU family's ``ACTIVATION`` elementwise (:func:`family_moments`;
    the leaky slope read as float64 from ``slope_ptr``: one launch for any slope). ``spread`` is the
    standard deviation, or with ``FROM_VARIANCE`` the variance (the square root taken here, the
    variance kept at or above ``FLOOR``, the dtype's smallest normal number, as the CPU kernel
    ``hidden_pass`` does)."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, spread_ptr, n, BLOCK, CF_DEPTH)
    std_error = tl.zeros_like(std)
    if FROM_VARIANCE:
        std, std_error = std_from_variance(std, FLOOR, CF_DEPTH)
    eps = 0.0
    if ACTIVATION == 1:  # (the other kinds have no slope: their launch passes any pointer)
        eps = compute(tl.load(slope_ptr), CF_DEPTH)
    zero = tl.zeros_like(mean)  # no output gradients: the compiler drops the product they feed
    phi, ups, var, _, _ = family_moments(mean, std, std_error, eps, zero, zero, zero, ACTIVATION, CF_DEPTH)
    tl.store(phi_ptr + offsets, phi.to(m_in.dtype), mask=inside)
    tl.store(ups_ptr + offsets, ups.to(m_in.dtype), mask=inside)
    tl.store(var_ptr + offsets, var.to(m_in.dtype), mask=inside)


@triton.jit
def moments_backward_kernel(
    mean_ptr,
    spread_ptr,
    slope_ptr,
    phi_ptr,
    g_phi_ptr,
    g_ups_ptr,
    g_var_ptr,
    g_mean_ptr,
    g_spread_ptr,
    n,
    ACTIVATION: tl.constexpr,
    FROM_VARIANCE: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    CF_DEPTH: tl.constexpr,
):
    """Vector-Jacobian product of :func:`moments_kernel`, the small tail computed once for Phi and
    the derivatives. It takes the saved Phi at ``phi_ptr`` as the operators' backward does (an
    input of its own there); with ``FROM_VARIANCE`` Phi is recomputed (``phi_ptr`` unused) and ``d
    variance = d std / (2 std)``."""
    offsets, inside, m_in, mean, std = block_operands(mean_ptr, spread_ptr, n, BLOCK, CF_DEPTH)
    std_error = tl.zeros_like(std)
    if FROM_VARIANCE:
        std, std_error = std_from_variance(std, FLOOR, CF_DEPTH)
    g_phi, g_ups, g_var = output_gradients(g_phi_ptr, g_ups_ptr, g_var_ptr, offsets, inside, CF_DEPTH)
    if ACTIVATION == 0:
        x, pdf, s0, s1, s2 = small_tail(mean, std, std_error, CF_DEPTH)
        if FROM_VARIANCE:
            phi, _, _ = relu_from_tail(mean, std, x, s1, s2)
        else:
            phi = compute(tl.load(phi_ptr + offsets, mask=inside, other=0.0), CF_DEPTH)
        g_mean, g_std = relu_vjp_from_tail(mean, std, phi, pdf, s0, g_phi, g_ups, g_var)
    else:
        eps = 0.0
        if ACTIVATION == 1:
            eps = compute(tl.load(slope_ptr), CF_DEPTH)
        phi_now, raw_var, pm, ps, vm, vs = family_partials(mean, std, std_error, eps, ACTIVATION, CF_DEPTH)
        if FROM_VARIANCE:
            phi = phi_now
        else:
            phi = compute(tl.load(phi_ptr + offsets, mask=inside, other=0.0), CF_DEPTH)
        g_mean, g_std = partials_vjp(phi, raw_var, pm, ps, vm, vs, g_phi, g_ups, g_var)
    if FROM_VARIANCE:
        g_std = 0.5 * g_std / std
    tl.store(g_mean_ptr + offsets, g_mean.to(m_in.dtype), mask=inside)
    tl.store(g_spread_ptr + offsets, g_std.to(m_in.dtype), mask=inside)


def cf_depth(dtype) -> int:
    """The continued fraction's depth for results of ``dtype`` (float32 or float64): also what tells
    the kernels to compute in float32 (:data:`F32_DEPTH`) or float64."""
    return CF_DEPTH_F32 if str(dtype).endswith("float32") else CF_DEPTH


def grid(n: int):
    return (triton.cdiv(max(n, 1), BLOCK),)
