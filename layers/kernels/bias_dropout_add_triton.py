"""residual + dropout(x + bias): Triton kernels, launchers and autograd Function.

The dropout mask is never stored. Element (i, j) of the [M, N] view is kept when
``tl.rand(seed, i * N + j) >= p`` (Philox, counter = flat index), so backward, or a
recomputation of the forward from the same seed, regenerates exactly the same mask from
one int64 seed. The seed is a 1-element device tensor, so drawing it on the GPU needs no
host synchronization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layers.kernels import jit_helpers as jh
from layers.kernels.launch import (
    check_float,
    checked_rows,
    grad_tiles,
    tile_output,
    vector_arg,
)


@triton.jit
def _kept(seed, rows, N, cols, p):
    """The dropout mask of the tile at ``rows`` × ``cols`` of [M, N]: Philox of (seed, flat
    index), so backward regenerates exactly the forward's mask."""
    return tl.rand(seed, rows[:, None] * N + cols[None, :]) >= p


@triton.jit
def _bias_dropout_add_fwd_kernel(
    X,  # [M, N] input of the dropout, row stride stride_x
    Bias,  # [N] bias (not read when HAS_BIAS is False)
    Residual,  # [M, N] residual (contiguous)
    Out,  # [M, N] out: residual + dropout(x + bias) (contiguous)
    Seed,  # [1] int64 Philox seed
    M,
    N,
    stride_x,
    rows_per_program,
    p,  # drop probability
    scale,  # 1 / (1 - p), or 0 when p == 1
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols, col_mask, b = jh.bias_columns(Bias, N, BLOCK_N, HAS_BIAS)
    seed = tl.load(Seed)
    row_start, row_end = jh.row_span(M, rows_per_program)
    for r in range(row_start, row_end, BLOCK_M):
        rows, mask = jh.row_tile(r, row_end, col_mask, BLOCK_M)
        v = jh.load_biased_tile(X, rows, stride_x, cols, mask, b)
        if DROPOUT:
            v = tl.where(_kept(seed, rows, N, cols, p), v * scale, 0.0)
        res = jh.load_tile(Residual, rows, N, cols, mask)
        jh.store_tile(Out, rows, N, cols, mask, res + v)


@triton.jit
def _bias_dropout_add_bwd_kernel(
    DOut,  # [M, N] gradient of the output (contiguous)
    DX,  # [M, N] out: gradient of x, dout * mask * scale (contiguous)
    DB_partial,  # [row groups, N] fp32 out: this program's column sums of dx
    Seed,  # [1] int64 Philox seed of the forward
    M,
    N,
    rows_per_program,
    p,  # drop probability
    scale,  # 1 / (1 - p), or 0 when p == 1
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols, col_mask = jh.column_block(N, BLOCK_N)
    seed = tl.load(Seed)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start, row_end = jh.row_span(M, rows_per_program)
    for r in range(row_start, row_end, BLOCK_M):
        rows, mask = jh.row_tile(r, row_end, col_mask, BLOCK_M)
        dout = jh.load_tile(DOut, rows, N, cols, mask)
        keep = _kept(seed, rows, N, cols, p) & mask
        dx = tl.where(keep, dout * scale, 0.0)
        db += jh.store_grad_tile(DX, rows, N, cols, mask, dx)
    jh.store_bias_grad(DB_partial, N, cols, col_mask, db, HAS_BIAS)


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def bias_dropout_add_forward(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    dropout: bool = True,
) -> torch.Tensor:
    """residual + dropout(x + bias) with the Philox mask of ``seed`` ([1] int64 on x's device).

    ``dropout=False`` (eval, or p == 0) adds without a mask. The output has the promoted
    dtype of x, bias and residual.
    """
    check_float("residual", residual)
    if x.dim() == 0 or residual.shape != x.shape or residual.device != x.device:
        raise ValueError(
            f"residual {tuple(residual.shape)} on {residual.device} must match "
            f"x {tuple(x.shape)} on {x.device}, with at least one dim"
        )
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if seed.shape != (1,) or seed.dtype != torch.int64 or seed.device != x.device:
        raise ValueError(f"seed must be a [1] int64 tensor on {x.device}, got {seed!r}")
    x2d = checked_rows(_bias_dropout_add_fwd_kernel, x, bias=bias)
    m, n = x2d.shape
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    if bias is not None:
        out_dtype = torch.promote_types(out_dtype, bias.dtype)
    out, tiles = tile_output(x2d, out_dtype)
    res2d = residual.reshape(m, n).contiguous()
    if tiles is not None:
        tiles.launch(
            _bias_dropout_add_fwd_kernel,
            x2d,
            vector_arg(bias, x),
            res2d,
            out,
            seed,
            m,
            n,
            x2d.stride(0),
            tiles.rows_per_program,
            p,
            _scale(p),
            HAS_BIAS=bias is not None,
            DROPOUT=dropout and p > 0.0,
        )
    return out.view(x.shape)


def bias_dropout_add_backward(
    dout: torch.Tensor, p: float, seed: torch.Tensor, has_bias: bool, x_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dbias in fp32) of ``bias_dropout_add_forward`` with dropout, regenerating the mask."""
    n = dout.shape[-1]
    dout2d = dout.reshape(-1, n).contiguous()
    m = dout2d.shape[0]
    dx = torch.empty((m, n), dtype=x_dtype, device=dout.device)
    tiles, db_partial = grad_tiles(m, n, dout.device)
    tiles.launch(
        _bias_dropout_add_bwd_kernel,
        dout2d,
        dx,
        db_partial,
        seed,
        m,
        n,
        tiles.rows_per_program,
        p,
        _scale(p),
        HAS_BIAS=has_bias,
    )
    return dx.view(dout.shape), db_partial.sum(dim=0) if has_bias else None


class BiasDropoutAddFunction(torch.autograd.Function):
    """residual + dropout(x + bias); saves only the seed (8 bytes), never a mask."""

    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, dropout):
        ctx.save_for_backward(seed)
        ctx.p, ctx.dropout = p, dropout and p > 0.0
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, residual.dtype)
        return bias_dropout_add_forward(x, bias, residual, p, seed, dropout)

    @staticmethod
    def backward(ctx, dout):
        (seed,) = ctx.saved_tensors
        x_dtype, bias_dtype, residual_dtype = ctx.dtypes
        if ctx.dropout:
            dx, db = bias_dropout_add_backward(dout, ctx.p, seed, bias_dtype is not None, x_dtype)
        else:  # no mask: the gradient passes straight through to x and bias
            dx = dout.to(x_dtype)
            db = (
                None
                if bias_dtype is None
                else dout.reshape(-1, dout.shape[-1]).sum(0, dtype=torch.float32)
            )
        db = None if db is None else db.to(bias_dtype)
        return dx, db, dout.to(residual_dtype), None, None, None
