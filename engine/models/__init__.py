"""GPT and BERT built from the tensor-parallel layers, and their config."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.models.base import ParallelModel
from engine.models.bert import BertModel
from engine.models.config import ModelConfig, preset, preset_names
from engine.models.gpt import GPTModel

__all__ = [
    "ModelConfig",
    "preset",
    "preset_names",
    "GPTModel",
    "BertModel",
    "ParallelModel",
    "build_model",
]


def build_model(
    cfg: ModelConfig,
    *,
    tp_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> ParallelModel:
    """The GPTModel or BertModel that ``cfg.arch`` names, built on this rank's TP shard."""
    classes = {"gpt": GPTModel, "bert": BertModel}
    if cfg.arch not in classes:
        raise ValueError(f"model.arch={cfg.arch!r} is not one of {tuple(classes)}")
    return classes[cfg.arch](cfg, tp_group=tp_group, dtype=dtype, device=device)
