"""The tensor- and sequence-parallel transformer layer: LayerNorm, attention, MLP, residuals.

Activations are sequence-first, ``[s, b, h]``, so sequence parallelism splits dim 0 into
contiguous blocks. Under sequence parallelism everything outside the TP regions
(LayerNorm, residual dropout and add) runs on this rank's ``[s/tp, b, h]`` shard; the
column-parallel layers all-gather the sequence on entry and the row-parallel layers
reduce-scatter it on exit.

The norms (LayerNorm, RMSNorm), the activations (GeLU, SwiGLU) and bias-dropout-add go
through ``layers.kernel_set.resolve_kernels``, the one place where fused kernels get wired
in. The parts live by concept: the config protocol (``transformer_config``), the MLP
(``mlp``), the norm (``norm``), attention (``attention``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from layers.attention import KVCache, ParallelAttention
from layers.kernel_set import Kernels, resolve_kernels
from layers.mlp import ParallelMLP
from layers.norm import LayerNorm, make_norm
from layers.recompute import checkpointed, default_rng
from layers.transformer_config import TransformerConfig
from parallel_state.groups import group_size, resolve_tp_group
from parallel_state.random import RNGTracker

__all__ = ["LayerNorm", "ParallelMLP", "ParallelTransformerLayer", "TransformerConfig"]


class ParallelTransformerLayer(nn.Module):
    """One transformer layer, pre-LN (GPT-2) or post-LN (original BERT) per ``cfg``.

    Pre-LN:  x = x + drop(attn(LN₁(x)));   x = x + drop(mlp(LN₂(x)))
    Post-LN: x = LN₁(x + drop(attn(x)));   x = LN₂(x + drop(mlp(x)))

    ``cfg.recompute``: "selective" recomputes the attention core only, "full" the whole
    layer (keeping just its input), "none" keeps everything.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        rng: RNGTracker | None = None,
        kernels: Kernels | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp_group = resolve_tp_group(tp_group)
        self.rng = rng if rng is not None else default_rng()
        dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
        if self.rng is None and dropout and group_size(tp_group) > 1:
            raise ValueError(
                "dropout under tensor parallelism needs the TP-aware RNG tracker: "
                "call parallel_state.initialize(...) or pass rng="
            )
        self.pre_layernorm, self.recompute_full = cfg.pre_layernorm, cfg.recompute == "full"
        self.draws_random = dropout  # only then does recomputation replay the RNG streams
        self.sequence_parallel, self.hidden_dropout = cfg.sequence_parallel, cfg.hidden_dropout
        self.kernels = kernels or resolve_kernels(cfg.kernels)  # the model hands its one set
        # The norm (LayerNorm | RMSNorm), attention (MHA | GQA | MQA, biases) and MLP
        # (GeLU | SwiGLU) are chosen by cfg; the residual order by cfg.pre_layernorm.
        self.attention_norm = make_norm(cfg, kernels=self.kernels, dtype=dtype, device=device)
        self.attention = ParallelAttention(
            cfg, tp_group=tp_group, rng=self.rng, dtype=dtype, device=device
        )
        self.mlp_norm = make_norm(cfg, kernels=self.kernels, dtype=dtype, device=device)
        self.mlp = ParallelMLP(
            cfg, tp_group=tp_group, kernels=self.kernels, dtype=dtype, device=device
        )

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``x``: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); same shape out.

        ``cache`` (inference only) holds this layer's past keys and values; ``rotary`` the
        (cos, sin) tables of rotary position embeddings.
        """
        if self.recompute_full and cache is None:
            rng = self.rng if self.draws_random else None  # no draws: a plain checkpoint
            if rotary is None:
                return checkpointed(self._forward, x, mask, rng=rng)
            return checkpointed(self._forward, x, mask, None, rotary, rng=rng)
        if rotary is None:
            return self._forward(x, mask, cache)
        return self._forward(x, mask, cache, rotary)

    def _forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.pre_layernorm:
            attn = self.attention(self.attention_norm(x), mask, cache, rotary)
            x = self._residual(attn, x)
            return self._residual(self.mlp(self.mlp_norm(x)), x)
        x = self.attention_norm(self._residual(self.attention(x, mask, cache, rotary), x))
        return self.mlp_norm(self._residual(self.mlp(x), x))

    def _residual(
        self, out_and_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor
    ) -> torch.Tensor:
        # The residual stream is replicated across TP, or sequence-sharded under SP. The row
        # layers return their bias unadded, so it is added here, after their reduction.
        out, bias = out_and_bias
        return self.kernels.bias_dropout_add(
            out,
            bias,
            residual,
            self.hidden_dropout,
            self.training,
            rng=self.rng,
            sharded=self.sequence_parallel,
        )
