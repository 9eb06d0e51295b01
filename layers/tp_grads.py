"""TP gradient reductions the data-parallel strategies run after backward, in one place.

A sequence-parallel region's parameters (LayerNorm weights and biases, the row-parallel
bias) see only this TP rank's slice of the sequence, so their gradient is a partial sum
that the TP ranks add up. Both DP strategies (plain bucketed all-reduce and ZeRO-1) call
:func:`sum_partial_grads_`; neither writes the collective itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_state.groups import group_size

__all__ = ["sum_partial_grads_"]


@torch.no_grad()
def sum_partial_grads_(grads: list[torch.Tensor], tp_group: dist.ProcessGroup | None) -> None:
    """Sum ``grads`` (views of the partial gradients) over ``tp_group`` in place, as one
    flat all-reduce. Every TP rank passes the same shapes in the same order."""
    if not grads or group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
