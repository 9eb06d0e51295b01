"""The tensor- and sequence-parallel transformer layer: LayerNorm, attention, MLP, residuals.

Activations are sequence-first, ``[s, b, h]``, so sequence parallelism splits dim 0 into
contiguous blocks. Under sequence parallelism everything outside the TP regions
(LayerNorm, residual dropout and add) runs on this rank's ``[s/tp, b, h]`` shard; the
column-parallel layers all-gather the sequence on entry and the row-parallel layers
reduce-scatter it on exit.

LayerNorm, GeLU and bias-dropout-add go through :func:`resolve_kernels`, the one place
where fused kernels get wired in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers.attention import KVCache, ParallelAttention
from layers.cross_entropy import vocab_parallel_cross_entropy
from layers.linear import ColumnParallelLinear, RowParallelLinear, normal_init
from layers.recompute import checkpointed, default_rng, dropout_stream
from layers.utils import SP_GRAD_ATTR, group_size, mark_tp_dim, resolve_tp_group
from parallel_state.random import RNGTracker


class TransformerConfig(Protocol):
    """What a transformer layer reads from the model config (engine's ModelConfig fits)."""

    hidden_size: int
    num_heads: int
    num_layers: int
    hidden_dropout: float
    attention_dropout: float
    layernorm_eps: float
    sequence_parallel: bool
    recompute: str  # "none" | "selective" | "full"
    activation: str  # "gelu" (exact) | "gelu_tanh"
    kernels: str  # "auto" | "torch" | "triton" | "apex"
    init_std: float

    @property
    def ffn_size(self) -> int: ...
    @property
    def causal(self) -> bool: ...
    @property
    def pre_layernorm(self) -> bool: ...


def _torch_bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    x = x if bias is None else x + bias
    if training and p > 0:
        # native_dropout keeps a 1-byte mask for backward; F.dropout keeps an x-sized one on CPU.
        x = torch.native_dropout(x, p, True)[0]
    return residual + x


@dataclass(frozen=True)
class Kernels:
    """The element-wise ops of a layer, as one swappable set."""

    layer_norm: Callable[..., torch.Tensor]  # (x, weight, bias, eps)
    gelu: Callable[..., torch.Tensor]  # (x, bias | None, approximate: "none" | "tanh")
    bias_dropout_add: Callable[..., torch.Tensor]  # (x, bias | None, residual, p, training)
    # (logits, target, *, vocab_size, tp_group, comm_timer): vocab_parallel_cross_entropy's
    cross_entropy: Callable[..., torch.Tensor]


TORCH_KERNELS = Kernels(
    layer_norm=lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
    gelu=lambda x, b, approximate: F.gelu(x if b is None else x + b, approximate=approximate),
    bias_dropout_add=_torch_bias_dropout_add,
    cross_entropy=vocab_parallel_cross_entropy,
)


def _fused_kernels(
    choose: Callable[[str, torch.Tensor], str | None], norm_backend: str | None
) -> Kernels:
    """The ``layers.kernels`` ops; ``choose(op, x)`` names the backend, or None for torch's."""
    from layers import kernels as fused

    def layer_norm(x, w, b, eps):
        backend = norm_backend or choose("layer_norm", x)
        if backend is None:
            return TORCH_KERNELS.layer_norm(x, w, b, eps)
        return fused.layer_norm(x, w, b, eps, backend=backend)

    def gelu(x, bias, approximate):
        backend = choose("bias_gelu", x)
        if backend is None:
            return TORCH_KERNELS.gelu(x, bias, approximate)
        return fused.bias_gelu(x, bias, approximate=approximate, backend=backend)

    def bias_dropout_add(x, bias, residual, p, training):
        backend = choose("bias_dropout_add", x)
        if backend is None:
            return TORCH_KERNELS.bias_dropout_add(x, bias, residual, p, training)
        return fused.bias_dropout_add(x, bias, residual, p, training, backend=backend)

    def cross_entropy(logits, target, **kwargs):
        # Overwrites the logits with their gradient: callers pass logits nothing else reads.
        backend = choose("cross_entropy", logits)
        if backend is None:
            return TORCH_KERNELS.cross_entropy(logits, target, **kwargs)
        return fused.fused_vocab_parallel_cross_entropy(logits, target, backend=backend, **kwargs)

    return Kernels(layer_norm, gelu, bias_dropout_add, cross_entropy)


def resolve_kernels(name: str) -> Kernels:
    """The kernel set for ``ModelConfig.kernels``.

    - ``auto``: on CUDA tensors, per op what ``layers.kernels.dispatch.MODEL_AUTO`` names
      (the fused kernel only where it was measured to beat torch); torch's ops on CPU;
    - ``triton``: always the Triton kernels (on CPU they run under ``TRITON_INTERPRET=1``,
      which is how CI checks them inside a whole model);
    - ``apex``: apex's FusedLayerNorm (it must be importable), Triton for the rest on CUDA;
    - ``torch``: torch's ops everywhere.
    """
    if name == "torch":
        return TORCH_KERNELS
    from layers.kernels.dispatch import MODEL_AUTO

    on_cuda = lambda op, x: "triton" if x.is_cuda else None
    if name == "auto":
        return _fused_kernels(
            lambda op, x: on_cuda(op, x) if MODEL_AUTO[op] == "triton" else None, None
        )
    if name == "triton":
        return _fused_kernels(lambda op, x: "triton", None)
    if name == "apex":
        return _fused_kernels(on_cuda, "apex")
    raise ValueError(f"model.kernels={name!r} is not one of auto, triton, apex, torch")


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
        self.sequence_parallel, self.hidden_dropout = cfg.sequence_parallel, cfg.hidden_dropout
        self.kernels = resolve_kernels(cfg.kernels)
        norm = dict(
            sequence_parallel=cfg.sequence_parallel, kernels=cfg.kernels, dtype=dtype, device=device
        )
        self.attention_norm = LayerNorm(cfg.hidden_size, cfg.layernorm_eps, **norm)
        self.attention = ParallelAttention(
            cfg, tp_group=tp_group, rng=self.rng, dtype=dtype, device=device
        )
        self.mlp_norm = LayerNorm(cfg.hidden_size, cfg.layernorm_eps, **norm)
        self.mlp = ParallelMLP(cfg, tp_group=tp_group, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """``x``: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); same shape out.

        ``cache`` (inference only) holds this layer's past keys and values.
        """
        if self.recompute_full and cache is None:
            return checkpointed(self._forward, x, mask, rng=self.rng)
        return self._forward(x, mask, cache)

    def _forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if self.pre_layernorm:
            x = self._residual(self.attention(self.attention_norm(x), mask, cache), x)
            return self._residual(self.mlp(self.mlp_norm(x)), x)
        x = self.attention_norm(self._residual(self.attention(x, mask, cache), x))
        return self.mlp_norm(self._residual(self.mlp(x), x))

    def _residual(
        self, out_and_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor
    ) -> torch.Tensor:
        # The residual stream is replicated across TP, or sequence-sharded under SP. The row
        # layers return their bias unadded, so it is added here, after their reduction.
        out, bias = out_and_bias
        with dropout_stream(self.rng, sharded=self.sequence_parallel and self.training):
            return self.kernels.bias_dropout_add(
                out, bias, residual, self.hidden_dropout, self.training
            )
