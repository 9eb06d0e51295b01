"""LayerNorm and RMSNorm over the last dim: Triton kernels, launchers and LayerNorm's Function.

One kernel pair serves both norms: RMSNorm (``RMS=True``) is LayerNorm without the mean
(and without a bias); ``layers.kernels.rms_norm_triton`` holds its launchers and Function.

One program normalizes one row, accumulating in fp32 and saving the row's reciprocal
standard deviation, and for LayerNorm its mean (fp32, 4 bytes a row each), for backward.
Backward runs a fixed number of programs (one per SM); each loops over a contiguous run of
rows, writes dx, and keeps fp32 partial sums of the weight and bias gradients in
registers, stored as one row of a [programs, N] buffer. A second reduction over that small
buffer gives dw and db: no atomics, and a result that does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layers.kernels import jit_helpers as jh
from layers.kernels import launch


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # [M, N] input rows, row stride stride_x
    Y,  # [M, N] output rows (contiguous)
    W,  # [N] weight (not read when HAS_WEIGHT is False)
    B,  # [N] bias (not read when HAS_BIAS is False)
    Mean,  # [M] fp32 out: row means, for backward (not written when RMS)
    Rstd,  # [M] fp32 out: row 1/sqrt(var + eps) (RMS: 1/sqrt(mean(x²) + eps)), for backward
    stride_x,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols, mask = jh.row_columns(N, BLOCK_N)
    x = jh.load_row(X, row, stride_x, cols, mask)
    if RMS:
        xc = x  # masked columns load 0, so they add nothing to the sum below
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(Mean + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    jh.store_row(Y, row, N, cols, mask, y)
    tl.store(Rstd + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    X,  # [M, N] forward input rows, row stride stride_x
    DY,  # [M, N] gradient of the output (contiguous)
    DX,  # [M, N] out: gradient of the input (contiguous)
    W,  # [N] weight (not read when HAS_WEIGHT is False)
    Mean,  # [M] fp32 row means from forward (not read when RMS)
    Rstd,  # [M] fp32 row 1/sqrt(var + eps) (RMS: 1/rms) from forward
    DW_partial,  # [programs, N] fp32 out: this program's sum over its rows of dy * xhat
    DB_partial,  # [programs, N] fp32 out: this program's sum over its rows of dy
    stride_x,
    M,
    N,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols, mask = jh.row_columns(N, BLOCK_N)
    w = jh.optional_vector(W, cols, mask, 1.0, HAS_WEIGHT)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start, n_rows = jh.program_rows(M, rows_per_program)
    for i in range(0, n_rows):
        row = row_start + i
        x = jh.load_row(X, row, stride_x, cols, mask)
        dy = jh.load_row(DY, row, N, cols, mask)
        rstd = tl.load(Rstd + row)
        wdy = w * dy
        if RMS:
            xhat = x * rstd  # masked columns load 0, so they add nothing to the sums below
            # dx = rstd * (wdy - xhat * mean(wdy * xhat)): the second term is d rstd / dx
            dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)) * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
            # dx = rstd * (wdy - mean(wdy) - xhat * mean(wdy * xhat))
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        jh.store_row(DX, row, N, cols, mask, dx)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    if HAS_WEIGHT:
        jh.store_partial_sums(DW_partial, N, cols, mask, dw)
    if HAS_BIAS:
        jh.store_partial_sums(DB_partial, N, cols, mask, db)


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    rms: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Normalize ``x`` over its last dim: (y shaped like x in ``out_dtype``, mean [M] or
    None when ``rms``, rstd [M]); ``rms`` skips the mean (RMSNorm, no bias)."""
    x2d = launch.checked_rows(_layer_norm_fwd_kernel, x, weight=weight, bias=bias)
    m, n = x2d.shape
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        block_n, num_warps = launch.row_settings(n)
        _layer_norm_fwd_kernel[(m,)](
            x2d,
            y,
            x if weight is None else weight,
            x if bias is None else bias,
            rstd if mean is None else mean,
            rstd,
            x2d.stride(0),
            n,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            RMS=rms,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y.view(x.shape), mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dx, dweight, dbias) of ``norm_forward`` (``mean`` None: of RMSNorm);
    dweight and dbias None without weight and bias."""
    x2d, dy2d, dx = launch.grad_rows(dy, x)
    m, n = x2d.shape
    block_n, num_warps = launch.row_settings(n)
    programs, rows_per_program = launch.row_groups(m, 1, x.device)
    dw_partial = launch.partial_sums(programs, n, x.device)
    db_partial = None if bias is None else launch.partial_sums(programs, n, x.device)
    if m > 0:
        _layer_norm_bwd_kernel[(programs,)](
            x2d,
            dy2d,
            dx,
            x if weight is None else weight,
            rstd if mean is None else mean,
            rstd,
            dw_partial,
            dw_partial if db_partial is None else db_partial,
            x2d.stride(0),
            m,
            n,
            rows_per_program,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            RMS=mean is None,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    # Second stage of the reduction: programs x N fp32, small.
    dw = launch.reduce_partial_sums(dw_partial, weight)
    return dx.view(x.shape), dw, launch.reduce_partial_sums(db_partial, bias)


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalize ``x`` over its last dim; returns (y shaped like x, mean [M], rstd [M])."""
    return norm_forward(x, weight, bias, eps, rms=False, out_dtype=x.dtype)


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dx, dweight, dbias) of ``layer_norm_forward``; dw/db None without weight/bias."""
    return norm_backward(dy, x, weight, bias, mean, rstd)


class LayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dim; saves x, weight, mean and rstd (not the output)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x, weight, bias, mean, rstd)
        return dx, dw, db, None
