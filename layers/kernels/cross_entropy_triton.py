"""Fused vocab-parallel cross-entropy: Triton kernels, launchers and autograd Function.

Same result as ``layers.vocab_parallel_cross_entropy``, in two passes over this rank's
logit shard and no fp32 copy of it:

1. ``_cross_entropy_fwd_stats_kernel``: one program per token streams the shard in
   BLOCK_V chunks and keeps, in fp32, an online max and sum of exponentials (relative
   to that running max), the target logit (0 off this rank's block) and, for label
   smoothing, the sum of logits. Padding columns (global index >= vocab_size) count as
   -inf and are left out of the sums.
2. Between the passes, on [tokens]-sized vectors: all-reduce MAX of the local maxima,
   rescale each rank's sum of exponentials to the global max, one all-reduce SUM of
   (sum of exponentials, target logit[, sum of logits]); log-sum-exp and the loss follow.
3. ``_cross_entropy_fwd_grad_kernel``: the gradient softmax - (1 - eps) one_hot - eps / V
   (0 on padding and ignored tokens), written over the logits in place.

Backward only scales each token's gradient row by its grad_output
(``_cross_entropy_bwd_kernel``), again in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from layers.kernels.launch import check_float, check_launchable
from layers.utils import group_rank, group_size

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


def _block_v(v_local: int, block_v: int | None) -> tuple[int, int]:
    block = block_v or min(triton.next_power_of_2(v_local), MAX_BLOCK_V)
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    vocab_size: int | None,
    group: dist.ProcessGroup | None,
    compute_grad: bool = True,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token fp32 loss and, if ``compute_grad``, the logits gradient written over ``logits``.

    ``logits`` [T, V_local] (unit column stride) and ``target`` [T] int64; ``group`` is the
    TP group (None: one rank). Returns (loss [T], the overwritten logits or None).
    ``block_v`` overrides the vocabulary chunk (a power of two; tests use small ones).
    """
    check_float("logits", logits)
    check_launchable(_cross_entropy_fwd_stats_kernel, logits)
    if logits.dim() != 2 or logits.stride(-1) != 1 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] with unit column stride and target [T], got "
            f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(target.shape)}"
        )
    world, rank = group_size(group), group_rank(group)
    t, v_local = logits.shape
    start = rank * v_local
    total = world * v_local if vocab_size is None else vocab_size
    target = target.contiguous()
    block, num_warps = _block_v(v_local, block_v)

    stats = torch.empty((4, t), dtype=torch.float32, device=logits.device)
    if t > 0:
        _cross_entropy_fwd_stats_kernel[(t,)](
            logits, target, stats, t, logits.stride(0), v_local, start, total,
            SMOOTHING=label_smoothing > 0, BLOCK_V=block, num_warps=num_warps,
        )  # fmt: skip
    local_max = stats[0]
    row_max = local_max.clone()
    if world > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sums = stats[1:] if label_smoothing > 0 else stats[1:3]
    sums[0].mul_(torch.exp(local_max - row_max))  # rescale to the global max
    if world > 1:
        dist.all_reduce(sums, group=group)
    lse = row_max + sums[0].log()
    loss = lse - sums[1]
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sums[2] / total)
    loss = loss.masked_fill(target == ignore_index, 0.0)
    if not compute_grad or t == 0:
        return loss, logits if compute_grad else None

    _cross_entropy_fwd_grad_kernel[(t,)](
        logits, target, lse, logits.stride(0), v_local, start, total, ignore_index,
        label_smoothing, BLOCK_V=block, num_warps=num_warps,
    )  # fmt: skip
    return loss, logits


def cross_entropy_backward(
    grad: torch.Tensor,
    grad_loss: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    block_v: int | None = None,
) -> torch.Tensor:
    """Scale each row of ``grad`` [T, V_local] by ``grad_loss`` [T], in place; returns ``grad``."""
    t, v_local = grad.shape
    if t == 0:
        return grad
    block, num_warps = _block_v(v_local, block_v)
    _cross_entropy_bwd_kernel[(t,)](
        grad, grad_loss.reshape(t).to(torch.float32).contiguous(), target.contiguous(),
        grad.stride(0), v_local, ignore_index, BLOCK_V=block, num_warps=num_warps,
    )  # fmt: skip
    return grad


class FusedCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss of TP-sharded logits; the gradient is made in forward, over the logits.

    Forward overwrites ``logits`` with d loss / d logits (when a gradient is needed) and
    bumps its autograd version, so any other autograd node that saved the same tensor
    fails loudly in backward instead of reading gradients as logits. Backward scales
    that buffer by grad_output per token, in place, and returns it.
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, vocab_size, group, compute_grad):
        shape = logits.shape
        logits2d = logits.reshape(-1, shape[-1])
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()  # the gradient goes to a copy; logits stay intact
        target1d = target.reshape(-1)
        loss, grad = cross_entropy_forward(
            logits2d,
            target1d,
            ignore_index=ignore_index,
            label_smoothing=smoothing,
            vocab_size=vocab_size,
            group=group,
            compute_grad=compute_grad,
        )
        ctx.grad = ctx.target = None
        if compute_grad:
            torch.autograd.graph.increment_version(logits)
            # Kept as attributes, not saved tensors: the buffer is a view of logits, which
            # was just marked as modified, and backward is its only remaining user.
            ctx.grad, ctx.target = grad, target1d
        ctx.shape, ctx.ignore_index = shape, ignore_index
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grad is None:
            raise RuntimeError(
                "the fused cross-entropy's backward runs once: its gradient buffer is reused "
                "in place (retain_graph=True cannot run it twice)"
            )
        grad = cross_entropy_backward(ctx.grad, grad_loss, ctx.target, ctx.ignore_index)
        ctx.grad = ctx.target = None
        return grad.view(ctx.shape), None, None, None, None, None, None
