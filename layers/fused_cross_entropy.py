"""LM head + vocab-parallel cross-entropy, chunked over tokens: autograd Function.

The [tokens, vocab shard] logits are never materialized whole. Forward walks the tokens
in chunks: logits of one chunk (hidden_chunk @ weight^T, in the model dtype), the fused
cross-entropy kernels of ``cross_entropy_triton`` turn them into the chunk's loss and,
in place, its logits gradient, and two matmuls fold that gradient into d hidden and an
fp32 d weight accumulator before the next chunk reuses the memory. The loss is reduced
to a scalar (sum or mean), so backward only scales the stored gradients by grad_output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.kernels.cross_entropy_triton import cross_entropy_forward


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
