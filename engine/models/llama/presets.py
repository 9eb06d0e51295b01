"""Llama-family model presets (each also a configs/model/<name>.yaml).

Sources: Llama-3.2-1B and Meta-Llama-3-8B, Qwen2-0.5B released config.json files.
``llama_tiny`` trains on the embedded corpus on CPU, like gpt_tiny.
"""

from __future__ import annotations

from typing import Any

_LLAMA = dict(
    arch="llama",
    norm="rmsnorm",
    position_embedding="rotary",
    activation="swiglu",
    qkv_bias=False,
    linear_bias=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    tie_embeddings=False,
    layernorm_eps=1e-5,
)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, rope_theta=500000.0)

LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "llama_tiny": dict(
        _LLAMA,
        vocab_size=8192,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=352,
        max_positions=256,
    ),
    "llama_1b": dict(
        _LLAMA3,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=8192,
        max_positions=131072,
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_scaling_factor=32.0,
        rope_original_max_positions=8192,
    ),
    "llama_8b": dict(
        _LLAMA3,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        max_positions=8192,
    ),
    "qwen2_0.5b": dict(
        _LLAMA,
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        ffn_hidden_size=4864,
        max_positions=32768,
        rope_theta=1000000.0,
        layernorm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
    ),
}
