"""The fused vocab-parallel cross-entropy: the Triton kernels' passes with the TP reductions
between them, its autograd Functions, and the chunked LM head + cross-entropy.

The kernels (``layers.kernels.cross_entropy_triton``) only compute: a statistics pass
over this rank's logit shard, then a gradient pass. This module combines the per-token
statistics over the TP group between the two launches (``layers.mappings``' plain
reductions), as the torch version does. The LM-head form walks the tokens in chunks:
logits of one chunk (hidden_chunk @ weight^T, in the model dtype), the fused
cross-entropy turns them into the chunk's loss and, in place, its logits gradient, and
two matmuls fold that gradient into d hidden and an fp32 d weight accumulator before the
next chunk reuses the memory. Triton is imported on first use of a Triton path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.cross_entropy import (
    check_target_shape,
    checked_loss_group,
    vocab_parallel_cross_entropy,
)
from layers.kernels.dispatch import choose_backend, reject_apex
from layers.mappings import all_reduce_max_, all_reduce_sum_
from layers.utils import CommTimer
from parallel_state.groups import group_rank, group_size


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    vocab_size: int | None,
    group: dist.ProcessGroup | None,
    compute_grad: bool = True,
    timer: CommTimer | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token fp32 loss and, if ``compute_grad``, the logits gradient written over ``logits``.

    ``logits`` [T, V_local] (unit column stride) and ``target`` [T] int64; ``group`` is the
    TP group (None: one rank). Returns (loss [T], the overwritten logits or None).
    """
    from layers.kernels import cross_entropy_triton as kernels

    world, rank = group_size(group), group_rank(group)
    v_local = logits.shape[-1]
    start = rank * v_local
    total = world * v_local if vocab_size is None else vocab_size
    target = target.contiguous()
    stats = kernels.cross_entropy_stats(
        logits, target, vocab_start=start, vocab_size=total, smoothing=label_smoothing > 0
    )
    local_max = stats[0]
    row_max = all_reduce_max_(local_max.clone(), group, timer)
    sums = stats[1:] if label_smoothing > 0 else stats[1:3]
    sums[0].mul_(torch.exp(local_max - row_max))  # rescale to the global max
    all_reduce_sum_(sums, group, timer)
    lse = row_max + sums[0].log()
    loss = lse - sums[1]
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sums[2] / total)
    loss = loss.masked_fill(target == ignore_index, 0.0)
    if not compute_grad:
        return loss, None
    kernels.cross_entropy_grad_(
        logits,
        target,
        lse,
        vocab_start=start,
        vocab_size=total,
        ignore_index=ignore_index,
        smoothing=label_smoothing,
    )
    return loss, logits


class FusedCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss of TP-sharded logits; the gradient is made in forward, over the logits.

    Forward overwrites ``logits`` with d loss / d logits (when a gradient is needed) and
    bumps its autograd version, so any other autograd node that saved the same tensor
    fails loudly in backward instead of reading gradients as logits. Backward scales
    that buffer by grad_output per token, in place, and returns it.
    """

    @staticmethod
    def forward(
        ctx, logits, target, ignore_index, smoothing, vocab_size, group, compute_grad, timer
    ):
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
            timer=timer,
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
        from layers.kernels.cross_entropy_triton import cross_entropy_backward

        if ctx.grad is None:
            raise RuntimeError(
                "the fused cross-entropy's backward runs once: its gradient buffer is reused "
                "in place (retain_graph=True cannot run it twice)"
            )
        grad = cross_entropy_backward(ctx.grad, grad_loss, ctx.target, ctx.ignore_index)
        ctx.grad = ctx.target = None
        return grad.view(ctx.shape), None, None, None, None, None, None, None


def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    vocab_size: int | None,
    group: dist.ProcessGroup | None,
    chunk_tokens: int,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(summed fp32 loss, d loss / d hidden [T, H], d loss / d weight [V_local, H] in fp32).

    ``hidden`` [T, H] is replicated over the TP group, ``weight`` [V_local, H] is this
    rank's vocabulary shard and ``target`` [T] holds global ids. d hidden is this rank's
    partial sum (its vocabulary shard's share); the gradients are None without
    ``compute_grad``.
    """
    t = hidden.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if compute_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if not compute_grad:
        grad_weight = None
    for start in range(0, t, chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        logits = h @ weight.t()  # [chunk, V_local], the only logits alive at a time
        chunk_loss, grad = cross_entropy_forward(
            logits,
            target[start : start + chunk_tokens],
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            vocab_size=vocab_size,
            group=group,
            compute_grad=compute_grad,
        )
        loss += chunk_loss.sum()
        if compute_grad:
            # Under autocast the logits (and so grad) are bf16/fp16 while weight is fp32.
            grad_hidden[start : start + chunk_tokens] = grad.matmul(weight.to(grad.dtype))
            grad_weight.addmm_(grad.t().float(), h.float())
    return loss, grad_hidden, grad_weight


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Scalar cross-entropy of ``hidden @ weight^T``; gradients made in forward, chunk by chunk.

    Backward multiplies them by the scalar grad_output. d hidden is this rank's partial
    sum: ``hidden`` must reach this op through ``layers.copy_to_tp`` (as the input of any
    column-parallel layer does), whose backward all-reduces it over the TP group.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, options, reduction, compute_grad):
        shape = hidden.shape
        target = target.reshape(-1)
        loss, grad_hidden, grad_weight = linear_cross_entropy_forward(
            hidden.reshape(-1, shape[-1]), weight, target, compute_grad=compute_grad, **options
        )
        # "mean" divides by the tokens that count, like F.cross_entropy (0 if none do).
        count = (target != options["ignore_index"]).sum().clamp_min(1)
        ctx.divisor = count if reduction == "mean" else None
        ctx.grads = (grad_hidden, grad_weight)
        ctx.shape, ctx.weight_dtype = shape, weight.dtype
        return loss if ctx.divisor is None else loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.grads
        if grad_hidden is None:
            raise RuntimeError("the chunked LM-head cross-entropy's backward runs once")
        ctx.grads = (None, None)
        scale = grad_loss.float() if ctx.divisor is None else grad_loss.float() / ctx.divisor
        grad_hidden = grad_hidden.mul_(scale).view(ctx.shape)
        return grad_hidden, grad_weight.mul_(scale).to(ctx.weight_dtype), None, None, None, None


def fused_vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """``layers.vocab_parallel_cross_entropy`` with the same arguments and result, fused.

    ``comm_timer`` times the collectives (the two small all-reduces of the statistics).

    Per-token fp32 loss of logits sharded on their last dim across the TP group, equal to
    ``F.cross_entropy(gathered[..., :vocab_size], target, reduction="none")``; ignored
    tokens get loss 0 and gradient 0, and ``vocab_size`` excludes padding columns.

    On the Triton path, when a gradient is needed, **``logits`` is overwritten with its
    gradient** during forward (so no fp32 copy of the logits is ever made): the caller
    must not read ``logits`` after this call. Its autograd version is bumped, so another
    autograd node that saved the same tensor raises in backward rather than reading
    gradients. Under ``torch.no_grad()`` (or for logits that need no grad) the logits are
    left intact. fp64 logits take the torch path under ``backend="auto"``.
    """
    reject_apex(backend, "fused_vocab_parallel_cross_entropy")
    if choose_backend("cross_entropy", logits, backend) != "triton":
        return vocab_parallel_cross_entropy(
            logits,
            target,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            tp_group=tp_group,
            vocab_size=vocab_size,
            comm_timer=comm_timer,
        )
    check_target_shape(logits, target)
    group = checked_loss_group(tp_group, label_smoothing, vocab_size, logits.shape[-1])
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    return FusedCrossEntropyFunction.apply(
        logits, target, ignore_index, label_smoothing, vocab_size, group, compute_grad, comm_timer
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    reduction: str = "mean",
    chunk_tokens: int = 4096,
    backend: str = "auto",
) -> torch.Tensor:
    """Scalar cross-entropy of the LM head ``hidden @ weight^T``, chunked over tokens.

    Equals ``vocab_parallel_cross_entropy(hidden @ weight.t(), target, ...)`` summed, or
    for ``reduction="mean"`` averaged over the tokens that are not ``ignore_index`` (0
    when there are none). ``hidden`` [..., H] is replicated over the TP group and must
    come through ``layers.copy_to_tp`` (its backward all-reduces the gradient of hidden);
    ``weight`` [V_local, H] is this rank's vocabulary shard. On the Triton path only
    ``chunk_tokens`` x V_local logits exist at a time (in the model dtype), and the
    gradients are computed during forward, so backward runs once.
    """
    reject_apex(backend, "fused_linear_cross_entropy")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if (
        hidden.shape[:-1] != target.shape
        or weight.dim() != 2
        or weight.shape[1] != hidden.shape[-1]
    ):
        raise ValueError(
            f"expected hidden [..., H], weight [V_local, H] and target hidden.shape[:-1]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}"
        )
    options = dict(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        tp_group=tp_group,
        vocab_size=vocab_size,
    )
    if choose_backend("cross_entropy", hidden, backend) != "triton":
        loss = vocab_parallel_cross_entropy(hidden @ weight.t(), target, **options).sum()
        if reduction == "sum":
            return loss
        return loss / (target != ignore_index).sum().clamp_min(1)
    group = checked_loss_group(tp_group, label_smoothing, vocab_size, weight.shape[0])
    del options["tp_group"]
    options.update(group=group, chunk_tokens=chunk_tokens)
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropyFunction.apply(
        hidden, weight, target, options, reduction, compute_grad
    )
