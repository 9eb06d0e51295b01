"""``@triton.jit`` device helpers shared by the element-wise tile kernels.

The bias + GeLU and bias + dropout + add kernels walk the same grid (``launch.tile_grid``):
axis 1 picks a column block, axis 0 a contiguous run of rows that the program loops over
BLOCK_M at a time. These helpers are that walk's bookkeeping, inlined into each kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def column_block(N, BLOCK_N: tl.constexpr):
    """(cols, col_mask): this program's BLOCK_N columns of N and which of them exist."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < N


@triton.jit
def bias_block(Bias, cols, col_mask, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The bias at ``cols`` in fp32, or zeros when HAS_BIAS is False (Bias not read)."""
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)
    return b


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
