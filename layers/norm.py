"""LayerNorm with replicated parameters, sequence-parallel aware."""

from __future__ import annotations

import torch
from torch import nn

from layers.kernel_set import resolve_kernels
from layers.utils import SP_GRAD_ATTR, mark_tp_dim


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with replicated weight and bias.

    Under sequence parallelism each rank normalizes only its sequence shard, so its
    parameter gradients are partial sums: they carry ``SP_GRAD_ATTR`` for the TP all-reduce.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        sequence_parallel: bool = False,
        kernels: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        factory = {"dtype": dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.bias = nn.Parameter(torch.zeros(size, **factory))
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.kernels = resolve_kernels(kernels)
        for p in (self.weight, self.bias):
            mark_tp_dim(p, None)
            setattr(p, SP_GRAD_ATTR, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)
