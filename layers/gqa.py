"""Grouped-query attention's key/value projection under tensor parallelism.

With ``kv_heads`` key/value heads and TP size ``tp``:

* ``kv_heads % tp == 0``: an ordinary column-parallel layer, whole KV heads per rank.
* ``tp % kv_heads == 0`` (more ranks than KV heads): each KV head is held whole by the
  ``tp / kv_heads`` consecutive ranks whose query heads use it (as inference engines place
  it). Each copy's weight gradient covers only its own ranks' query heads, so the copies'
  gradients are summed over exactly those ranks in backward, and the copies stay equal.

The weight's rows are ``(kv_heads two d)`` (each head's k rows, then its v rows) at every
TP size, so full state dicts do not depend on the layout. Replicated parameters declare
their replica count (``layers.param_roles``): gathers keep one copy per block and the
gradient norm counts one. At every TP size the parameters also declare ``kv_heads`` as
their block count, which checkpoints read to cut them for any other TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layers.linear import (
    ColumnParallelLinear,
    InitMethod,
    build_master_weight,
    sequence_parallel_linear,
)
from layers.mappings import all_reduce_sum_, copy_to_tp
from layers.param_roles import mark_replicas, mark_tp_blocks, mark_tp_dim
from layers.utils import comm_timer_of, group_rank, group_size


def dedupe_gathered(full: torch.Tensor, copies: int, tp_size: int) -> torch.Tensor:
    """A dim-0 TP gather of a replicated parameter with one copy of each block kept."""
    if copies == 1:
        return full
    return full.unflatten(0, (tp_size, -1))[::copies].flatten(0, 1)


def owned_block(full: torch.Tensor, copies: int, rank: int, tp_size: int) -> torch.Tensor:
    """This rank's dim-0 block of a full replicated parameter (block ``rank // copies``)."""
    return full.chunk(tp_size // copies, dim=0)[rank // copies]


class _SumOverCopies(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks holding the same block.

    Every rank writes its gradient into its block's slot of a zero ``[blocks, ...]`` buffer
    and one TP all-reduce adds the copies slot by slot: no sub-groups are needed.
    """

    @staticmethod
    def forward(ctx, param, group, copies):
        ctx.group, ctx.copies = group, copies
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        size, rank = group_size(ctx.group), group_rank(ctx.group)
        slots = grad.new_zeros((size // ctx.copies, *grad.shape))
        slots[rank // ctx.copies] = grad
        all_reduce_sum_(slots, ctx.group)
        return slots[rank // ctx.copies], None, None


class ReplicatedKVLinear(nn.Module):
    """The KV projection when TP exceeds the KV heads: one whole head's k and v per rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        blocks: int,
        tp_group,
        init_method: InitMethod,
        sequence_parallel: bool,
        dtype,
        device,
    ) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        size, rank = group_size(tp_group), group_rank(tp_group)
        self.copies = size // blocks
        factory = {"dtype": dtype or torch.get_default_dtype(), "device": device}
        full = build_master_weight((out_features, in_features), init_method, factory["dtype"])
        self.weight = nn.Parameter(owned_block(full, self.copies, rank, size).to(**factory))
        self.bias = nn.Parameter(torch.zeros(out_features // blocks, **factory)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                mark_tp_dim(p, 0)
                mark_replicas(p, self.copies)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        timer = comm_timer_of(self)
        weight = _SumOverCopies.apply(self.weight, self.tp_group, self.copies)
        bias = None
        if self.bias is not None:
            bias = _SumOverCopies.apply(self.bias, self.tp_group, self.copies)
        if self.sequence_parallel:  # as every sequence-parallel column linear: the shard kept
            return sequence_parallel_linear(x, weight, bias, self.tp_group, 0, timer)
        return F.linear(copy_to_tp(x, self.tp_group, comm_timer=timer), weight, bias)


def kv_projection(
    hidden: int, kv_heads: int, head_dim: int, bias: bool, *, tp_group, **common
) -> nn.Module:
    """The KV projection for ``kv_heads`` heads: column-parallel, or replicated per head."""
    out = 2 * kv_heads * head_dim
    if kv_heads % group_size(tp_group) == 0:
        layer = ColumnParallelLinear(hidden, out, bias, tp_group=tp_group, **common)
    else:
        layer = ReplicatedKVLinear(hidden, out, bias, blocks=kv_heads, tp_group=tp_group, **common)
    for p in layer.parameters():
        mark_tp_blocks(p, kv_heads)
    return layer
