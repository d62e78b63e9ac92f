"""Triton kernels of the last hidden layer's tail pass and of the one-output Normal ELBO's rows:
the CUDA side of ``cfbnn::relu_tail`` (:mod:`cfbnn_cli.moments.tail_ops`) and of the ELBO's
step operators (:mod:`cfbnn_cli.moments.elbo_ops`).

The tail pass (paper eqs. (7)-(9) for one output) reduces the moments of the ReLU family (ReLU,
leaky ReLU, ReLU^2: the ``ACTIVATION`` constant) of an ``(rows, H)``
block of pre-activation means and *variances* against three weight vectors without writing
``Phi``, ``Upsilon`` or ``Var`` to memory:

    mean_sum_r   = sum_c Phi_rc w_phi_c
    spread_sum_r = sum_c Var_rc w_var_c + Upsilon_rc w_second_c

Forward: one program per block of rows, looping over the columns (a row's sum never leaves
the program: no atomics, the same result at every launch). Backward: one program per
``(row block, column block)`` tile; the tile's column sums go to a float64 buffer of one row
per row block, summed afterwards (again no atomics). The moments' numerics are those of
:mod:`.triton_kernels` (:func:`~.triton_kernels.family_moments`, in the inputs' dtype); a
tile's row or column sums too, the tiles' added in float64 whatever the input dtype (float32 tile
sums over 128 columns or 16 rows: 1.3e-7 of the largest sum on a (256, 1000) pass).
"""

import math

import triton
import triton.language as tl

from .triton_kernels import compute, family_moments, relu_core, std_from_variance
from .triton_kl_kernels import float64_accumulators, fold_kl, kl_block, kl_from_table, load_float64

FORWARD_ROWS, FORWARD_COLUMNS = 4, 128  # relu_tail_kernel's tile, with its gradients or not
# relu_tail_backward_kernel's tile: 512 elements, 4 a thread as the forward's, no register spills on
# sm_90a (a 32 x 64 tile spills 156 bytes at float32, 1.7-2.4 kB at float64)
BACKWARD_ROWS, BACKWARD_COLUMNS = 16, 32
ROW_BLOCK = 1024
# a module global a kernel reads must be a tl.constexpr: the compiler refuses a plain float (the
# interpreter does not)
HALF_LOG_2PI = tl.constexpr(0.5 * math.log(2.0 * math.pi))


# A tail pass's operands travel as one tuple, ``tail = (mean_ptr, variance_ptr, w_phi_ptr, w_var_ptr,
# w_second_ptr, slope_ptr)``: the pre-activations' means and variances ``(rows, width)``, the three
# weight vectors ``(width,)`` and the leaky ReLU's slope (float64; the other kinds never read it).


@triton.jit
def load_tile(tail, r, c, r_in, c_in, width, FLOOR: tl.constexpr, CF_DEPTH: tl.constexpr):
    """An ``(rows, columns)`` tile's means (in the results' arithmetic:
    :func:`~.triton_kernels.compute`), standard deviations and their relative errors
    (:func:`~.triton_kernels.std_from_variance`: the variance floored at ``FLOOR``, the dtype's
    smallest normal number, before its square root, as the CPU kernel ``tail_pass``), offsets and
    mask; masked lanes read mean 0, variance 1 (finite moments)."""
    inside = r_in[:, None] & c_in[None, :]
    offsets = r[:, None] * width + c[None, :]
    mean = compute(tl.load(tail[0] + offsets, mask=inside, other=0.0), CF_DEPTH)
    variance = compute(tl.load(tail[1] + offsets, mask=inside, other=1.0), CF_DEPTH)
    std, std_error = std_from_variance(variance, FLOOR, CF_DEPTH)
    return mean, std, std_error, offsets, inside


@triton.jit
def load_weights(tail, c, c_in, CF_DEPTH: tl.constexpr):
    """The three weight vectors at columns ``c`` (as :func:`load_tile`; 0 outside: they add nothing)."""
    w_phi = compute(tl.load(tail[2] + c, mask=c_in, other=0.0), CF_DEPTH)
    w_var = compute(tl.load(tail[3] + c, mask=c_in, other=0.0), CF_DEPTH)
    w_second = compute(tl.load(tail[4] + c, mask=c_in, other=0.0), CF_DEPTH)
    return w_phi, w_var, w_second


@triton.jit
def tail_slope(tail, CF_DEPTH: tl.constexpr, ACTIVATION: tl.constexpr):
    """The leaky ReLU's slope (0 for the other kinds, whose launches pass any pointer)."""
    eps = 0.0
    if ACTIVATION == 1:
        eps = compute(tl.load(tail[5]), CF_DEPTH)
    return eps


@triton.jit
def tail_row_sums(tail, r, r_in, width, FLOOR, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CF_DEPTH, ACTIVATION):
    """Rows ``r``'s two sums (float64), looping over the columns (the variance floored:
    :func:`load_tile`) for the ReLU family's ``ACTIVATION`` (:func:`~.triton_kernels.family_moments`)."""
    eps = tail_slope(tail, CF_DEPTH, ACTIVATION)
    acc_mean = tl.zeros([BLOCK_R], dtype=tl.float64)
    acc_spread = tl.zeros([BLOCK_R], dtype=tl.float64)
    for c0 in range(0, width, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_in = c < width
        mean, std, std_error, _, _ = load_tile(tail, r, c, r_in, c_in, width, FLOOR, CF_DEPTH)
        if ACTIVATION == 0:
            phi, ups, var = relu_core(mean, std, std_error, CF_DEPTH)
        else:
            zero = tl.zeros_like(mean)
            phi, ups, var, _, _ = family_moments(mean, std, std_error, eps, zero, zero, zero, ACTIVATION, CF_DEPTH)
        w_phi, w_var, w_second = load_weights(tail, c, c_in, CF_DEPTH)
        # the tile's sums in the results' arithmetic, the tiles' in float64
        acc_mean += tl.sum(phi * w_phi[None, :], axis=1).to(tl.float64)
        acc_spread += tl.sum(var * w_var[None, :] + ups * w_second[None, :], axis=1).to(tl.float64)
    return acc_mean, acc_spread


@triton.jit
def tail_gradient_tile(tail, u, k, r, c, r_in, width, gradients, FLOOR, CF_DEPTH, ACTIVATION):
    """For row gradients ``u = dL/d mean_sum``, ``k = dL/d spread_sum`` (rows outside: 0), a tile's
    ``dL/d mean`` and ``dL/d variance`` (:func:`~.triton_kernels.family_moments` with ``dL/dPhi = u
    w_phi``, ``dL/dVar = k w_var``, ``dL/dUps = k w_second``) into ``gradients = (g_mean_ptr,
    g_variance_ptr, partial_row_ptr)``, and its column sums ``(sum_r u Phi, sum_r k Var, sum_r k
    Ups)`` into ``partial_row[0:3, columns]`` (float64)."""
    g_mean_ptr, g_variance_ptr, partial_row_ptr = gradients
    c_in = c < width
    mean, std, std_error, offsets, inside = load_tile(tail, r, c, r_in, c_in, width, FLOOR, CF_DEPTH)
    w_phi, w_var, w_second = load_weights(tail, c, c_in, CF_DEPTH)
    g_phi, g_ups, g_var = u[:, None] * w_phi[None, :], k[:, None] * w_second[None, :], k[:, None] * w_var[None, :]
    # the small tail once, for the moments and the derivatives
    eps = tail_slope(tail, CF_DEPTH, ACTIVATION)
    phi, ups, var, g_mean, g_std = family_moments(mean, std, std_error, eps, g_phi, g_ups, g_var, ACTIVATION, CF_DEPTH)
    dtype = g_mean_ptr.dtype.element_ty
    tl.store(g_mean_ptr + offsets, g_mean.to(dtype), mask=inside)
    tl.store(g_variance_ptr + offsets, (0.5 * g_std / std).to(dtype), mask=inside)
    # the tile's sums in the results' arithmetic, the row blocks' in float64 (``partial``)
    tl.store(partial_row_ptr + c, tl.sum(u[:, None] * phi, axis=0).to(tl.float64), mask=c_in)
    tl.store(partial_row_ptr + width + c, tl.sum(k[:, None] * var, axis=0).to(tl.float64), mask=c_in)
    tl.store(partial_row_ptr + 2 * width + c, tl.sum(k[:, None] * ups, axis=0).to(tl.float64), mask=c_in)


@triton.jit
def relu_tail_backward_kernel(
    tail,
    row_u_ptr,
    row_k_ptr,
    g_mean_ptr,
    g_variance_ptr,
    partial_ptr,
    rows,
    width,
    FLOOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CF_DEPTH: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """One ``(row block, column block)`` tile of the tail pass's vector-Jacobian product
    (:func:`tail_gradient_tile`), its column sums into ``partial[row_block, 0:3, columns]``."""
    row_block = tl.program_id(0)
    r = row_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_in = r < rows
    u = compute(tl.load(row_u_ptr + r, mask=r_in, other=0.0), CF_DEPTH)
    k = compute(tl.load(row_k_ptr + r, mask=r_in, other=0.0), CF_DEPTH)
    gradients = (g_mean_ptr, g_variance_ptr, partial_ptr + row_block.to(tl.int64) * 3 * width)
    tail_gradient_tile(tail, u, k, r, c, r_in, width, gradients, FLOOR, CF_DEPTH, ACTIVATION)


@triton.jit
def relu_tail_kernel(
    tail,
    sums,
    y_ptr,
    loc_ptr,
    log_precision_ptr,
    g_mean_ptr,
    g_variance_ptr,
    partial_ptr,
    rows,
    width,
    scale: tl.float64,
    FLOOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CF_DEPTH: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BIAS: tl.constexpr,
    GRADIENTS: tl.constexpr,
):
    """A block of ``BLOCK_R`` rows: their two sums into ``sums = (mean_sum_ptr, spread_sum_ptr)``
    (:func:`tail_row_sums`). With ``GRADIENTS``, then the Normal likelihood's row gradients at
    ``dL/d ELBO = 1`` (``u = scale tau residual``, ``k = -scale tau / 2``, the residual as
    :func:`normal_rows_kernel` takes it) and, column block by column block, the tail pass's
    vector-Jacobian product for them (:func:`tail_gradient_tile`; without, the pointers after
    ``sums`` are not read)."""
    row_block = tl.program_id(0)
    r = row_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_in = r < rows
    acc_mean, acc_spread = tail_row_sums(tail, r, r_in, width, FLOOR, BLOCK_R, BLOCK_C, CF_DEPTH, ACTIVATION)
    dtype = sums[0].dtype.element_ty
    mean_sum = acc_mean.to(dtype)
    tl.store(sums[0] + r, mean_sum, mask=r_in)
    tl.store(sums[1] + r, acc_spread.to(dtype), mask=r_in)
    if GRADIENTS:
        residual = load_float64(y_ptr + r, r_in) - mean_sum.to(tl.float64)
        if BIAS:
            residual -= tl.load(loc_ptr + width).to(tl.float64)
        unit = scale * tl.exp(tl.load(log_precision_ptr).to(tl.float64))
        u = compute(tl.where(r_in, unit * residual, 0.0).to(dtype), CF_DEPTH)
        k = compute(tl.where(r_in, -0.5 * unit, 0.0).to(dtype), CF_DEPTH)
        gradients = (g_mean_ptr, g_variance_ptr, partial_ptr + row_block.to(tl.int64) * 3 * width)
        for c0 in range(0, width, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            tail_gradient_tile(tail, u, k, r, c, r_in, width, gradients, FLOOR, CF_DEPTH, ACTIVATION)


@triton.jit
def augment_block(x_ptr, augmented_ptr, squared_ptr, block, rows, columns, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``block`` of ``BLOCK`` elements of ``([x, 1], [x^2, 1])`` (with ``BIAS``; else ``(x,
    x^2)``) of an ``(rows, columns)`` input: a layer's input with its bias column and its square
    (the bias's 1 stays 1)."""
    width = columns + BIAS
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < rows * width
    row = offsets // width
    column = offsets - row * width
    data = inside & (column < columns)
    x = tl.load(x_ptr + row * columns + column, mask=data, other=1.0)
    tl.store(augmented_ptr + offsets, x, mask=inside)
    tl.store(squared_ptr + offsets, x * x, mask=inside)


@triton.jit
def augment_pair_kernel(x_ptr, augmented_ptr, squared_ptr, rows, columns, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``([x, 1], [x^2, 1])`` of an ``(rows, columns)`` input in one pass (:func:`augment_block`)."""
    augment_block(x_ptr, augmented_ptr, squared_ptr, tl.program_id(0), rows, columns, BIAS, BLOCK)


@triton.jit
def outer_layers_kernel(
    x_ptr,
    augmented_ptr,
    squared_ptr,
    loc_ptr,
    log_scale_ptr,
    variance_ptr,
    output_loc_ptr,
    output_log_scale_ptr,
    output_variance_ptr,
    output_loc_square_ptr,
    sums_ptr,
    rows,
    columns,
    count,
    output_count,
    blocks,
    output_blocks,
    BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Three independent passes in one launch, by program: the first layer's KL blocks
    (:func:`~.triton_kl_kernels.kl_block`, ``exp(2 log_scale)`` written), then the one-output
    layer's (``loc^2`` too), their rows of the KL sums table in that order, then the blocks of
    ``([x, 1], [x^2, 1])`` (:func:`augment_block`)."""
    block = tl.program_id(0)
    if block < blocks:
        kl_block(loc_ptr, log_scale_ptr, variance_ptr, variance_ptr, sums_ptr + 3 * block, block, count, False, BLOCK)
    elif block < blocks + output_blocks:
        kl_block(
            output_loc_ptr,
            output_log_scale_ptr,
            output_variance_ptr,
            output_loc_square_ptr,
            sums_ptr + 3 * block,
            block - blocks,
            output_count,
            True,
            BLOCK,
        )
    else:
        augment_block(x_ptr, augmented_ptr, squared_ptr, block - blocks - output_blocks, rows, columns, BIAS, BLOCK)


@triton.jit
def normal_rows_kernel(
    mean_sum_ptr,
    spread_sum_ptr,
    y_ptr,
    output_loc_ptr,
    output_log_scale_ptr,
    log_precision_ptr,
    kl_sums_ptr,
    kl_ptr,
    residual_ptr,
    squares_ptr,
    out_ptr,
    rows,
    width,
    parts,
    prior_variance: tl.float64,
    log_prior_variance: tl.float64,
    scale: tl.float64,
    PER_ROW: tl.constexpr,
    HAS_KL: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The Normal likelihood's rows (paper eq. (7), one output): ``residual = y - mean_sum - b`` and
    ``squares = spread_sum + Var b + residual^2`` (``b`` the one-output layer's bias weight, column
    ``width`` of its ``loc`` / ``log_scale``, when ``BIAS``), float64, stored for the backward pass.

    With ``PER_ROW`` (one program per block of rows) ``out_r = ELL_r = log(tau)/2 - log(2 pi)/2 -
    tau/2 squares_r``; else (one program, the rows summed in float64 in a fixed order) the ELBO
    (eq. (4)) ``out = scale sum_r ELL_r - KL``, the KL finished here from the ``parts`` rows of the
    KL sums table ``kl_sums`` (:func:`~.triton_kl_kernels.kl_from_table`), plus ``kl[0]`` with
    ``HAS_KL``."""
    log_precision = tl.load(log_precision_ptr).to(tl.float64)
    if PER_ROW:
        start = tl.program_id(0).to(tl.int64) * BLOCK
        stop = start + BLOCK
    else:
        start = 0
        stop = rows
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for r0 in range(start, stop, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        r_in = r < rows
        residual = load_float64(y_ptr + r, r_in) - load_float64(mean_sum_ptr + r, r_in)
        squares = load_float64(spread_sum_ptr + r, r_in)
        if BIAS:
            residual -= tl.load(output_loc_ptr + width).to(tl.float64)
            squares += tl.exp(2.0 * tl.load(output_log_scale_ptr + width).to(tl.float64))
        squares += residual * residual
        tl.store(residual_ptr + r, residual.to(residual_ptr.dtype.element_ty), mask=r_in)
        tl.store(squares_ptr + r, squares.to(squares_ptr.dtype.element_ty), mask=r_in)
        if PER_ROW:
            ell = 0.5 * log_precision - HALF_LOG_2PI - 0.5 * tl.exp(log_precision) * squares
            tl.store(out_ptr + r, ell.to(out_ptr.dtype.element_ty), mask=r_in)
        else:
            total += tl.where(r_in, squares, 0.0)
    if not PER_ROW:
        kl = kl_from_table(kl_sums_ptr, parts, prior_variance, log_prior_variance, BLOCK)
        if HAS_KL:
            kl += tl.load(kl_ptr).to(tl.float64)
        ell = rows * (0.5 * log_precision - HALF_LOG_2PI) - 0.5 * tl.exp(log_precision) * tl.sum(total, axis=0)
        tl.store(out_ptr, (scale * ell - kl).to(out_ptr.dtype.element_ty))


@triton.jit
def normal_rows_backward_kernel(
    grad_ptr,
    residual_ptr,
    squares_ptr,
    log_precision_ptr,
    row_u_ptr,
    row_k_ptr,
    sums_ptr,
    grad_log_precision_ptr,
    rows,
    scale: tl.float64,
    ROW_GRADS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: from ``g_r = scale dL/d ELL_r`` (``grad`` per row with ``ROW_GRADS``, else one
    ``dL/d elbo`` for every row), each row's ``u = dL/d mean_sum = g tau residual`` and ``k = dL/d
    spread_sum = -g tau / 2``, and into ``sums`` (float64) ``(sum u, sum k, dL/d log tau)``: the
    output bias's two gradients (through ``d b = u``, ``d Var b = k``) and the log precision's,
    the last also into ``grad_log_precision`` (its dtype). Rows added in a fixed order."""
    precision = tl.exp(tl.load(log_precision_ptr).to(tl.float64))
    sum_u, sum_k, sum_log_precision = float64_accumulators(BLOCK)
    for r0 in range(0, rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        r_in = r < rows
        if ROW_GRADS:
            g = load_float64(grad_ptr + r, r_in) * scale
        else:
            g = tl.where(r_in, tl.load(grad_ptr).to(tl.float64) * scale, 0.0)
        residual = load_float64(residual_ptr + r, r_in)
        squares = load_float64(squares_ptr + r, r_in)
        u = g * precision * residual
        k = -0.5 * g * precision
        tl.store(row_u_ptr + r, u.to(row_u_ptr.dtype.element_ty), mask=r_in)
        tl.store(row_k_ptr + r, k.to(row_k_ptr.dtype.element_ty), mask=r_in)
        sum_u += u
        sum_k += k
        sum_log_precision += g * (0.5 - 0.5 * precision * squares)
    tl.store(sums_ptr, tl.sum(sum_u, axis=0))
    tl.store(sums_ptr + 1, tl.sum(sum_k, axis=0))
    grad_log_precision = tl.sum(sum_log_precision, axis=0)
    tl.store(sums_ptr + 2, grad_log_precision)
    tl.store(grad_log_precision_ptr, grad_log_precision.to(grad_log_precision_ptr.dtype.element_ty))


@triton.jit
def output_gradients_kernel(
    columns_ptr,
    sums_ptr,
    loc_ptr,
    log_scale_ptr,
    kl_grad_ptr,
    kl_sign: tl.float64,
    data_scale_ptr,
    g_loc_ptr,
    g_log_scale_ptr,
    width,
    prior_variance: tl.float64,
    BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The one-output layer's gradients, its KL folded in: for ``c < width`` ``dL/d loc_c =
    columns_0c + 2 loc_c columns_1c`` and ``dL/d Var_c = columns_2c`` (the tail pass's weights
    ``loc``, ``loc^2``, ``Var``; times ``data_scale[0]`` with ``SCALED``); at the bias column
    ``(sums_0, sums_1)``; then with ``dL/dKL =
    kl_sign kl_grad[0]`` (``-dL/d elbo`` for an ELBO, which subtracts the KL; 0 where no KL is
    folded in) ``g_loc = dL/d loc + dL/dKL loc / s^2`` and
    ``g_log_scale = 2 Var dL/dVar + dL/dKL (Var / s^2 - 1)``."""
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = c < width + BIAS
    column = c < width
    l_in = tl.load(loc_ptr + c, mask=inside, other=0.0)
    loc = l_in.to(tl.float64)
    variance = tl.exp(2.0 * tl.load(log_scale_ptr + c, mask=inside, other=0.0).to(tl.float64))
    on_column = inside & column
    col_phi = tl.load(columns_ptr + c, mask=on_column, other=0.0)
    col_var = tl.load(columns_ptr + width + c, mask=on_column, other=0.0)
    col_second = tl.load(columns_ptr + 2 * width + c, mask=on_column, other=0.0)
    if SCALED:  # column sums taken at a unit upstream gradient (relu_tail_with_gradients_kernel)
        data_scale = tl.load(data_scale_ptr).to(tl.float64)
        col_phi, col_var, col_second = data_scale * col_phi, data_scale * col_var, data_scale * col_second
    d_loc = tl.where(column, col_phi + 2.0 * loc * col_var, tl.load(sums_ptr))
    d_variance = tl.where(column, col_second, tl.load(sums_ptr + 1))
    g_loc, g_log_scale = fold_kl(loc, variance, d_loc, d_variance, kl_sign * tl.load(kl_grad_ptr), prior_variance)
    tl.store(g_loc_ptr + c, g_loc.to(l_in.dtype), mask=inside)
    tl.store(g_log_scale_ptr + c, g_log_scale.to(l_in.dtype), mask=inside)
