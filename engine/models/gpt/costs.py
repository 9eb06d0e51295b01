"""The GPT family's FLOP and parameter terms (the FLOP formula is in ``engine.formulas``,
plain Python, so the performance model reads it without torch)."""

from __future__ import annotations

from engine.formulas import gpt_flops_per_iteration
from engine.formulas import layer_activation_bytes as layer_activation_bytes_formula
from engine.models.config import ModelConfig
from engine.models.cost_terms import config_activation_bytes, config_flops


def model_flops(
    cfg: ModelConfig, batch: int, seq: int, *, vocab: int, recompute: bool = False
) -> int:
    """Forward + backward matmul FLOPs on ``batch`` sequences, LM head ``vocab`` wide."""
    return config_flops(gpt_flops_per_iteration, cfg, batch, seq, vocab=vocab, recompute=recompute)


def trunk_params(cfg: ModelConfig) -> int:
    """Parameters of the layers and the word and position tables (BERT's trunk too).

    Per layer: QKV and output projections 4h² + 4h, MLP 2·h·f + f + h, two LayerNorms 4h.
    """
    h, f = cfg.hidden_size, cfg.ffn_size
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    return cfg.num_layers * per_layer + (cfg.vocab_size + cfg.max_positions) * h


def params_count(cfg: ModelConfig) -> int:
    """Parameters of the full model, unpadded vocabulary (what ``full_state_dict`` holds).

    With f = 4h and tied embeddings this is the usual
    12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), with s = max_positions, plus the 2h of the
    final LayerNorm that the approximation leaves out.
    """
    untied_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return trunk_params(cfg) + 2 * cfg.hidden_size + untied_head  # final LayerNorm


def layer_activation_bytes(
    cfg: ModelConfig, *, seq_len: int, batch_size: int, tp_size: int
) -> float:
    """16-bit bytes one layer keeps for backward (``engine.formulas.layer_activation_bytes``
    with the attention unfused, as the runtime's GPT and BERT layers store it)."""
    return config_activation_bytes(
        layer_activation_bytes_formula,
        cfg,
        cfg.num_heads,
        seq_len=seq_len,
        batch_size=batch_size,
        tp_size=tp_size,
        fused_attention=False,
    )
