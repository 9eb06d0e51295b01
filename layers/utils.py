"""Small helpers shared by the parallel layers: divisibility, sharding marks, the comm timer.

The group helpers (``group_size``, ``group_rank``, ``resolve_tp_group``) live in
``parallel_state.groups``; they are re-exported here for the layers' older importers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from parallel_state.groups import group_rank as group_rank  # re-exported, see above
from parallel_state.groups import group_size as group_size
from parallel_state.groups import resolve_tp_group as resolve_tp_group


class CommTimer(Protocol):
    """Times the TP collectives the step waits on; the engine's step timer implements it.

    A blocking collective is timed whole; one that overlaps work (f's all-reduce in
    ``layers.linear.linear_after_copy``) only for its wait, the part left exposed.

    Layers never build one: the trainer attaches it to a model with ``attach_comm_timer``
    and each module hands its own ``comm_timer`` to the collectives it calls.
    """

    def begin(self) -> Any: ...  # a token for ``end`` (a wall clock, or a CUDA event)

    def end(self, token: Any) -> None: ...


COMM_TIMER_ATTR = "comm_timer"


def attach_comm_timer(module: torch.nn.Module, timer: CommTimer | None) -> None:
    """Give every submodule that owns a TP group ``timer`` (None detaches it)."""
    for m in module.modules():
        if hasattr(m, "tp_group"):
            setattr(m, COMM_TIMER_ATTR, timer)


def comm_timer_of(module: torch.nn.Module) -> CommTimer | None:
    """The timer attached to ``module``, or None."""
    return module.__dict__.get(COMM_TIMER_ATTR)


def timed(timer: CommTimer | None, collective: Callable, *args, **kwargs):
    """Run ``collective``, timed by ``timer`` when there is one.

    Not while compiling: in a compiled graph the collective is a node that runs later, so
    a clock read here would time the tracing, and Dynamo would break the graph at every
    collective to run it (the waits of a compiled step count as compute instead).
    """
    if timer is None or torch.compiler.is_compiling():
        return collective(*args, **kwargs)
    token = timer.begin()
    try:
        return collective(*args, **kwargs)
    finally:
        timer.end(token)


def as_autocast(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in the dtype autocast casts a matmul's inputs to on ``t``'s device, where
    autocast is on there (else ``t`` as it is): for code that casts before a collective,
    a save or an op autocast does not cover, as the next matmul would have anyway."""
    if t is None or not torch.is_autocast_enabled(t.device.type):
        return t
    return t.to(torch.get_autocast_dtype(t.device.type))


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising an error naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
            f"choose a tp_size that divides {numerator}"
        )
    return numerator // denominator


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple`` (usually tp_size × 128)."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and multiple ({multiple}) must be >= 1")
    return -(-vocab_size // multiple) * multiple


def shard(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """The ``rank``-th contiguous block of ``full`` along ``dim`` (a copy; all of it if dim is None)."""
    if dim is None:
        return full.detach().clone()
    block = divide(full.shape[dim], size, f"dim {dim} of a tensor of shape {tuple(full.shape)}")
    return full.detach().narrow(dim, rank * block, block).clone()


# A parameter sharded over DP by FSDP2 is a DTensor whose logical shape is the TP-local
# one; the helpers below let layout-aware code (checkpoints, full state dicts) read and
# write the TP-local value without asking which DP mode made the parameter.


def dp_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter, gradient or state sharded by FSDP2).

    Until FSDP2 has loaded ``torch.distributed.tensor`` no tensor can be one, and importing
    it only to answer no costs a process ~2 s of CPU (it brings in dynamo)."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores: its DP shard for a DTensor, else ``t`` itself."""
    return t.to_local() if dp_sharded(t) else t


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """This TP rank's whole tensor: a DTensor gathered over its DP group (collective: every
    DP rank calls it), else ``t`` detached."""
    return t.detach().full_tensor() if dp_sharded(t) else t.detach()


@torch.no_grad()
def assign_tp_local_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param`` to the TP-local ``value`` (a DTensor keeps only its DP shard of it)."""
    if dp_sharded(param):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(
            value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(value)
