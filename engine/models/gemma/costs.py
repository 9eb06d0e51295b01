"""The Gemma 2 family's FLOP and parameter terms: the Llama family's (a gated MLP of three
matrices, grouped-query attention), plus the two post norms of each layer.

The sliding window and the soft caps change no matmul FLOP count as the planner counts
them (the attention scores are priced as full causal ones: an upper bound on windowed
layers). The FLOP and activation terms price attention h wide: with an
``attention_head_dim`` of its own (heads · head_dim ≠ h) they are estimates; the parameter
count is exact.
"""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.llama import costs as llama


def model_flops(
    cfg: ModelConfig, batch: int, seq: int, *, vocab: int, recompute: bool = False
) -> int:
    """Forward + backward matmul FLOPs on ``batch`` sequences, LM head ``vocab`` wide (the
    Llama terms: GeGLU's three matrices as SwiGLU's)."""
    return llama.model_flops(cfg, batch, seq, vocab=vocab, recompute=recompute)


def params_count(cfg: ModelConfig) -> int:
    """Parameters of the full model, unpadded vocabulary: Llama's count with the same
    widths (which takes the query and output projections ``heads · head_dim`` wide where
    that is not h, ``attention_head_dim``), plus each layer's two post norms (2·h)."""
    per_layer = 2 * cfg.hidden_size if cfg.post_norms else 0
    return llama.params_count(cfg) + cfg.num_layers * per_layer


def layer_activation_bytes(
    cfg: ModelConfig, *, seq_len: int, batch_size: int, tp_size: int
) -> float:
    """16-bit bytes one layer keeps for backward: the Llama term (the post norms' inputs
    and the soft-capped scores are not counted: an estimate)."""
    return llama.layer_activation_bytes(
        cfg, seq_len=seq_len, batch_size=batch_size, tp_size=tp_size
    )
