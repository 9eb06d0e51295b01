"""What the transformer's layers read from a model config (a Protocol; engine's ModelConfig fits).

Its own module so attention, the MLP and the transformer layer can all name it without
importing each other.
"""

from __future__ import annotations

from typing import Protocol


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
