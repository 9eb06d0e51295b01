"""Questions about a process group that also make sense without one (None: one process).

Layers and engine code take ``tp_group=`` / ``dp_group=`` explicitly; these helpers let
them treat ``None`` as a group of one rank, so a single process needs no
``torch.distributed`` at all.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import parallel_state


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for None (no distribution)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor must be to take part in a collective of ``group``: this rank's
    current GPU for NCCL (it moves CUDA tensors only), the CPU otherwise (gloo, or none)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_tp_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``tp_group`` itself; else the default ParallelState's TP group, with an
    ImplicitStateWarning; None in a plain single process."""
    if tp_group is not None:
        return tp_group
    if (state := parallel_state.implicit("tp_group")) is not None:
        return state.tp_group
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "torch.distributed runs on several ranks but parallel_state is not initialized: "
            "call parallel_state.initialize(tp_size) or pass tp_group="
        )
    return None  # a plain single process: TP size 1


def solo_group(rank: int, world_size: int) -> dist.ProcessGroup:
    """A group holding only ``rank`` (every rank of the world must call this together)."""
    return [dist.new_group([r]) for r in range(world_size)][rank]


def same_ranks_group(
    group: dist.ProcessGroup, *, timeout: datetime.timedelta, backend: str = "gloo"
) -> dist.ProcessGroup:
    """A new group of ``group``'s ranks with its own backend and timeout (e.g. a channel
    that may wait far longer than a collective should); every rank of the world must call
    this together."""
    return dist.new_group(dist.get_process_group_ranks(group), backend=backend, timeout=timeout)


def side_group(world_size: int) -> dist.ProcessGroup | None:
    """A gloo group of every rank for collectives on a thread beside training's (a
    background checkpoint writer), so the two never interleave on one group; None for a
    lone process. Every rank must call this together."""
    if world_size == 1 or not dist.is_initialized():
        return None
    return dist.new_group(list(range(world_size)), backend="gloo")
