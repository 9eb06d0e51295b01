"""The Fashion-MNIST classifier: an MLP whose hidden layers are tensor-parallel.

784 → hidden (column-parallel, ReLU on each rank's shard) → hidden (row-parallel, summed
over TP) → 10 classes (replicated). ReLU acts element-wise, so the column split needs no
communication before it; the row-parallel layer's all-reduce is the only TP collective
forward, and the column-parallel input's all-reduce the only one backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.base import replicated_linear
from layers import ColumnParallelLinear, RowParallelLinear, gather_full, normal_init
from layers.mappings import gather_along
from layers.param_roles import tp_dim

IMAGE_PIXELS = 28 * 28
NUM_CLASSES = 10


class MLPClassifier(nn.Module):
    """``[b, 784]`` pixels in [0, 1] → ``[b, 10]`` logits (replicated on every TP rank).

    Weights are drawn at full size from the replicated RNG stream (He-normal, std
    √(2/fan_in), suited to ReLU) and sliced, so any TP size holds the same full model.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        tp_group: dist.ProcessGroup | None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        common = dict(tp_group=tp_group, dtype=dtype, device=device)
        self.fc1 = ColumnParallelLinear(
            IMAGE_PIXELS,
            hidden_size,
            init_method=normal_init(math.sqrt(2 / IMAGE_PIXELS)),
            **common,
        )
        self.fc2 = RowParallelLinear(
            hidden_size,
            hidden_size,
            init_method=normal_init(math.sqrt(2 / hidden_size)),
            **common,
        )
        self.head = replicated_linear(
            hidden_size,
            NUM_CLASSES,
            std=math.sqrt(1 / hidden_size),
            sequence_parallel=False,
            dtype=dtype,
            device=device,
        )
        self.tp_group = tp_group

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.fc1(pixels))  # [b, hidden/tp], this rank's units
        hidden = F.relu(self.fc2(hidden))  # [b, hidden], summed over TP
        return self.head(hidden)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-shape weights, gathered over TP (every TP rank must call this)."""
        return {n: gather_full(p, self.tp_group) for n, p in self.named_parameters()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Full-shape gradients, gathered over TP (every TP rank must call this)."""
        return {
            n: gather_along(p.grad, tp_dim(p), self.tp_group) for n, p in self.named_parameters()
        }

    def flops_per_image(self) -> int:
        """Model FLOPs of forward + backward for one image: 6 per weight (2 fwd, 4 bwd)."""
        return 6 * sum(m.in_features * m.out_features for m in (self.fc1, self.fc2, self.head))
