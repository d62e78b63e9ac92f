"""Triton kernels of the deterministic prediction: the CUDA side of :mod:`.predict_ops`.

A mean-field hidden layer's exact output mean (paper eqs. (11), (12), (20), (42)) needs, besides
its matrix products, two elementwise passes, one on each side of the batched product
``stack([[h, 1], [h^2, 1]]) @ stack([M, V])^T`` that gives ``(gamma, xi^2)`` at once:

* :func:`prediction_operand_kernel` writes that product's operand from the layer's inputs, the
  activation of the point layer before folded in (``h = g(z)``, ``ACTIVATION`` as the moments
  kernels number the ReLU family; -1: the inputs as they are), the column of ones with ``BIAS``;
* :func:`prediction_hidden_mean_kernel` reads the product's ``(gamma, xi^2)`` and writes
  ``[E g(a^T h), 1]``, the operand of the output layer's product: the variance floored and its
  square root taken here, the mean alone computed (the moments kernels' small tail,
  :func:`~.triton_kernels.small_tail`, :func:`~.triton_kernels.family_partials`, in the inputs'
  dtype).

Both tile ``(rows, columns)`` blocks, so no element index is divided.
"""

import triton
import triton.language as tl

from .triton_kernels import at_least, compute, family_partials, family_pointwise, small_tail, std_from_variance

BLOCK = 1024  # elements of a tile (as the moments kernels' blocks)
MAX_COLUMNS = 128


def tile(rows: int, columns: int):
    """``(grid, BLOCK_R, BLOCK_C)`` of a ``(rows, columns)`` pass: tiles of :data:`BLOCK` elements,
    at most :data:`MAX_COLUMNS` wide and no wider than the next power of two of ``columns`` (a
    narrow layer does not pay for masked lanes); rows on the grid's first axis, which has no
    65535 limit."""
    block_c = min(MAX_COLUMNS, triton.next_power_of_2(max(columns, 1)))
    block_r = BLOCK // block_c
    return (triton.cdiv(max(rows, 1), block_r), triton.cdiv(max(columns, 1), block_c)), block_r, block_c


@triton.jit
def tile_offsets(BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's ``(rows (BLOCK_R, 1), columns (1, BLOCK_C))``, int64."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    columns = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    return rows, columns


# A prediction pass's operands travel as one tuple, ``prediction = (operand_ptr, slope_ptr, out_ptr,
# rows, width, half)``: the pass's ``(rows, width)`` operand (contiguous), the leaky ReLU's slope
# (float64; the other kinds never read it), the output and ``half``, the offset of the second half
# (of ``out`` for the operand kernel, of the operand for the hidden mean; an int64 where it must be).


@triton.jit
def store_with_ones_column(out_ptr, value, r, c, rows, width, BIAS: tl.constexpr):
    """``value`` into the tile ``(r, c)`` of ``out (rows, width + BIAS)`` contiguous, the column of ones
    at ``c == width`` (only written with ``BIAS``)."""
    stride = width + BIAS
    tl.store(out_ptr + r * stride + c, tl.where(c < width, value, 1.0), mask=(r < rows) & (c < stride))


@triton.jit
def prediction_operand_kernel(
    prediction, ACTIVATION: tl.constexpr, BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    """``out (2, rows, width + BIAS)``: ``[h, 1]`` and ``[h^2, 1]`` (the second from ``half``, the first
    half's size) for ``h = g(inputs)`` (the ``prediction`` tuple's operand), ``g`` ReLU (0), leaky
    ReLU of the float64 slope at ``slope_ptr`` (1), ReLU^2 (2) or none (-1). A NaN input stays NaN
    in both halves (selects, not max)."""
    inputs_ptr, slope_ptr, out_ptr, rows, width, half = prediction
    r, c = tile_offsets(BLOCK_R, BLOCK_C)
    z = tl.load(inputs_ptr + r * width + c, mask=(r < rows) & (c < width), other=0.0)
    if ACTIVATION >= 0:
        h = family_pointwise(z, slope_ptr, ACTIVATION)
    else:
        h = z
    h = h.to(z.dtype)
    store_with_ones_column(out_ptr, h, r, c, rows, width, BIAS)
    store_with_ones_column(out_ptr + half, h * h, r, c, rows, width, BIAS)


@triton.jit
def prediction_hidden_mean_kernel(
    prediction,
    ACTIVATION: tl.constexpr,
    BIAS: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CF_DEPTH: tl.constexpr,
):
    """``out (rows, width + BIAS)``: ``[E g(z), 1]``, ``z ~ N(gamma, xi^2)``, from ``moments (2,
    rows, width)`` (the ``prediction`` tuple's operand: ``gamma``, then ``xi^2`` from ``half``): the
    variance floored at ``FLOOR`` and its root taken (:func:`~.triton_kernels.std_from_variance`,
    with float32's rounding of the root taken out of the Gaussian factor), then ReLU's ``max(gamma,
    0) + xi s_1`` (0; paper eq. (20)) or the mean of leaky ReLU (1, slope at ``slope_ptr``) or
    ReLU^2 (2); arithmetic in the dtype's (:func:`~.triton_kernels.compute`)."""
    moments_ptr, slope_ptr, out_ptr, rows, width, half = prediction
    r, c = tile_offsets(BLOCK_R, BLOCK_C)
    inside = (r < rows) & (c < width)
    offsets = r * width + c
    m_in = tl.load(moments_ptr + offsets, mask=inside, other=0.0)
    mean = compute(m_in, CF_DEPTH)
    variance = compute(tl.load(moments_ptr + half + offsets, mask=inside, other=1.0), CF_DEPTH)
    std, std_error = std_from_variance(variance, FLOOR, CF_DEPTH)
    if ACTIVATION == 0:
        x, pdf, s0, s1, s2 = small_tail(mean, std, std_error, CF_DEPTH)
        phi = at_least(mean, 0.0) + std * s1
    else:
        eps = 0.0
        if ACTIVATION == 1:
            eps = compute(tl.load(slope_ptr), CF_DEPTH)
        phi, _, _, _, _, _ = family_partials(mean, std, std_error, eps, ACTIVATION, CF_DEPTH)
    store_with_ones_column(out_ptr, phi.to(m_in.dtype), r, c, rows, width, BIAS)
