"""The transformer's tensor-parallel MLP: column-parallel h→ffn, GeLU, SwiGLU or GeGLU,
row-parallel ffn→h.

SwiGLU (Llama) fuses the gate and up projections into one column-parallel weight whose
rows interleave them, ``(ffn two)``: row 2i is gate_i, row 2i+1 is up_i. Any contiguous
TP slice then holds matching gate/up pairs, so the stored layout does not depend on the
TP size and one GEMM (one sequence all-gather under SP) serves both. The element-wise
silu(gate) · up on that interleaved output is the kernel set's ``swiglu``
(``layers.kernels.swiglu``; the fused kernel writes dgate/dup straight into it). GeGLU
(Gemma) has the same interleaved layout with gelu_tanh(gate) · up, in plain torch ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers.kernel_set import Kernels, resolve_kernels
from layers.linear import (
    ColumnParallelLinear,
    branch_options,
    normal_init,
    residual_output_linear,
)
from layers.transformer_config import TransformerConfig
from parallel_state.random import RNGTracker


class ParallelMLP(nn.Module):
    """Column-parallel h→ffn, GeLU or SwiGLU on the TP shard, row-parallel ffn→h.

    The "dense" entry of ``layers.spec.MLPS``; constructed as every MLP slot is (``rng``
    unused: it draws no dropout). ``ffn_size`` overrides ``cfg.ffn_size`` (the mixture of
    experts' shared expert is this MLP at its own width).
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        tp_group: dist.ProcessGroup | None,
        rng: RNGTracker | None = None,
        kernels: Kernels | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        ffn_size: int | None = None,
    ) -> None:
        super().__init__()
        ffn_size = ffn_size or cfg.ffn_size
        self.sequence_parallel = cfg.sequence_parallel
        self.kernels = kernels or resolve_kernels(cfg.kernels)
        self.gated, self.approximate = activation_kind(cfg.activation)
        bias = cfg.linear_bias
        common = branch_options(cfg, tp_group, dtype, device)
        # Both biases are added by the fused ops around them: fc1's by bias + GeLU, fc2's
        # (returned with the output) by the layer's bias + dropout + residual add.
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            ffn_size * (2 if self.gated else 1),
            bias,
            init_method=normal_init(cfg.init_std),
            skip_bias_add=True,
            **common,
        )
        self.fc2 = residual_output_linear(cfg, ffn_size, common)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fc2 output without its bias, fc2's bias) for bias + dropout + add."""
        # fc1 hands its bias to the activation unless a compiled graph has it added in
        # the GEMM (``layers.compile``).
        h, bias = self.fc1(x) if self.fc1.skip_bias_add else (self.fc1(x), None)
        return self.fc2(activate(self.kernels, h, bias, self.gated, self.approximate))


def activation_kind(activation: str) -> tuple[bool, str | None]:
    """(gated, GeLU's ``approximate``) of ``cfg.activation``: a gated one's fc1 gives
    interleaved (gate, up) column pairs."""
    gated = activation in ("swiglu", "geglu")
    approximate = {"gelu": "none", "gelu_tanh": "tanh", "swiglu": None, "geglu": "tanh"}
    return gated, approximate[activation]


def activate(kernels, h: torch.Tensor, bias, gated: bool, approximate: str | None):
    """fc1's output (plus ``bias``) through the activation :func:`activation_kind` names:
    GeLU, SwiGLU (silu(gate) · up) or GeGLU (gelu_tanh(gate) · up), on the fused kernels
    where there is one."""
    if gated and approximate == "tanh":  # GeGLU
        if bias is not None:
            h = h + bias
        return F.gelu(h[..., 0::2], approximate="tanh") * h[..., 1::2]
    if gated:
        return kernels.swiglu(h, bias)
    return kernels.gelu(h, bias, approximate)
