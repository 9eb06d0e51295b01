"""Fused vocab-parallel cross-entropy: Triton kernels and their launchers (no communication).

The layer (``layers.fused_cross_entropy``) gets the same result as
``layers.vocab_parallel_cross_entropy`` in two passes over this rank's logit shard and no
fp32 copy of it:

1. ``_cross_entropy_fwd_stats_kernel``: one program per token streams the shard in
   BLOCK_V chunks and keeps, in fp32, an online max and sum of exponentials (relative
   to that running max), the target logit (0 off this rank's block) and, for label
   smoothing, the sum of logits. Padding columns (global index >= vocab_size) count as
   -inf and are left out of the sums.
2. Between the passes the layer, not this module, combines the [tokens]-sized statistics
   over the TP group: all-reduce MAX of the local maxima, rescale each rank's sum of
   exponentials to the global max, one all-reduce SUM of (sum of exponentials, target
   logit[, sum of logits]); log-sum-exp and the loss follow.
3. ``_cross_entropy_fwd_grad_kernel``: the gradient softmax - (1 - eps) one_hot - eps / V
   (0 on padding and ignored tokens), written over the logits in place.

Backward only scales each token's gradient row by its grad_output
(``_cross_entropy_bwd_kernel``), again in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layers.kernels.launch import check_float, check_launchable

# Vocabulary chunk one program holds at a time (elements).
MAX_BLOCK_V = 8192


@triton.jit
def _cross_entropy_fwd_stats_kernel(
    Logits,  # [T, V_local] this rank's logit shard, row stride stride_l
    Target,  # [T] int64 global target ids
    Stats,  # [4, T] fp32 out: local max, sum exp(x - local max), target logit, sum of logits
    T,
    stride_l,
    V_local,
    vocab_start,  # global id of this shard's first column
    vocab_size,  # unpadded vocabulary: columns at or past it are padding
    SMOOTHING: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    local_target = tl.load(Target + row) - vocab_start
    base = Logits + row * stride_l
    row_max = -float("inf")
    sum_exp = 0.0
    target_logit = 0.0
    sum_logits = 0.0
    for start in range(0, V_local, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_shard = cols < V_local
        valid = in_shard & (cols + vocab_start < vocab_size)
        x = tl.load(base + cols, mask=valid, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # While every column so far is padding the max is -inf; use 0 as the reference.
        ref = tl.where(new_max == -float("inf"), 0.0, new_max)
        sum_exp = sum_exp * tl.exp(row_max - ref) + tl.sum(tl.exp(x - ref), axis=0)
        row_max = new_max
        # A target on a padding column reads -inf (infinite loss), as in the torch version.
        target_logit += tl.sum(tl.where(in_shard & (cols == local_target), x, 0.0), axis=0)
        if SMOOTHING:
            sum_logits += tl.sum(tl.where(valid, x, 0.0), axis=0)
    tl.store(Stats + row, row_max)
    tl.store(Stats + T + row, sum_exp)
    tl.store(Stats + 2 * T + row, target_logit)
    tl.store(Stats + 3 * T + row, sum_logits)


@triton.jit
def _cross_entropy_fwd_grad_kernel(
    Logits,  # [T, V_local] in: logits; out: d loss / d logits (in place), row stride stride_l
    Target,  # [T] int64 global target ids
    LSE,  # [T] fp32 global log-sum-exp of each row
    stride_l,
    V_local,
    vocab_start,  # global id of this shard's first column
    vocab_size,  # unpadded vocabulary: columns at or past it are padding
    ignore_index,
    smoothing,  # label smoothing eps
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Target + row)
    local_target = target - vocab_start
    lse = tl.load(LSE + row)
    keep = tl.where(target == ignore_index, 0.0, 1.0)
    base = Logits + row * stride_l
    for start in range(0, V_local, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_shard = cols < V_local
        valid = in_shard & (cols + vocab_start < vocab_size)
        x = tl.load(base + cols, mask=valid, other=-float("inf")).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(valid, smoothing / vocab_size, 0.0)
        grad -= tl.where(cols == local_target, 1.0 - smoothing, 0.0)
        tl.store(base + cols, (grad * keep).to(Logits.dtype.element_ty), mask=in_shard)


@triton.jit
def _cross_entropy_bwd_kernel(
    Grad,  # [T, V_local] in: d loss / d logits; out: times grad_loss per row (in place)
    GradLoss,  # [T] fp32 gradient of each token's loss
    Target,  # [T] int64 global target ids
    stride_g,
    V_local,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Ignored rows are already 0; masking the scale too keeps a non-finite grad_loss out.
    scale = tl.where(tl.load(Target + row) == ignore_index, 0.0, tl.load(GradLoss + row))
    base = Grad + row * stride_g
    for start in range(0, V_local, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V_local
        g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + cols, (g * scale).to(Grad.dtype.element_ty), mask=mask)


def _launch_per_token(kernel, shape: tuple[int, int], block_v: int | None, *args, **kw) -> None:
    """Launch ``kernel`` over [T, V_local] ``shape``: one program per token, each streaming
    its row in BLOCK_V chunks (``block_v``, else the row's power of two up to
    MAX_BLOCK_V); nothing to launch when T is 0."""
    t, v_local = shape
    if t == 0:
        return
    block = block_v or min(triton.next_power_of_2(v_local), MAX_BLOCK_V)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    kernel[(t,)](*args, BLOCK_V=block, num_warps=num_warps, **kw)


def cross_entropy_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    smoothing: bool,
    block_v: int | None = None,
) -> torch.Tensor:
    """This shard's per-token statistics, [4, T] fp32: local max, sum of exp(x - local max),
    target logit (0 when the target is off this shard) and, with ``smoothing``, the sum of
    logits (else 0).

    ``logits`` [T, V_local] (unit column stride) holds global columns ``vocab_start`` on;
    columns at or past ``vocab_size`` are padding. ``target`` [T] int64 global ids.
    ``block_v`` overrides the vocabulary chunk (a power of two; tests use small ones).
    """
    check_float("logits", logits)
    check_launchable(_cross_entropy_fwd_stats_kernel, logits)
    if logits.dim() != 2 or logits.stride(-1) != 1 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] with unit column stride and target [T], got "
            f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(target.shape)}"
        )
    t, v_local = logits.shape
    stats = torch.empty((4, t), dtype=torch.float32, device=logits.device)
    _launch_per_token(
        _cross_entropy_fwd_stats_kernel,
        logits.shape,
        block_v,
        logits,
        target.contiguous(),
        stats,
        t,
        logits.stride(0),
        v_local,
        vocab_start,
        vocab_size,
        SMOOTHING=smoothing,
    )
    return stats


def cross_entropy_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int,
    smoothing: float,
    block_v: int | None = None,
) -> torch.Tensor:
    """Overwrite ``logits`` [T, V_local] with d loss / d logits given each row's global
    log-sum-exp ``lse`` [T] fp32; returns ``logits``. Arguments as for ``cross_entropy_stats``."""
    _launch_per_token(
        _cross_entropy_fwd_grad_kernel,
        logits.shape,
        block_v,
        logits,
        target.contiguous(),
        lse,
        logits.stride(0),
        logits.shape[1],
        vocab_start,
        vocab_size,
        ignore_index,
        smoothing,
    )
    return logits


def cross_entropy_backward(
    grad: torch.Tensor,
    grad_loss: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    block_v: int | None = None,
) -> torch.Tensor:
    """Scale each row of ``grad`` [T, V_local] by ``grad_loss`` [T], in place; returns ``grad``."""
    t, v_local = grad.shape
    _launch_per_token(
        _cross_entropy_bwd_kernel,
        grad.shape,
        block_v,
        grad,
        grad_loss.reshape(t).to(torch.float32).contiguous(),
        target.contiguous(),
        grad.stride(0),
        v_local,
        ignore_index,
    )
    return grad
