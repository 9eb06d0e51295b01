"""Small helpers shared by the parallel layers: group resolution, divisibility, sharding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

import parallel_state

# Attribute set on every parameter: the tensor dim it is split along across TP, or None
# when each TP rank holds the whole tensor. Checkpointing and HF import read it to
# shard/unshard without knowing the layer type.
TP_DIM_ATTR = "tp_split_dim"
# Attribute set on replicated parameters whose gradient is only partial on each TP rank
# (LayerNorm weights under sequence parallelism); gradient sync sums them across TP.
SP_GRAD_ATTR = "sequence_parallel_grad"


class CommTimer(Protocol):
    """Times blocking TP collectives; the engine's step timer implements it.

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
    """Run ``collective``, timed by ``timer`` when there is one."""
    if timer is None:
        return collective(*args, **kwargs)
    token = timer.begin()
    try:
        return collective(*args, **kwargs)
    finally:
        timer.end(token)


def resolve_tp_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``tp_group`` itself, or the current ParallelState's TP group; None when not distributed."""
    if tp_group is not None:
        return tp_group
    if parallel_state.is_initialized():
        return parallel_state.get().tp_group
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "torch.distributed runs on several ranks but parallel_state is not initialized: "
            "call parallel_state.initialize(tp_size) or pass tp_group="
        )
    return None  # a plain single process: TP size 1


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for None (no distribution)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


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


def mark_tp_dim(param: torch.nn.Parameter, dim: int | None) -> torch.nn.Parameter:
    """Record how ``param`` is split across TP (see ``TP_DIM_ATTR``)."""
    setattr(param, TP_DIM_ATTR, dim)
    return param


def gather_full(param: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather a TP-split parameter (or its grad, given ``param``'s split) to full shape."""
    dim = getattr(param, TP_DIM_ATTR, None)
    return gather_along(param.detach(), dim, resolve_tp_group(tp_group))


def gather_along(
    tensor: torch.Tensor, dim: int | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (no autograd); identity if dim is None."""
    world = group_size(group)
    if dim is None or world == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
