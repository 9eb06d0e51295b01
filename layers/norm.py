"""LayerNorm with replicated parameters, sequence-parallel aware."""

from __future__ import annotations

import torch
from torch import nn

from layers.kernel_set import Kernels, as_kernels
from layers.param_roles import mark_sp_partial_grad, mark_tp_dim


class _ReplicatedNorm(nn.Module):
    """A norm over the last dim with a replicated weight (ones) and, when ``has_bias``, bias
    (zeros). Under sequence parallelism each rank normalizes only its sequence shard, so
    the parameters' gradients are partial sums: they are marked (``layers.param_roles``)
    for the TP all-reduce."""

    has_bias: bool

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
        if self.has_bias:
            self.bias = nn.Parameter(torch.zeros(size, **factory))
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.kernels = as_kernels(kernels)
        for p in self.parameters():
            mark_tp_dim(p, None)
            mark_sp_partial_grad(p, sequence_parallel)


class LayerNorm(_ReplicatedNorm):
    """LayerNorm over the last dim with replicated weight and bias, partial under SP."""

    has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(_ReplicatedNorm):
    """RMSNorm over the last dim (Llama): ``x / sqrt(mean(x²) + eps) · weight``, no bias.

    Computed in at least fp32 (half inputs are upcast, as Hugging Face does; fp64 stays
    fp64, where HF would round through fp32), by the kernel set's ``rms_norm``
    (``layers.kernels.rms_norm``). Replicated weight, partial under SP like LayerNorm's.
    """

    has_bias = False

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
