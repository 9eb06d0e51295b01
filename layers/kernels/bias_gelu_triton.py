"""GeLU(x + bias): Triton kernels, launchers and autograd Function.

Forward reads x and bias once and writes y; it stores nothing extra. Backward recomputes
x + bias from the saved input (autograd holds x anyway) instead of saving the output or
the sum, and reduces the bias gradient in two stages like the LayerNorm kernels: each
program keeps fp32 column sums over its rows, then one small sum over programs.

The tanh form is evaluated as x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3), which
equals 0.5 x (1 + tanh(u)) without the cancellation of 1 + tanh(u) for negative x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layers.kernels import jit_helpers as jh
from layers.kernels.launch import (
    checked_rows,
    grad_rows,
    grad_tiles,
    reduce_partial_sums,
    tile_output,
    vector_arg,
)

APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _tanh_argument(v):
    """u = sqrt(2/pi) (v + 0.044715 v³), the argument of tanh in GeLU's tanh form."""
    return 0.7978845608028654 * (v + 0.044715 * v * v * v)


@triton.jit
def _bias_gelu_fwd_kernel(
    X,  # [M, N] pre-activation input, row stride stride_x
    Bias,  # [N] bias (not read when HAS_BIAS is False)
    Y,  # [M, N] out: gelu(x + bias) (contiguous)
    M,
    N,
    stride_x,
    rows_per_program,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols, col_mask, b = jh.bias_columns(Bias, N, BLOCK_N, HAS_BIAS)
    row_start, row_end = jh.row_span(M, rows_per_program)
    for r in range(row_start, row_end, BLOCK_M):
        rows, mask = jh.row_tile(r, row_end, col_mask, BLOCK_M)
        v = jh.load_biased_tile(X, rows, stride_x, cols, mask, b)
        if TANH:
            y = v * tl.sigmoid(2.0 * _tanh_argument(v))
        else:
            y = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
        jh.store_tile(Y, rows, N, cols, mask, y)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY,  # [M, N] gradient of the output (contiguous)
    X,  # [M, N] saved pre-activation input, row stride stride_x
    Bias,  # [N] bias (not read when HAS_BIAS is False)
    DX,  # [M, N] out: gradient of x (contiguous)
    DB_partial,  # [row groups, N] fp32 out: this program's column sums of dx
    M,
    N,
    stride_x,
    rows_per_program,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols, col_mask, b = jh.bias_columns(Bias, N, BLOCK_N, HAS_BIAS)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start, row_end = jh.row_span(M, rows_per_program)
    for r in range(row_start, row_end, BLOCK_M):
        rows, mask = jh.row_tile(r, row_end, col_mask, BLOCK_M)
        v = jh.load_biased_tile(X, rows, stride_x, cols, mask, b)
        dy = jh.load_tile(DY, rows, N, cols, mask)
        if TANH:
            # d/dv [v * s(2u)] = s + 2 v s (1 - s) u',  u' = sqrt(2/pi) (1 + 3 * 0.044715 v^2)
            s = tl.sigmoid(2.0 * _tanh_argument(v))
            du = 0.7978845608028654 * (1.0 + 0.134145 * v * v)
            grad = s + 2.0 * v * s * (1.0 - s) * du
        else:
            # d/dv [v Phi(v)] = Phi(v) + v phi(v)
            cdf = 0.5 * (1.0 + tl.erf(v * 0.7071067811865476))
            grad = cdf + v * 0.3989422804014327 * tl.exp(-0.5 * v * v)
        dx = tl.where(mask, dy * grad, 0.0)
        db += jh.store_grad_tile(DX, rows, N, cols, mask, dx)
    jh.store_bias_grad(DB_partial, N, cols, col_mask, db, HAS_BIAS)


def _check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")


def bias_gelu_forward(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh"
) -> torch.Tensor:
    """gelu(x + bias) over the last dim of ``x``, in the promoted dtype of x and bias."""
    _check_approximate(approximate)
    x2d = checked_rows(_bias_gelu_fwd_kernel, x, bias=bias)
    out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    y, tiles = tile_output(x2d, out_dtype)
    if tiles is not None:
        tiles.launch(
            _bias_gelu_fwd_kernel,
            x2d,
            vector_arg(bias, x),
            y,
            *x2d.shape,  # M, N
            x2d.stride(0),
            tiles.rows_per_program,
            HAS_BIAS=bias is not None,
            TANH=approximate == "tanh",
        )
    return y.view(x.shape)


def bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dbias) of ``bias_gelu_forward``, recomputing x + bias; dbias None without bias."""
    x2d, dy2d, dx = grad_rows(dy, x)
    m, n = x2d.shape
    tiles, db_partial = grad_tiles(m, n, x.device)
    tiles.launch(
        _bias_gelu_bwd_kernel,
        dy2d,
        x2d,
        vector_arg(bias, x),
        dx,
        db_partial,
        m,
        n,
        x2d.stride(0),
        tiles.rows_per_program,
        HAS_BIAS=bias is not None,
        TANH=approximate == "tanh",
    )
    return dx.view(x.shape), reduce_partial_sums(db_partial, bias)


class BiasGeluFunction(torch.autograd.Function):
    """gelu(x + bias); saves only the inputs and recomputes x + bias in backward."""

    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, db = bias_gelu_backward(dy, x, bias, ctx.approximate)
        return dx, db, None
