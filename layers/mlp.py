"""The transformer's tensor-parallel MLP: column-parallel h→ffn, GeLU, row-parallel ffn→h."""

from __future__ import annotations

import math

import torch
from torch import nn

from layers.kernel_set import resolve_kernels
from layers.linear import ColumnParallelLinear, RowParallelLinear, normal_init
from layers.transformer_config import TransformerConfig


class ParallelMLP(nn.Module):
    """Column-parallel h→ffn, GeLU on the TP shard, row-parallel ffn→h."""

    def __init__(self, cfg: TransformerConfig, *, tp_group, dtype, device) -> None:
        super().__init__()
        self.sequence_parallel = cfg.sequence_parallel
        self.kernels = resolve_kernels(cfg.kernels)
        self.approximate = {"gelu": "none", "gelu_tanh": "tanh"}[cfg.activation]
        common = dict(
            tp_group=tp_group, sequence_parallel=cfg.sequence_parallel, dtype=dtype, device=device
        )
        # Both biases are added by the fused ops around them: fc1's by bias + GeLU, fc2's
        # (returned with the output) by the layer's bias + dropout + residual add.
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, cfg.ffn_size, init_method=normal_init(cfg.init_std),
            skip_bias_add=True, **common,
        )  # fmt: skip
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.fc2 = RowParallelLinear(
            cfg.ffn_size, cfg.hidden_size, init_method=normal_init(out_std),
            skip_bias_add=True, **common,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fc2 output without its bias, fc2's bias) for bias + dropout + add."""
        return self.fc2(self.kernels.gelu(*self.fc1(x), self.approximate))
