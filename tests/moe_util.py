"""The tiny mixture-of-experts configs the MoE tests share (no transformers import, so
that the multi-rank tests' ranks start fast)."""

from __future__ import annotations

from engine.models import ModelConfig

H, FFN, EXPERTS = 16, 12, 6
# The Llama family's keys over the GPT defaults.
LLAMA = dict(
    arch="llama",
    norm="rmsnorm",
    position_embedding="rotary",
    qkv_bias=False,
    tie_embeddings=False,
)


def moe_cfg(**overrides) -> ModelConfig:
    """Two layers of hidden 16, both with 6 SwiGLU experts of width 12, top-2; validated."""
    base = dict(
        hidden_size=H,
        num_heads=2,
        num_layers=2,
        vocab_size=64,
        max_positions=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        kernels="torch",
        activation="swiglu",
        linear_bias=False,
        mlp="moe",
        moe_num_experts=EXPERTS,
        moe_top_k=2,
        moe_ffn_hidden_size=FFN,
    )
    cfg = ModelConfig(**{**base, **overrides})
    cfg.validate()
    return cfg
