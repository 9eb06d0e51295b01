"""Run-level collectives: metric means, agreement between ranks, checkpoint hand-offs, barriers.

One of the three places where meshtron communicates (the others: the TP operators of
``layers.mappings``, and the data-parallel gradient code). Every helper takes its group
explicitly: a mesh group by role or axis (``ps.group("loss")``, ``ps.tp_group``), ``world(ps)`` for every rank
of the run, or None for a single process, where each helper returns without
communicating. Every rank of the group must call the helper together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel_state import ParallelState, groups
from parallel_state.groups import group_size


def world(ps: ParallelState | None = None) -> dist.ProcessGroup | None:
    """The group of every rank of the run; None when torch.distributed is not running.

    ``ps`` (the run's mesh) names the run; without one the default group is it.
    """
    if ps is not None and ps.world_size == 1:
        return None
    return dist.group.WORLD if dist.is_initialized() else None


def collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """``device`` for an NCCL group (it only moves CUDA tensors), the CPU otherwise."""
    return device if groups.collective_device(group).type == "cuda" else torch.device("cpu")


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on any of them (a MAX all-reduce)."""
    if group_size(group) == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (it must be on the group's device); returns it."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def mean(value: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The mean of ``value`` over the ranks of ``group`` (summed in float64)."""
    size = group_size(group)
    if size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(group, device))
    return sum_(t, group).item() / size


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order of ``group``."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: dist.ProcessGroup | None, src: int = 0) -> Any:
    """Rank ``src`` (its rank within ``group``)'s picklable ``obj``, on every rank of ``group``."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait until every rank of ``group`` gets here."""
    if group_size(group) > 1:
        dist.barrier(group=group)
