"""The tensor- and sequence-parallel transformer layer: LayerNorm, attention, MLP, residuals.

Activations are sequence-first, ``[s, b, h]``, so sequence parallelism splits dim 0 into
contiguous blocks. Under sequence parallelism everything outside the TP regions
(LayerNorm, residual dropout and add) runs on this rank's ``[s/tp, b, h]`` shard; the
column-parallel layers all-gather the sequence on entry and the row-parallel layers
reduce-scatter it on exit.

The norms (LayerNorm, RMSNorm), the activations (GeLU, SwiGLU) and bias-dropout-add go
through ``layers.kernel_set.resolve_kernels``, the one place where fused kernels get wired
in. The slots (norm, attention, MLP) are filled from a ``layers.spec.LayerSpec``: by
default the one the config names (``spec_for(cfg)``: ``cfg.norm``, ``cfg.attention``,
``cfg.mlp``), or one passed as ``spec=``. This module owns only the residual order,
dropout and recomputation around them. The parts live by concept: the config protocol
(``transformer_config``), the slot registries (``spec``), the MLP (``mlp``), the norm
(``norm``), attention (``attention``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from layers.attention import KVCache
from layers.kernel_set import Kernels, resolve_kernels
from layers.mlp import ParallelMLP
from layers.norm import LayerNorm
from layers.recompute import checkpointed, default_rng
from layers.spec import LayerSpec, spec_for
from layers.transformer_config import TransformerConfig
from parallel_state.groups import group_size, resolve_tp_group
from parallel_state.random import RNGTracker

__all__ = [
    "LayerNorm",
    "LayerSpec",
    "ParallelMLP",
    "ParallelTransformerLayer",
    "TransformerConfig",
]


class ParallelTransformerLayer(nn.Module):
    """One transformer layer, pre-LN (GPT-2) or post-LN (original BERT) per ``cfg``.

    Pre-LN:  x = x + drop(attn(LN₁(x)));   x = x + drop(mlp(LN₂(x)))
    Post-LN: x = LN₁(x + drop(attn(x)));   x = LN₂(x + drop(mlp(x)))
    Pre-LN with ``cfg.post_norms`` (Gemma 2): x = x + drop(N₃(attn(LN₁(x)))), and
    x = x + drop(N₄(mlp(LN₂(x)))).

    ``cfg.recompute``: "selective" recomputes the attention core only, "full" the whole
    layer (keeping just its input), "none" keeps everything. ``spec`` names the classes of
    the norm, attention and MLP slots (None: ``spec_for(cfg)``, the ones ``cfg`` names).
    ``cp_group`` (context parallelism) goes to the attention slot alone: the rest of the
    layer works token by token on this rank's share of the sequence.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        spec: LayerSpec | None = None,
        tp_group: dist.ProcessGroup | None = None,
        rng: RNGTracker | None = None,
        kernels: Kernels | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        cp_group: dist.ProcessGroup | None = None,
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
        spec = spec or spec_for(cfg)
        # Built in this order (the master weights' RNG draws follow it); the slot
        # constructors are layers.spec's. The residual order is cfg.pre_layernorm's.
        slot = dict(
            tp_group=tp_group, rng=self.rng, kernels=self.kernels, dtype=dtype, device=device
        )
        norm = dict(
            sequence_parallel=cfg.sequence_parallel,
            kernels=self.kernels,
            dtype=dtype,
            device=device,
        )
        self.attention_norm = spec.norm(cfg.hidden_size, cfg.layernorm_eps, **norm)
        window = {} if spec.window is None else {"window": spec.window}
        self.attention = spec.attention(cfg, **slot, cp_group=cp_group, **window)
        self.mlp_norm = spec.norm(cfg.hidden_size, cfg.layernorm_eps, **norm)
        self.mlp = spec.mlp(cfg, **slot)
        # Gemma 2's sandwich: each branch's output normalized before the residual add.
        self.post_attention_norm = self.post_mlp_norm = None
        if cfg.post_norms:
            self.post_attention_norm = spec.norm(cfg.hidden_size, cfg.layernorm_eps, **norm)
            self.post_mlp_norm = spec.norm(cfg.hidden_size, cfg.layernorm_eps, **norm)

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
            x = self._residual(_post_norm(attn, self.post_attention_norm), x)
            mlp = self.mlp(self.mlp_norm(x))
            return self._residual(_post_norm(mlp, self.post_mlp_norm), x)
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


def _post_norm(
    out_and_bias: tuple[torch.Tensor, torch.Tensor | None], norm: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A branch's (output, unadded bias), normalized by ``norm`` (the bias added first) when
    the layer has post norms; as it is otherwise."""
    if norm is None:
        return out_and_bias
    out, bias = out_and_bias
    return norm(out if bias is None else out + bias), None
