"""The BERT family's FLOP and parameter terms (the FLOP formula is in ``engine.formulas``,
plain Python, so the performance model reads it without torch)."""

from __future__ import annotations

from engine.formulas import bert_flops_per_iteration
from engine.models.config import ModelConfig
from engine.models.cost_terms import config_flops
from engine.models.gpt.costs import (  # noqa: F401  (BERT's layers are GPT's)
    layer_activation_bytes,
    trunk_params,
)


def model_flops(
    cfg: ModelConfig, batch: int, seq: int, *, vocab: int, recompute: bool = False
) -> int:
    """Forward + backward matmul FLOPs on ``batch`` sequences (MLM on every position, SOP),
    MLM decoder ``vocab`` wide."""
    return config_flops(bert_flops_per_iteration, cfg, batch, seq, vocab=vocab, recompute=recompute)


def params_count(cfg: ModelConfig) -> int:
    """Parameters of the full model, unpadded vocabulary (what ``full_state_dict`` holds):
    GPT's layers and tables, plus the token types and the embedding LayerNorm, the MLM
    head, the pooler and the sentence-order head."""
    h, v = cfg.hidden_size, cfg.vocab_size
    untied_head = 0 if cfg.tie_embeddings else v * h
    embedding_extra = cfg.num_token_types * h + 2 * h  # token types, embedding LayerNorm
    mlm_head = h * h + h + 2 * h + v  # transform dense, its LayerNorm, decoder bias
    pooler_and_sop = h * h + h + 2 * h + 2
    return trunk_params(cfg) + embedding_extra + mlm_head + untied_head + pooler_and_sop
