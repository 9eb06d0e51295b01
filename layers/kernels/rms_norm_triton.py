"""RMSNorm over the last dim (Llama): Triton kernels, launchers and autograd Function.

y = x / sqrt(mean(x²) + eps) · w. One program normalizes one row in fp32 and saves the
row's 1/rms (fp32, 4 bytes a row) for backward, which then needs only x, w and that.
Backward is LayerNorm's structure without the mean: a fixed number of programs (one per
SM) each loop over a contiguous run of rows, write dx, and keep fp32 partial sums of the
weight gradient in registers, stored as one row of a [programs, N] buffer; one small sum
over programs gives dw (no atomics, and a result that does not depend on scheduling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layers.kernels import jit_helpers as jh
from layers.kernels import launch


@triton.jit
def _rms_norm_fwd_kernel(
    X,  # [M, N] input rows, row stride stride_x
    Y,  # [M, N] out: normalized rows (contiguous)
    W,  # [N] weight (not read when HAS_WEIGHT is False)
    Rstd,  # [M] fp32 out: row 1/sqrt(mean(x²) + eps), for backward
    stride_x,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols, mask = jh.row_columns(N, BLOCK_N)
    x = jh.load_row(X, row, stride_x, cols, mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    jh.store_row(Y, row, N, cols, mask, y)
    tl.store(Rstd + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    X,  # [M, N] forward input rows, row stride stride_x
    DY,  # [M, N] gradient of the output (contiguous)
    DX,  # [M, N] out: gradient of the input (contiguous)
    W,  # [N] weight (not read when HAS_WEIGHT is False)
    Rstd,  # [M] fp32 row 1/rms from forward
    DW_partial,  # [programs, N] fp32 out: this program's sum over its rows of dy * xhat
    stride_x,
    M,
    N,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols, mask = jh.row_columns(N, BLOCK_N)
    w = jh.optional_vector(W, cols, mask, 1.0, HAS_WEIGHT)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start, n_rows = jh.program_rows(M, rows_per_program)
    for i in range(0, n_rows):
        row = row_start + i
        x = jh.load_row(X, row, stride_x, cols, mask)
        dy = jh.load_row(DY, row, N, cols, mask)
        rstd = tl.load(Rstd + row)
        xhat = x * rstd  # masked columns load 0, so they add nothing to the sums below
        wdy = w * dy
        # dx = rstd * (wdy - xhat * mean(wdy * xhat)): the second term is d rstd / dx
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)) * rstd
        jh.store_row(DX, row, N, cols, mask, dx)
        dw += dy * xhat
    if HAS_WEIGHT:
        tl.store(DW_partial + pid * N + cols, dw, mask=mask)


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalize ``x`` over its last dim and scale by ``weight``: (y, rstd [M] fp32).

    y has the promoted dtype of x and weight, like ``weight * normed`` in torch.
    """
    x2d = launch.checked_rows(_rms_norm_fwd_kernel, x, 1, weight=weight)
    m, n = x2d.shape
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y.view(x.shape), rstd
    block_n, num_warps = launch.row_settings(n)
    _rms_norm_fwd_kernel[(m,)](
        x2d,
        y,
        x if weight is None else weight,
        rstd,
        x2d.stride(0),
        n,
        eps,
        HAS_WEIGHT=weight is not None,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y.view(x.shape), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients (dx, dweight) of ``rms_norm_forward``; dweight None without a weight."""
    x2d, dy2d, dx = launch.grad_rows(dy, x)
    m, n = x2d.shape
    block_n, num_warps = launch.row_settings(n)
    programs, rows_per_program = launch.row_groups(m, 1, x.device)
    dw_partial = launch.partial_sums(programs, n, x.device)
    if m > 0:
        _rms_norm_bwd_kernel[(programs,)](
            x2d,
            dy2d,
            dx,
            x if weight is None else weight,
            rstd,
            dw_partial,
            x2d.stride(0),
            m,
            n,
            rows_per_program,
            HAS_WEIGHT=weight is not None,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    # Second stage of the reduction: programs x N fp32, small.
    return dx.view(x.shape), launch.reduce_partial_sums(dw_partial, weight)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dim; saves x, weight and the fp32 row 1/rms (not the output)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None
