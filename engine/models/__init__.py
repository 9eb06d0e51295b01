"""The model families built from the tensor-parallel layers, their config and registry.

No family's module is imported here: ``build_model`` asks the family table
(``engine.models.families``) for the class, and ``GPTModel``, ``BertModel`` and
``LlamaModel`` (any family's ``Family.model``) are imported on first use (PEP 562).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.models.base import ParallelModel
from engine.models.config import ModelConfig, preset, preset_names
from engine.models.families import FAMILIES, Family, family
from parallel_state import ParallelState
from parallel_state.random import RNGTracker

_MODEL_CLASSES = {f.model: f for f in FAMILIES.values()}  # class name -> its family

__all__ = [
    "ModelConfig",
    "preset",
    "preset_names",
    *_MODEL_CLASSES,
    "ParallelModel",
    "FAMILIES",
    "Family",
    "family",
    "build_model",
]


def __getattr__(name: str) -> type:
    """A family's model class by its name (``engine.models.GPTModel``), imported now."""
    if name in _MODEL_CLASSES:
        return _MODEL_CLASSES[name].model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODEL_CLASSES))


def build_model(
    cfg: ModelConfig,
    state: ParallelState | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    rng: RNGTracker | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> ParallelModel:
    """The model that ``cfg.arch`` names, built on this rank's TP shard.

    ``state`` is the rank's ParallelState: its TP group and dropout RNG tracker go to every
    layer. Without one, ``tp_group`` and ``rng`` say them (None and None: one process).
    """
    model_class = family(cfg.arch).model_class()
    if state is not None:
        if tp_group is not None or rng is not None:
            raise TypeError("build_model takes a ParallelState or tp_group=/rng=, not both")
        tp_group, rng = state.tp_group, state.rng
    return model_class(cfg, tp_group=tp_group, rng=rng, dtype=dtype, device=device)
