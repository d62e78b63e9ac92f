"""Triton kernels of the mean-field KL and of a layer's gradients with the KL folded in: the CUDA
side of ``cfbnn::diagonal_kl`` (:mod:`.kl_ops`) and of ``cfbnn::finish_diagonal_gradients``
(:mod:`.elbo_ops`). Sums in float64 in a fixed order, whatever the inputs' dtype (the result does
not depend on the launch's scheduling). :func:`kl_block` and :func:`kl_from_table` write and read
a KL sums table (:mod:`cfbnn_cli.moments.elbo_reference`) from inside other kernels: one launch
writes the sums of both layers of a one-hidden-layer network, and the ELBO's rows finish the KL."""

import triton
import triton.language as tl


@triton.jit
def load_layer_block(
    loc_ptr,
    log_scale_ptr,
    variance_ptr,
    loc_square_ptr,
    offsets,
    inside,
    WRITE_VARIANCE: tl.constexpr,
    WRITE_LOC_SQUARE: tl.constexpr,
):
    """A block of a mean-field layer as its KL sums read it: ``(loc, log_scale, exp(2 log_scale))``
    in float64 (zero outside ``inside``); with ``WRITE_VARIANCE``, ``exp(2 log_scale)`` stored into
    ``variance`` in the layer's dtype, and with ``WRITE_LOC_SQUARE`` ``loc^2`` into ``loc_square``."""
    l_in = tl.load(loc_ptr + offsets, mask=inside, other=0.0)
    if WRITE_LOC_SQUARE:
        tl.store(loc_square_ptr + offsets, l_in * l_in, mask=inside)
    s_in = tl.load(log_scale_ptr + offsets, mask=inside, other=0.0)
    log_scale = s_in.to(tl.float64)
    variance = tl.where(inside, tl.exp(2.0 * log_scale), 0.0)
    if WRITE_VARIANCE:
        tl.store(variance_ptr + offsets, variance.to(s_in.dtype), mask=inside)
    return l_in.to(tl.float64), log_scale, variance


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
    loc, log_scale, variance = load_layer_block(
        loc_ptr, log_scale_ptr, variance_ptr, loc_square_ptr, offsets, offsets < n, WRITE_VARIANCE, WRITE_LOC_SQUARE
    )
    tl.store(partial_ptr + 3 * block, tl.sum(variance, axis=0))
    tl.store(partial_ptr + 3 * block + 1, tl.sum(loc * loc, axis=0))
    tl.store(partial_ptr + 3 * block + 2, tl.sum(log_scale, axis=0))


@triton.jit
def kl_block(
    loc_ptr,
    log_scale_ptr,
    variance_ptr,
    loc_square_ptr,
    row_ptr,
    block,
    n,
    LOC_SQUARE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Block ``block`` of ``BLOCK`` elements of a mean-field layer: ``exp(2 log_scale)`` into
    ``variance`` (with ``LOC_SQUARE``, ``loc^2`` into ``loc_square``) and the block's row of a KL
    sums table (:func:`cfbnn_cli.moments.elbo_reference.kl_block_sums`), float64, into ``row[0:3]``:
    ``(sum (Var + loc^2), sum log_scale, count)``."""
    start = block.to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    loc, log_scale, variance = load_layer_block(
        loc_ptr, log_scale_ptr, variance_ptr, loc_square_ptr, offsets, offsets < n, True, LOC_SQUARE
    )
    tl.store(row_ptr, tl.sum(variance + loc * loc, axis=0))
    tl.store(row_ptr + 1, tl.sum(log_scale, axis=0))
    tl.store(row_ptr + 2, tl.minimum(n - start, BLOCK).to(tl.float64))


@triton.jit
def float64_accumulators(BLOCK: tl.constexpr):
    """Three zeroed float64 ``(BLOCK,)`` accumulators: the lanes of a three-sum reduction over rows
    taken ``BLOCK`` at a time (:func:`column_sums`, the Normal rows' backward pass)."""
    return tl.zeros([BLOCK], dtype=tl.float64), tl.zeros([BLOCK], dtype=tl.float64), tl.zeros([BLOCK], dtype=tl.float64)


@triton.jit
def load_float64(pointers, mask):
    """``pointers``' values as float64, 0 where ``mask`` is off (nothing added to a sum)."""
    return tl.load(pointers, mask=mask, other=0.0).to(tl.float64)


@triton.jit
def column_sums(table_ptr, rows, BLOCK: tl.constexpr):
    """The three column sums (float64) of a ``(rows, 3)`` float64 table of the blocks' sums, added
    in a fixed order (the result does not depend on the launch)."""
    first, second, third = float64_accumulators(BLOCK)
    for r0 in range(0, rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        inside = r < rows
        first += load_float64(table_ptr + 3 * r, inside)
        second += load_float64(table_ptr + 3 * r + 1, inside)
        third += load_float64(table_ptr + 3 * r + 2, inside)
    return tl.sum(first, axis=0), tl.sum(second, axis=0), tl.sum(third, axis=0)


@triton.jit
def kl_from_table(sums_ptr, parts, prior_variance, log_prior_variance, BLOCK: tl.constexpr):
    """The KL (float64) of the layers whose rows make the KL sums table at ``sums`` (``parts`` rows
    of three: :func:`kl_block`), the rows added in a fixed order."""
    second, log_scale_sum, n = column_sums(sums_ptr, parts, BLOCK)
    kl = 0.5 * (second / prior_variance - n + n * log_prior_variance)
    return kl - log_scale_sum


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
    (:func:`cfbnn_cli.moments.elbo_reference.kl_from_sums`) into ``out[0]``."""
    variance_sum, loc_sum, log_scale_sum = column_sums(partial_ptr, blocks, BLOCK)
    kl = 0.5 * ((variance_sum + loc_sum) / prior_variance - count + count * log_prior_variance)
    tl.store(out_ptr, (kl - log_scale_sum).to(out_ptr.dtype.element_ty))


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
    data_scale_ptr,
    n,
    prior_variance: tl.float64,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A mean-field layer's gradients finished in one pass: from ``dL/d loc`` (``g_loc``, updated in
    place) and ``dL/d Var`` (``g_variance``) of the data term (both times ``data_scale[0]`` with
    ``SCALED``), and ``dL/dKL = kl_sign *
    kl_grad[0]``: ``g_loc += dL/dKL loc / s^2`` and ``g_log_scale = 2 Var dL/dVar + dL/dKL (Var /
    s^2 - 1)``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    l_in = tl.load(loc_ptr + offsets, mask=inside, other=0.0)
    loc = l_in.to(tl.float64)
    variance = tl.load(variance_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_loc = tl.load(g_loc_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    g_variance = tl.load(g_variance_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
    if SCALED:  # the data term's gradients taken at a unit upstream gradient
        data_scale = tl.load(data_scale_ptr).to(tl.float64)
        g_loc, g_variance = data_scale * g_loc, data_scale * g_variance
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
