"""Cross-entropy over vocabulary-sharded logits, without ever gathering the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.mappings import all_reduce_max_, all_reduce_sum_, reduce_from_tp
from layers.utils import CommTimer
from parallel_state.groups import group_rank, group_size, resolve_tp_group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss of TP-sharded logits; backward is softmax − target, local to each rank.

    Forward communicates twice: an all-reduce MAX of the local maxima (for stability), then
    one all-reduce SUM carrying the sum of exponentials, the target logit (0 off this
    rank's block) and, with label smoothing, the sum of logits. (The reference lists the
    two sums as separate all-reduces; stacking them saves one latency.)

    One logits-sized buffer is made (``x - row_max``, then exponentiated and normalised in
    place into the softmax that backward reuses): padding columns are left out of the max
    and the sums by slicing them off (views), and only their few softmax columns are zeroed.
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, vocab_size, group, timer):
        world, rank = group_size(group), group_rank(group)
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        local = logits.shape[-1]
        start = rank * local
        total = world * local if vocab_size is None else vocab_size
        valid = min(max(total - start, 0), local)  # this rank's columns that are not padding

        row_max = _local_max(logits[..., :valid], compute)
        all_reduce_max_(row_max, group, timer)
        # The one fresh buffer: logits stay intact for the caller; a converted (bf16 → fp32)
        # copy is already fresh, so subtract in place there.
        x = logits.to(compute)
        z = x.sub_(row_max.unsqueeze(-1)) if x is not logits else x - row_max.unsqueeze(-1)

        in_block = (target >= start) & (target < start + local)
        local_target = (target - start).masked_fill(~in_block, 0)
        target_z = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_block, 0)
        # A target on a padding column gets infinite loss, as if its logit were -inf.
        target_z = target_z.masked_fill(in_block & (local_target >= valid), float("-inf"))
        sums = [None, target_z]
        if smoothing > 0:
            sums.append(z[..., :valid].sum(dim=-1))
        exp = z.exp_()  # z is no longer needed: reuse its memory
        exp[..., valid:] = 0.0  # padding columns: no probability (a few columns only)
        sums[0] = exp.sum(dim=-1)
        stats = all_reduce_sum_(torch.stack(sums), group, timer)
        log_sum_exp = stats[0].log()
        loss = log_sum_exp - stats[1]
        if smoothing > 0:
            loss = (1.0 - smoothing) * loss + smoothing * (log_sum_exp - stats[2] / total)
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, in_block, ignored)
        ctx.smoothing, ctx.total, ctx.valid, ctx.in_dtype = smoothing, total, valid, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_block, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        # − (1 − ε) at the target column, only on the rank whose block holds the target.
        on_target = in_block.unsqueeze(-1).to(grad.dtype) * -(1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), on_target)
        if ctx.smoothing > 0:
            grad[..., : ctx.valid].sub_(ctx.smoothing / ctx.total)  # padding columns: none
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def _local_max(logits: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """Row max of ``logits`` (a view without the padding columns) in ``compute``; -inf when a
    rank holds padding only. max is exact in any float dtype, so no converted copy is made."""
    if logits.shape[-1] == 0:
        return torch.full(logits.shape[:-1], float("-inf"), dtype=compute, device=logits.device)
    return logits.amax(dim=-1).to(compute)


def check_target_shape(logits: torch.Tensor, target: torch.Tensor) -> None:
    """Raise unless ``logits`` is ``target``'s shape plus a non-empty vocabulary dim."""
    if logits.dim() == 0 or logits.shape[:-1] != target.shape or not logits.shape[-1]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
            "logits must be target's shape plus a non-empty vocabulary dim"
        )


def checked_loss_group(
    tp_group: dist.ProcessGroup | None, label_smoothing: float, vocab_size: int | None, local: int
) -> dist.ProcessGroup | None:
    """The resolved TP group of a vocabulary-parallel loss whose ranks hold ``local``
    vocabulary columns each, after checking ``label_smoothing`` and ``vocab_size``."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    group = resolve_tp_group(tp_group)
    padded = group_size(group) * local
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size {vocab_size} must be in (0, {padded}] "
            "(the padded vocabulary across the TP group)"
        )
    return group


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of logits sharded on their last dim across the TP group.

    Equals ``F.cross_entropy(gathered[..., :vocab_size], target, reduction="none")`` where
    ``gathered`` concatenates every rank's ``logits`` shard. ``vocab_size`` (the unpadded
    vocabulary) excludes padding columns from the softmax; None means all columns count.
    Ignored positions get loss 0 and gradient 0. Returns fp32 (fp64 for fp64 logits).
    """
    check_target_shape(logits, target)
    group = checked_loss_group(tp_group, label_smoothing, vocab_size, logits.shape[-1])
    if torch.compiler.is_compiling():
        return _traced_cross_entropy(
            logits, target, ignore_index, label_smoothing, vocab_size, group, comm_timer
        )
    return _VocabParallelCrossEntropy.apply(
        logits, target, ignore_index, label_smoothing, vocab_size, group, comm_timer
    )


class _PickTarget(torch.autograd.Function):
    """``x.gather(-1, index[..., None])[..., 0]`` whose backward is a comparison with the
    column index. Autograd's gather backward zero-fills a logits-sized buffer and scatters
    into it, two extra passes over the largest tensor of a small model's step; the
    comparison fuses into the softmax's gradient in the compiled backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.columns = x.shape[-1]
        return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        columns = torch.arange(ctx.columns, device=grad.device)
        hit = columns == index.unsqueeze(-1)
        return torch.where(hit, grad.unsqueeze(-1), 0.0), None


def _traced_cross_entropy(logits, target, ignore_index, smoothing, vocab_size, group, timer):
    """The same loss in differentiable ops, for a compiled graph: the compiler derives the
    backward and fuses both passes (no softmax stored; it is recomputed in backward), which
    the hand-written Function's in-place buffers would prevent.

    Each rank reduces its own shard first: its row max m_r and s_r = sum exp(x - m_r), in
    one pass over the logits (the compiler fuses the max into the sum, an online softmax),
    with the target logit (and the row sum, for smoothing). One all-reduce then hands every
    rank every rank's statistics (each fills its own slot of a zero tensor), and the
    log-sum-exp is M + log(sum_r s_r exp(m_r - M)) with M = max_r m_r: one collective and
    one read of the logits, where a global max first would need two of each. The slots'
    all-reduce is ``reduce_from_tp`` (identity backward: every rank's loss is the same
    function of the statistics, and each rank's shard enters them once, in its own slot);
    the maxes are detached (the log-sum-exp does not depend on them).
    """
    world, rank = group_size(group), group_rank(group)
    local = logits.shape[-1]
    start = rank * local
    total = world * local if vocab_size is None else vocab_size
    valid = min(max(total - start, 0), local)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits[..., :valid].to(compute)  # padding columns: no probability, no gradient
    row_max = _local_max(x.detach(), compute)
    stats = [row_max, (x - row_max.unsqueeze(-1)).exp().sum(-1)]
    in_block = (target >= start) & (target < start + local)
    local_target = (target - start).clamp(0, max(valid - 1, 0))
    picked = _PickTarget.apply(x, local_target) if valid else x.sum(-1)
    # A target on a padding column gets infinite loss, as if its logit were -inf.
    on_padding = in_block & (target - start >= valid)
    stats.append(picked.masked_fill(~in_block, 0.0).masked_fill(on_padding, float("-inf")))
    if smoothing > 0:
        stats.append(x.sum(-1))
    mine = torch.stack(stats)
    if world > 1:
        slots = [mine if r == rank else torch.zeros_like(mine) for r in range(world)]
        every = reduce_from_tp(torch.stack(slots), group, comm_timer=timer)
    else:
        every = mine.unsqueeze(0)
    maxes = every[:, 0].detach()
    row_max = maxes.amax(0)
    sum_exp = (every[:, 1] * (maxes - row_max).exp()).sum(0)
    sums = every[:, 2:].sum(0)
    log_sum_exp = row_max + sum_exp.log()
    loss = log_sum_exp - sums[0]
    if smoothing > 0:
        loss = (1.0 - smoothing) * loss + smoothing * (log_sum_exp - sums[1] / total)
    return loss.masked_fill(target == ignore_index, 0.0)
