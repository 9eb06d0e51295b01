"""Hugging Face BertForPreTraining ↔ meshtron: pure relabelling and row permutation, so
HF → meshtron → HF is bitwise.

BERT's separate q, k, v projections become meshtron's fused QKV with rows per head,
``(heads three d)``; every other tensor keeps its layout under a new name.
"""

from __future__ import annotations

from typing import Any

from engine.models import hf_layout as layout
from engine.models.config import ModelConfig
from engine.models.hf_layout import ConfigKey, rename, weights

ARCHITECTURES = {"bert": "BertForPreTraining"}

_CONFIG = (
    *layout.SIZE_KEYS,
    ConfigKey("num_token_types", "type_vocab_size", 2),
    ConfigKey("hidden_dropout", "hidden_dropout_prob", 0.1),
    ConfigKey("attention_dropout", "attention_probs_dropout_prob", 0.1),
    ConfigKey("layernorm_eps", "layer_norm_eps", 1e-12),
    layout.gelu_key("hidden_act", "gelu"),
    ConfigKey("tie_embeddings", "tie_word_embeddings", True),
)

# Buffers and the tied decoder copies HF may store, which hold no parameters of their own.
_IGNORED_SUFFIXES = (
    "position_ids",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a BERT ``config.json``; unsupported variants raise."""
    if layout.hf_value(hf, "position_embedding_type", str, "absolute") != "absolute":
        raise ValueError("only BERT with absolute position embeddings is supported")
    return layout.validated(ModelConfig(arch="bert", **layout.config_values(hf, _CONFIG)), _CONFIG)


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    return layout.config_json(cfg, _CONFIG, base, "bert", ARCHITECTURES)


def _weights(cfg: ModelConfig) -> list[layout.Weights]:
    """Every tensor's meshtron name ↔ HF name, with its layout change."""
    emb, ours, theirs = "bert.embeddings", "layers.{i}", "bert.encoder.layer.{i}"
    qkv = weights(
        f"{ours}.attention.qkv",
        [f"{theirs}.attention.self.{name}" for name in ("query", "key", "value")],
        layout.interleaved(cfg.num_heads, 3),
    )
    return layout.weight_map(
        cfg,
        top=[
            rename("embedding.word.weight", f"{emb}.word_embeddings.weight"),
            rename("embedding.position", f"{emb}.position_embeddings.weight"),
            rename("embedding.token_type", f"{emb}.token_type_embeddings.weight"),
            rename("lm_head.bias", "cls.predictions.bias"),
            *weights("embedding.norm", f"{emb}.LayerNorm"),
            *weights("mlm_transform.dense", "cls.predictions.transform.dense"),
            *weights("mlm_transform.norm", "cls.predictions.transform.LayerNorm"),
            *weights("pooler.dense", "bert.pooler.dense"),
            *weights("sop_head", "cls.seq_relationship"),
        ],
        layer=[
            *weights(f"{ours}.attention.dense", f"{theirs}.attention.output.dense"),
            *weights(f"{ours}.attention_norm", f"{theirs}.attention.output.LayerNorm"),
            *weights(f"{ours}.mlp.fc1", f"{theirs}.intermediate.dense"),
            *weights(f"{ours}.mlp.fc2", f"{theirs}.output.dense"),
            *weights(f"{ours}.mlp_norm", f"{theirs}.output.LayerNorm"),
        ],
        head=rename("lm_head.weight", "cls.predictions.decoder.weight"),
        fused=qkv,
    )


# Read both ways: import (its tied decoder copies and buffers ignored) and export (the tied
# decoder omitted, as save_pretrained does).
_STATE_MAP = layout.StateMap(
    _weights, "BertForPreTraining", lambda cfg, key: key.endswith(_IGNORED_SUFFIXES)
)
state_from_hf = _STATE_MAP.state_from_hf
state_to_hf = _STATE_MAP.state_to_hf
