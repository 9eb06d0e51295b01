"""SwiGLU, silu(gate) · up: Triton kernels, launchers and autograd Function.

The input is the MLP's gate/up projection output as one tensor whose columns interleave
the two, ``[..., (f two)]``: gate_i at column 2i, up_i at 2i+1 (the layout of
``layers.mlp``'s fused column-parallel weight). Forward reads it once and writes the
f-wide product; backward recomputes silu from the saved input (autograd holds it anyway)
and writes dgate and dup interleaved the same way, straight into the input's gradient, so
no gate/up split, copy or gradient concatenation happens around the kernel. Element-wise:
no reduction, so a plain grid of tiles.

Gate and up are read as two loads with column stride 2; both touch the same cache lines,
so the input still crosses DRAM once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layers.kernels.launch import as_rows, check_float, check_launchable, tile_settings


@triton.jit
def _load_gate_up(
    GU,  # [M, 2F] interleaved gate/up (gate at even, up at odd columns), row stride stride_gu
    M,
    F,
    stride_gu,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """This program's [BLOCK_M, BLOCK_N] tile: (rows, cols, mask, gate fp32, up fp32)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    gate_ptr = GU + rows[:, None] * stride_gu + 2 * cols[None, :]
    g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + 1, mask=mask, other=0.0).to(tl.float32)
    return rows, cols, mask, g, u


@triton.jit
def _swiglu_fwd_kernel(
    GU,  # [M, 2F] interleaved gate/up (gate at even, up at odd columns), row stride stride_gu
    Y,  # [M, F] out: silu(gate) * up (contiguous)
    M,
    F,
    stride_gu,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask, g, u = _load_gate_up(GU, M, F, stride_gu, BLOCK_M, BLOCK_N)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * F + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY,  # [M, F] gradient of the output (contiguous)
    GU,  # [M, 2F] saved interleaved gate/up input, row stride stride_gu
    DGU,  # [M, 2F] out: dgate at even, dup at odd columns (contiguous)
    M,
    F,
    stride_gu,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask, g, u = _load_gate_up(GU, M, F, stride_gu, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    # d silu(g) / dg = s + g s (1 - s) = s (1 + g (1 - s))
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    dgate_ptr = DGU + rows[:, None] * (2 * F) + 2 * cols[None, :]
    tl.store(dgate_ptr, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + 1, du.to(DGU.dtype.element_ty), mask=mask)


def _grid(m: int, f: int) -> tuple[tuple[int, int], int, int, int]:
    """(grid, BLOCK_M, BLOCK_N, warps): row tiles on axis 0 (unbounded), column tiles on 1."""
    block_m, block_n, num_warps = tile_settings(m, f)
    return (triton.cdiv(m, block_m), triton.cdiv(f, block_n)), block_m, block_n, num_warps


def _check_gate_up(gate_up: torch.Tensor) -> None:
    check_float("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 or not gate_up.shape[-1]:
        raise ValueError(
            "gate_up must interleave gate and up columns in an even, non-empty last dim, got shape "
            f"{tuple(gate_up.shape)}"
        )


def swiglu_forward(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of interleaved ``[..., 2f]`` columns → ``[..., f]``, in gate_up's dtype."""
    _check_gate_up(gate_up)
    check_launchable(_swiglu_fwd_kernel, gate_up)
    gu2d = as_rows(gate_up)
    m, f = gu2d.shape[0], gu2d.shape[1] // 2
    y = torch.empty((m, f), dtype=gate_up.dtype, device=gate_up.device)
    if y.numel() > 0:
        grid, block_m, block_n, num_warps = _grid(m, f)
        _swiglu_fwd_kernel[grid](
            gu2d,
            y,
            m,
            f,
            gu2d.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y.view(*gate_up.shape[:-1], f)


def swiglu_backward(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """Gradient of ``swiglu_forward`` with respect to gate_up: dgate and dup interleaved."""
    _check_gate_up(gate_up)
    f = gate_up.shape[-1] // 2
    if dy.shape != (*gate_up.shape[:-1], f):
        raise ValueError(f"dy {tuple(dy.shape)} must be gate_up {tuple(gate_up.shape)} halved")
    gu2d = as_rows(gate_up)
    dy2d = dy.reshape(-1, f).contiguous()
    m = gu2d.shape[0]
    dgu = torch.empty((m, 2 * f), dtype=gate_up.dtype, device=gate_up.device)
    if dgu.numel() > 0:
        grid, block_m, block_n, num_warps = _grid(m, f)
        _swiglu_bwd_kernel[grid](
            dy2d,
            gu2d,
            dgu,
            m,
            f,
            gu2d.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return dgu.view(gate_up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) · up of interleaved gate/up columns; saves only the input."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return swiglu_backward(dy, gate_up)
