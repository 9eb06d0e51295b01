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
    scale_offset = 0.0  # the output is scaled by scale_offset + weight (Gemma's: 1)

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


class GemmaRMSNorm(_ReplicatedNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x²) + eps) · (1 + weight)``, the weight starting at
    zero (so a fresh norm is the identity scale). The scale ``1 + weight`` is formed in at
    least fp32, as Hugging Face's Gemma forms it, and the result cast back to x's dtype."""

    has_bias = False
    scale_offset = 1.0

    def __init__(self, size: int, eps: float, **kwargs) -> None:
        super().__init__(size, eps, **kwargs)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))
        return self.kernels.rms_norm(x, self.scale_offset + wide, self.eps).to(x.dtype)


# The norm slot's registry (layers.spec).
NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "gemma_rmsnorm": GemmaRMSNorm}


def make_norm(cfg, *, kernels: Kernels | None = None, dtype=None, device=None) -> nn.Module:
    """The norm ``cfg.norm`` names (a key of :data:`NORMS`), width ``cfg.hidden_size``,
    on the model's resolved ``kernels`` (None: ``cfg.kernels``, resolved here)."""
    return NORMS[cfg.norm](
        cfg.hidden_size,
        cfg.layernorm_eps,
        sequence_parallel=cfg.sequence_parallel,
        kernels=kernels or cfg.kernels,
        dtype=dtype,
        device=device,
    )
