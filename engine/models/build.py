"""``build_model``: the model a config names, built on this rank's TP shard."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.models.base import ParallelModel
from engine.models.config import ModelConfig
from engine.models.families import family
from layers.moe import route_over_context, shard_experts
from parallel_state import ParallelState
from parallel_state.random import RNGTracker


def build_model(
    cfg: ModelConfig,
    state: ParallelState | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    rng: RNGTracker | None = None,
    ep_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> ParallelModel:
    """The model that ``cfg.arch`` names, built on this rank's TP shard.

    ``state`` is the rank's ParallelState: its TP group, its CP group (context parallelism:
    ring attention) and dropout RNG tracker go to every layer, and its ``expert`` group
    splits the MoE layers' experts (``shard_experts``); the CP group also sums the routers'
    balance statistics (``route_over_context``). Without one, ``tp_group``, ``rng``
    and ``ep_group`` say them (None: one process, no cp).
    """
    model_class = family(cfg.arch).model_class()
    cp_group = None
    if state is not None:
        if tp_group is not None or rng is not None or ep_group is not None:
            raise TypeError(
                "build_model takes a ParallelState or tp_group=/rng=/ep_group=, not both"
            )
        tp_group, rng, cp_group = state.tp_group, state.rng, state.group("cp")
        ep_group = state.group("expert")
    model = model_class(
        cfg, tp_group=tp_group, cp_group=cp_group, rng=rng, dtype=dtype, device=device
    )
    return shard_experts(route_over_context(model, cp_group), ep_group)
