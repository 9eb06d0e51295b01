"""LayerNorm with replicated parameters, sequence-parallel aware."""

from __future__ import annotations

import torch
from torch import nn

from layers.kernel_set import Kernels, as_kernels
from layers.param_roles import mark_sp_partial_grad, mark_tp_dim


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with replicated weight and bias.

    Under sequence parallelism each rank normalizes only its sequence shard, so its
    parameter gradients are partial sums: they are marked (``layers.param_roles``) for the TP all-reduce.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        sequence_parallel: bool = False,
        kernels: str | Kernels = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        factory = {"dtype": dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.bias = nn.Parameter(torch.zeros(size, **factory))
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.kernels = as_kernels(kernels)
        for p in (self.weight, self.bias):
            mark_tp_dim(p, None)
            mark_sp_partial_grad(p, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (Llama): ``x / sqrt(mean(x²) + eps) · weight``, no bias.

    Computed in at least fp32 (half inputs are upcast, as Hugging Face does; fp64 stays
    fp64, where HF would round through fp32), by the kernel set's ``rms_norm``
    (``layers.kernels.rms_norm``). Replicated weight, partial under SP like LayerNorm's.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        sequence_parallel: bool = False,
        kernels: str | Kernels = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        factory = {"dtype": dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.kernels = as_kernels(kernels)
        mark_tp_dim(self.weight, None)
        mark_sp_partial_grad(self.weight, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}  # the norm slot's registry (layers.spec)


def make_norm(cfg, *, kernels: Kernels | None = None, dtype=None, device=None) -> nn.Module:
    """The norm ``cfg.norm`` names ("layernorm" or "rmsnorm"), width ``cfg.hidden_size``,
    on the model's resolved ``kernels`` (None: ``cfg.kernels``, resolved here)."""
    return NORMS[cfg.norm](
        cfg.hidden_size,
        cfg.layernorm_eps,
        sequence_parallel=cfg.sequence_parallel,
        kernels=kernels or cfg.kernels,
        dtype=dtype,
        device=device,
    )
