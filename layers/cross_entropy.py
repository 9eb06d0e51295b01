"""Cross-entropy over vocabulary-sharded logits, without ever gathering the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.mappings import all_reduce_max_, all_reduce_sum_
from layers.utils import CommTimer
from parallel_state.groups import group_rank, group_size, resolve_tp_group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss of TP-sharded logits; backward is softmax − target, local to each rank.

    Forward communicates twice: an all-reduce MAX of the local maxima (for stability), then
    one all-reduce SUM carrying the sum of exponentials, the target logit (0 off this
    rank's block) and, with label smoothing, the sum of logits. (The reference lists the
    two sums as separate all-reduces; stacking them saves one latency.)
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, vocab_size, group, timer):
        world, rank = group_size(group), group_rank(group)
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(compute)
        local = x.shape[-1]
        start = rank * local
        total = world * local if vocab_size is None else vocab_size
        padded = None
        if total < start + local:  # padding columns of the vocabulary live on this rank
            padded = torch.arange(start, start + local, device=x.device) >= total
            x = x.masked_fill(padded, float("-inf"))

        row_max = all_reduce_max_(x.max(dim=-1).values, group, timer)
        z = x - row_max.unsqueeze(-1)  # a fresh buffer: later steps may work in place

        in_block = (target >= start) & (target < start + local)
        local_target = (target - start).masked_fill(~in_block, 0)
        target_z = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_block, 0)
        smooth_sum = None
        if smoothing > 0:
            finite_z = z if padded is None else z.masked_fill(padded, 0.0)
            smooth_sum = finite_z.sum(dim=-1)
        exp = z.exp_()  # z is no longer needed: reuse its memory
        sums = [exp.sum(dim=-1), target_z]
        if smooth_sum is not None:
            sums.append(smooth_sum)
        stats = all_reduce_sum_(torch.stack(sums), group, timer)
        log_sum_exp = stats[0].log()
        loss = log_sum_exp - stats[1]
        if smoothing > 0:
            loss = (1.0 - smoothing) * loss + smoothing * (log_sum_exp - stats[2] / total)
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, in_block, ignored)
        ctx.smoothing, ctx.total, ctx.padded, ctx.in_dtype = smoothing, total, padded, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_block, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        # − (1 − ε) at the target column, only on the rank whose block holds the target.
        on_target = in_block.unsqueeze(-1).to(grad.dtype) * -(1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), on_target)
        if ctx.smoothing > 0:
            uniform = ctx.smoothing / ctx.total
            grad.sub_(uniform if ctx.padded is None else (~ctx.padded).to(grad.dtype) * uniform)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


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
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
            "logits must be target's shape plus a vocabulary dim"
        )
    group = resolve_tp_group(tp_group)
    if vocab_size is not None and not 0 < vocab_size <= group_size(group) * logits.shape[-1]:
        raise ValueError(
            f"vocab_size {vocab_size} must be in (0, {group_size(group) * logits.shape[-1]}] "
            "(the padded vocabulary across the TP group)"
        )
    return _VocabParallelCrossEntropy.apply(
        logits, target, ignore_index, label_smoothing, vocab_size, group, comm_timer
    )
