"""``@triton.jit`` device helpers shared by the kernels: the bookkeeping of their grids.

Row kernels (LayerNorm, RMSNorm) hold whole rows of N columns per program (BLOCK_N >= N):
forward one row per program, backward a contiguous run of ``rows_per_program`` rows. Their
loads come back in fp32 with the masked columns 0, so they add nothing to a row's sums.

Tile kernels (bias + GeLU, bias + dropout + add) walk the grid of ``launch.tile_grid``:
axis 1 picks a column block, axis 0 a contiguous run of rows that the program loops over
BLOCK_M at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def optional_vector(V, cols, mask, default, HAS_VECTOR: tl.constexpr):
    """The [N] vector V (a weight or bias) at ``cols`` in fp32, or ``default`` when
    HAS_VECTOR is False (V not read)."""
    v = default
    if HAS_VECTOR:
        v = tl.load(V + cols, mask=mask, other=0.0).to(tl.float32)
    return v


# Row kernels.


@triton.jit
def row_columns(N, BLOCK_N: tl.constexpr):
    """(cols, mask): the BLOCK_N columns of a row and which of the N exist."""
    cols = tl.arange(0, BLOCK_N)
    return cols, cols < N


@triton.jit
def load_row(X, row, stride, cols, mask):
    """Row ``row`` of X (row stride ``stride``) in fp32, 0 in the masked columns."""
    return tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_row(Y, row, N, cols, mask, y):
    """Store ``y`` as row ``row`` of the contiguous [M, N] Y, in Y's dtype."""
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def program_rows(M, rows_per_program):
    """(row_start, n_rows): this program's run of rows of M, as int64 offsets."""
    row_start = tl.program_id(0).to(tl.int64) * rows_per_program
    return row_start, tl.minimum(rows_per_program, M - row_start)


@triton.jit
def store_partial_sums(P, N, cols, mask, s):
    """Store the fp32 column sums ``s`` as this program's row of the [programs, N] buffer
    P: the first stage of a weight or bias gradient's two-stage reduction."""
    tl.store(P + tl.program_id(0) * N + cols, s, mask=mask)


# Tile kernels.


@triton.jit
def column_block(N, BLOCK_N: tl.constexpr):
    """(cols, col_mask): this program's BLOCK_N columns of N and which of them exist."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < N


@triton.jit
def row_span(M, rows_per_program):
    """(row_start, row_end): this program's run of rows, clipped to M (int64 offsets)."""
    row_start = tl.program_id(0).to(tl.int64) * rows_per_program
    return row_start, tl.minimum(row_start + rows_per_program, M)


@triton.jit
def row_tile(r, row_end, col_mask, BLOCK_M: tl.constexpr):
    """(rows, mask): the BLOCK_M rows from ``r`` and the [BLOCK_M, BLOCK_N] in-bounds mask."""
    rows = r + tl.arange(0, BLOCK_M)
    return rows, (rows < row_end)[:, None] & col_mask[None, :]


@triton.jit
def load_tile(X, rows, stride, cols, mask):
    """The [BLOCK_M, BLOCK_N] tile of X at ``rows`` × ``cols`` (row stride ``stride``) in
    fp32, 0 where masked."""
    return tl.load(X + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(Y, rows, N, cols, mask, y):
    """Store the tile ``y`` at ``rows`` × ``cols`` of the contiguous [M, N] Y, in Y's dtype."""
    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bias_columns(Bias, N, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(cols, col_mask, b): this program's column block and the [N] Bias at it in fp32,
    zeros when HAS_BIAS is False, for the kernels that add a bias to every tile row."""
    cols, col_mask = column_block(N, BLOCK_N)
    b = optional_vector(Bias, cols, col_mask, tl.zeros((BLOCK_N,), dtype=tl.float32), HAS_BIAS)
    return cols, col_mask, b


@triton.jit
def load_biased_tile(X, rows, stride, cols, mask, b):
    """``load_tile`` of X plus the column vector ``b`` (from ``bias_columns``) on every row."""
    return load_tile(X, rows, stride, cols, mask) + b[None, :]


@triton.jit
def store_grad_tile(DX, rows, N, cols, mask, dx):
    """Store the gradient tile ``dx`` (0 where masked) and return its fp32 column sums, this
    tile's share of the bias gradient."""
    store_tile(DX, rows, N, cols, mask, dx)
    return tl.sum(dx, axis=0)


@triton.jit
def store_bias_grad(DB_partial, N, cols, col_mask, db, HAS_BIAS: tl.constexpr):
    """``store_partial_sums`` of the accumulated bias gradient ``db``; nothing without a bias."""
    if HAS_BIAS:
        store_partial_sums(DB_partial, N, cols, col_mask, db)
