"""Launch-side helpers shared by the Triton kernels: block sizes, grids, input checks.

This module imports triton; the public wrappers import it (and the kernel modules) only
when a Triton path runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from layers.kernels.dispatch import KERNEL_DTYPES, interpreting


def _interpreter_index_of_one_element_arrays() -> None:
    """Let the Triton interpreter use a runtime scalar as a ``range`` bound under NumPy 2.5.

    The interpreter holds a kernel's scalar arguments as one-element 1-D arrays and, before
    triton 3.7, converted them with ``int(array)``, which NumPy 2.5 refuses ("only
    0-dimensional arrays can be converted to Python scalars"): every kernel with a loop
    over a runtime bound then fails. Newer triton squeezes the array first; this does the
    same for older ones, and only when the interpreter runs and NumPy refuses.
    """
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.ones(1, dtype=np.int32))
        return
    except TypeError:
        pass
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _interpreter_index_of_one_element_arrays()

# The widest row one program keeps in registers (elements); wider rows need the torch path.
MAX_FUSED_SIZE = 65536
# Elements per program in the element-wise kernels: 16 per thread at 8 warps.
TILE_ELEMENTS = 4096
# Programs of a "persistent" reduction when not on CUDA (the interpreter): few, to keep
# it fast, but more than one so the second stage of the reductions is exercised.
INTERPRETER_PROGRAMS = 4


def row_settings(n_cols: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for kernels that hold one whole row of ``n_cols`` per program."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_FUSED_SIZE:
        raise ValueError(
            f"rows of {n_cols} elements exceed the fused kernels' limit of {MAX_FUSED_SIZE}; "
            "use backend='torch'"
        )
    if block >= 32768:
        return block, 32
    if block >= 8192:
        return block, 16
    if block >= 2048:
        return block, 8
    return block, 4


def tile_settings(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for element-wise kernels over a [n_rows, n_cols] tile grid."""
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    block_m = max(1, min(triton.next_power_of_2(n_rows), TILE_ELEMENTS // block_n))
    num_warps = 8 if block_m * block_n >= 2048 else 4
    return block_m, block_n, num_warps


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Programs for a persistent reduction: one per SM on CUDA, a few in the interpreter."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_PROGRAMS


def row_groups(
    n_rows: int, n_blocks: int, device: torch.device, per_sm: int = 1
) -> tuple[int, int]:
    """Split ``n_rows`` into (groups, rows per group) for ``n_blocks`` column blocks.

    Each group is one program per column block, looping over its rows and keeping fp32
    partial column sums, so partial-sum buffers are [groups, N]: small, whatever n_rows.
    No rows is one empty group: its partial sums stay zero, so the gradients are zero (as
    torch's are for an empty input).
    """
    if n_rows == 0:
        return 1, 1
    target = max(1, num_programs(device) * per_sm // max(n_blocks, 1))
    groups = max(1, min(n_rows, target))
    per_group = triton.cdiv(n_rows, groups)
    return triton.cdiv(n_rows, per_group), per_group


@dataclass(frozen=True)
class TileGrid:
    """How the element-wise kernels run over [m, n] (``tile_grid``).

    ``grid`` is (row groups, column blocks); each program loops over ``rows_per_program``
    rows (a multiple of ``block_m``) of one column block, so a bias gradient needs only a
    [row groups, n] fp32 buffer of partial sums.
    """

    grid: tuple[int, int]
    rows_per_program: int
    block_m: int
    block_n: int
    num_warps: int

    @property
    def row_groups(self) -> int:
        """Programs along the rows: the rows of a partial-sum buffer."""
        return self.grid[0]

    def launch(self, kernel, *args, **constexprs) -> None:
        """Run ``kernel`` (a tile kernel taking BLOCK_M and BLOCK_N) on this grid; a grid
        with no programs (an empty [m, n]) launches nothing."""
        if 0 in self.grid:
            return
        kernel[self.grid](
            *args,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            num_warps=self.num_warps,
            **constexprs,
        )


def tile_grid(m: int, n: int, device: torch.device) -> TileGrid:
    """The grid, tiles and warps of the element-wise kernels over [m, n]."""
    block_m, block_n, num_warps = tile_settings(m, n)
    col_blocks = triton.cdiv(n, block_n)
    groups, row_tiles = row_groups(triton.cdiv(m, block_m), col_blocks, device, per_sm=4)
    return TileGrid((groups, col_blocks), row_tiles * block_m, block_m, block_n, num_warps)


def grad_tiles(m: int, n: int, device: torch.device) -> tuple[TileGrid, torch.Tensor]:
    """(tiles, db_partial): the grid of a backward tile kernel over [m, n] and its zeroed
    [row groups, n] fp32 buffer for the bias gradient's partial column sums."""
    tiles = tile_grid(m, n, device)
    return tiles, partial_sums(tiles.row_groups, n, device)


def tile_output(x2d: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, TileGrid | None]:
    """(out, tiles): an element-wise kernel's uninitialized [M, N] output over the rows
    ``x2d`` and the grid that fills it; no grid when it is empty (nothing to launch)."""
    m, n = x2d.shape
    out = torch.empty((m, n), dtype=dtype, device=x2d.device)
    return out, tile_grid(m, n, x2d.device) if out.numel() > 0 else None


def vector_arg(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A kernel's weight or bias pointer argument: ``t``, or ``x`` standing in when there is
    none (the kernel's HAS_* flag is then False, so it never reads it)."""
    return x if t is None else t


def check_launchable(kernel: object, x: torch.Tensor) -> None:
    """Raise a clear error when a CPU tensor meets kernels compiled for the GPU."""
    if x.is_cuda or isinstance(kernel, InterpretedFunction):
        return
    raise RuntimeError(
        "the Triton kernels were built for the GPU, but got a CPU tensor: TRITON_INTERPRET=1 "
        "must be set before triton is first imported (triton reads it once, at import)"
    )


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` has a dtype the kernels take (fp32, bf16, fp16)."""
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be fp32, bf16 or fp16 for the Triton kernels, got {t.dtype}")


def check_vector(name: str, t: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    """Raise unless ``t`` is None or a float [n] tensor on ``x``'s device."""
    if t is None:
        return
    check_float(name, t)
    if t.shape != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) to match the last dim of x, got {tuple(t.shape)}"
        )
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as [rows, last dim] with unit column stride (a copy only if needed)."""
    # The row count spelled out: reshape cannot infer -1 rows of an empty last dim.
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def checked_rows(kernel: object, x: torch.Tensor, **vectors: torch.Tensor | None) -> torch.Tensor:
    """``x`` as [M, N] rows for a forward launch of ``kernel``, after the launchers' checks.

    x must be a float tensor with at least one dim and a non-empty last dim (a zero-width
    row, which no model has, is refused in one line);
    each of ``vectors`` (weight, bias: None when absent) a float [N] tensor on x's device.
    """
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] < 1:
        raise ValueError(
            f"x must have at least one dim, the last of size >= 1, got shape {tuple(x.shape)}"
        )
    for name, t in vectors.items():
        check_vector(name, t, x.shape[-1], x)
    check_launchable(kernel, x)
    return as_rows(x)


def grad_rows(dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x2d, dy2d, dx) for a backward launch: the saved input and its output's gradient
    as [M, N] rows (dy contiguous), and dx an empty contiguous [M, N] in x's dtype."""
    if dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} must match x {tuple(x.shape)}")
    x2d = as_rows(x)
    dy2d = dy.reshape(x2d.shape).contiguous()
    return x2d, dy2d, torch.empty(x2d.shape, dtype=x.dtype, device=x.device)


def partial_sums(programs: int, n: int, device: torch.device) -> torch.Tensor:
    """A zeroed fp32 [programs, n] buffer for the first stage of a column reduction."""
    return torch.zeros((programs, n), dtype=torch.float32, device=device)


def reduce_partial_sums(partial: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor | None:
    """Second stage of a column reduction: sum ``partial`` [programs, N] fp32 over programs
    into ``like``'s dtype; None when ``like`` is (no weight or bias, no gradient)."""
    return None if like is None else partial.sum(dim=0).to(like.dtype)
