"""Activation memory of one transformer layer: measured on this machine vs the formula table of docs/PERFMODEL.md.

The measurement counts the bytes of every tensor autograd keeps for backward while one
layer runs forward (``saved_tensors_hooks``), once per storage, leaving out parameters. The
formula assumes 16-bit activations, 1-byte dropout masks and an attention that stores its
s×s softmax, dropout mask and dropout output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from engine.models.config import ModelConfig
from engine.models.families import family
from layers.transformer import ParallelTransformerLayer
from parallel_state.groups import group_size, resolve_tp_group


def formula_bytes(cfg: ModelConfig, *, seq_len: int, batch_size: int, tp_size: int) -> float:
    """The formula's bytes per layer for ``cfg``'s family, sequence parallelism and
    recompute mode (its ``costs.layer_activation_bytes``: for GPT and BERT the table's
    ``engine.formulas.layer_activation_bytes`` with the attention unfused)."""
    return family(cfg.arch).costs.layer_activation_bytes(
        cfg, seq_len=seq_len, batch_size=batch_size, tp_size=tp_size
    )


def measure_layer_bytes(
    cfg: ModelConfig,
    *,
    seq_len: int,
    batch_size: int,
    dtype: torch.dtype = torch.bfloat16,
    tp_group: dist.ProcessGroup | None = None,
) -> int:
    """Bytes one training-mode layer keeps for backward (parameters excluded).

    Every TP rank must call this together (the layer's collectives run). Dropout draws
    need a seeded RNG tracker (``ParallelState.seed``) when dropout > 0.
    """
    tp_group = resolve_tp_group(tp_group)
    layer = ParallelTransformerLayer(cfg, tp_group=tp_group, dtype=dtype).train()
    param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    rows = seq_len // (group_size(tp_group) if cfg.sequence_parallel else 1)
    x = torch.randn(rows, batch_size, cfg.hidden_size, dtype=dtype, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values())


@dataclass(frozen=True)
class MemoryRow:
    """Measured and predicted activation bytes of one layer configuration."""

    label: str
    measured: int
    formula: float


def activation_memory_table(
    cfg: ModelConfig, *, seq_len: int, batch_size: int, dtype: torch.dtype = torch.bfloat16
) -> list[MemoryRow]:
    """Measure the formula table's configurations at the current TP size (collective over TP)."""
    t = group_size(resolve_tp_group(None))
    cases = [
        ("tensor parallel", dict(sequence_parallel=False, recompute="none")),
        ("TP + sequence parallel", dict(sequence_parallel=True, recompute="none")),
        ("TP + SP + selective recompute", dict(sequence_parallel=True, recompute="selective")),
        ("full recompute (TP + SP)", dict(sequence_parallel=True, recompute="full")),
    ]
    rows = []
    for label, overrides in cases:
        case = replace(cfg, **overrides)
        measured = measure_layer_bytes(case, seq_len=seq_len, batch_size=batch_size, dtype=dtype)
        formula = formula_bytes(case, seq_len=seq_len, batch_size=batch_size, tp_size=t)
        rows.append(MemoryRow(f"{label}, t={t}", measured, formula))
    return rows
