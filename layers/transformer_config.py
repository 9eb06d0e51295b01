"""What the transformer's layers read from a model config (a Protocol; engine's ModelConfig fits).

Its own module so attention, the MLP and the transformer layer can all name it without
importing each other.
"""

from __future__ import annotations

from typing import Protocol


class TransformerConfig(Protocol):
    """Every field the layers read from the model config (engine's ModelConfig fits; its
    ``validate`` checks the values). ``tests/test_layer_spec.py`` keeps this list whole."""

    hidden_size: int  # model width h
    num_heads: int  # attention heads; whole heads per TP rank
    num_kv_heads: int | None  # key/value heads (GQA; 1 = MQA); None means num_heads
    num_layers: int  # scales the init of residual-branch outputs, std / √(2·layers)
    hidden_dropout: float  # on residual branches
    attention_dropout: float  # on attention probabilities
    layernorm_eps: float  # epsilon of the norm (LayerNorm or RMSNorm)
    sequence_parallel: bool  # norms and residuals on this rank's sequence shard
    recompute: str  # "none" | "selective" (attention core) | "full" (whole layer)
    activation: str  # "gelu" (exact) | "gelu_tanh" | "swiglu" (gated, Llama)
    kernels: str  # "auto" | "torch" | "triton" | "apex"
    init_std: float  # std of the normal weight init
    norm: str  # the norm slot, a key of layers.norm.NORMS: "layernorm" | "rmsnorm"
    attention: str  # the attention slot, a key of layers.spec.ATTENTIONS: "standard"
    mlp: str  # the MLP slot, a key of layers.spec.MLPS: "dense"
    qkv_bias: bool  # bias on the query/key/value projections
    linear_bias: bool  # bias on the attention output and MLP projections

    @property
    def ffn_size(self) -> int: ...  # MLP inner width
    @property
    def causal(self) -> bool: ...  # attend only to earlier positions
    @property
    def pre_layernorm(self) -> bool: ...  # pre-LN (GPT-2) rather than post-LN (BERT)
