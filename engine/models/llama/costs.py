"""The Llama family's FLOP and parameter terms.

The formulas live in ``engine.formulas`` (plain Python, so the performance model reads them
without torch); this module is where the family's folder names them and applies them to
a config.
"""

from __future__ import annotations

from engine.formulas import (  # noqa: F401  (the family's public cost terms)
    llama_flops_per_iteration,
    llama_layer_activation_bytes,
    llama_layer_weights,
    llama_params_count,
)
from engine.models.config import ModelConfig
from engine.models.cost_terms import config_activation_bytes, config_flops


def model_flops(
    cfg: ModelConfig, batch: int, seq: int, *, vocab: int, recompute: bool = False
) -> int:
    """Forward + backward matmul FLOPs on ``batch`` sequences, LM head ``vocab`` wide:
    SwiGLU's three matrices, the K/V projection ``kv_heads · head_dim`` wide; a MoE
    layer's experts by active parameters (``config_flops``)."""
    return config_flops(
        llama_flops_per_iteration,
        cfg,
        batch,
        seq,
        vocab=vocab,
        recompute=recompute,
        mlp_matrices=3,
        kv_width=cfg.kv_heads * cfg.head_dim,
    )


def params_count(cfg: ModelConfig) -> int:
    """Parameters of the full model, unpadded vocabulary (what ``full_state_dict`` holds):
    the q and output projections (and q's bias) ``heads · head_dim`` wide where that is
    not h (Qwen3's ``head_dim``), and two ``[head_dim]`` QK-norm weights per layer under
    ``qk_norm``."""
    h, width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    per_layer = (2 * h + cfg.qkv_bias) * (width - h) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return cfg.num_layers * per_layer + llama_params_count(
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        ffn_hidden=cfg.ffn_size,
        kv_width=cfg.kv_heads * cfg.head_dim,
        qkv_bias=cfg.qkv_bias,
        linear_bias=cfg.linear_bias,
        tied=cfg.tie_embeddings,
    )


def layer_activation_bytes(
    cfg: ModelConfig, *, seq_len: int, batch_size: int, tp_size: int
) -> float:
    """16-bit bytes one Llama layer keeps for backward (``engine.formulas``' Llama term:
    RMSNorm inputs in fp32, SwiGLU's f-wide tensors, fused attention)."""
    return config_activation_bytes(
        llama_layer_activation_bytes,
        cfg,
        cfg.ffn_size,
        seq_len=seq_len,
        batch_size=batch_size,
        tp_size=tp_size,
    )
