"""The tiny model configurations many tests build, written once: a test passes only the keys
in which its model differs, so the numbers that matter to it stand out. No transformers
import, so that multi-rank tests' ranks start fast."""

from __future__ import annotations

from engine.models import ModelConfig, preset
from tests.torch_reference import tiny_gpt

# Two layers of four heads on hidden 32, without dropout (so two runs compare exactly).
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
# The Llama family's keys over the GPT defaults (its MLP aside: SWIGLU).
LLAMA = dict(
    arch="llama",
    norm="rmsnorm",
    position_embedding="rotary",
    qkv_bias=False,
    tie_embeddings=False,
)
SWIGLU = dict(activation="swiglu", linear_bias=False)
# Grouped-query attention (2 KV heads) with an untied head, in transformers' keys.
HF_GQA_UNTIED = dict(num_key_value_heads=2, tie_word_embeddings=False)


def tiny_kwargs(**overrides) -> dict:
    """TINY with ``overrides``: keyword arguments for ModelConfig or a preset."""
    return {**TINY, **overrides}


def tiny_config(**overrides) -> ModelConfig:
    """A ModelConfig of TINY with ``overrides`` (unvalidated, as ModelConfig(...) is)."""
    return ModelConfig(**tiny_kwargs(**overrides))


def hf_tiny(**overrides) -> dict:
    """Keyword arguments for a transformers config class: a tiny Llama-family checkpoint
    (a prime vocabulary, two layers of four heads on hidden 64, 64 positions) with
    ``overrides`` (intermediate sizes and KV heads vary by test)."""
    base = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {**base, "max_position_embeddings": 64, **overrides}


def serving_config(family: str) -> ModelConfig:
    """The serving tests' tiny random decoders: gpt (4 heads) or llama (rotary, RMSNorm,
    SwiGLU, 4 heads and 2 KV heads). init_std 0.2 gives logits of order 1, as a trained
    model's are (at 0.02 the distribution is nearly flat and argmax gaps tiny)."""
    common = dict(max_positions=64, init_std=0.2)
    if family == "gpt":
        return tiny_gpt(300, **common)
    return preset("llama_tiny", vocab_size=300, hidden_size=32, ffn_hidden_size=88, **common)
