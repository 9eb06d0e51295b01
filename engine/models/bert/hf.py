"""Hugging Face BertForPreTraining ↔ meshtron: pure relabelling and row permutation, so
HF → meshtron → HF is bitwise.

BERT's separate q, k, v projections become meshtron's fused QKV with rows per head,
``(heads three d)``; every other tensor keeps its layout under a new name.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.hf_layout import (
    activation_from_hf,
    activation_to_hf,
    contiguous_copies,
    qkv_from_meshtron,
    qkv_to_meshtron,
)

ARCHITECTURES = {"bert": "BertForPreTraining"}

# Buffers and the tied decoder copies HF may store, which hold no parameters of their own.
_IGNORED_SUFFIXES = (
    "position_ids",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a BERT ``config.json``; unsupported variants raise."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only BERT with absolute position embeddings is supported")
    values = dict(
        arch="bert",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        max_positions=hf["max_position_embeddings"],
        num_token_types=hf.get("type_vocab_size", 2),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layernorm_eps=hf.get("layer_norm_eps", 1e-12),
    )
    activation = activation_from_hf(hf.get("hidden_act", "gelu"))
    tie = hf.get("tie_word_embeddings", True)
    return ModelConfig(**values, activation=activation, tie_embeddings=tie)


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    out = dict(base or {})
    out.update(
        architectures=["BertForPreTraining"],
        model_type="bert",
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.ffn_size,
        max_position_embeddings=cfg.max_positions,
        type_vocab_size=cfg.num_token_types,
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        layer_norm_eps=cfg.layernorm_eps,
        hidden_act=activation_to_hf(cfg.activation, out.get("hidden_act")),
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return out


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(meshtron name, HF name) of every tensor except the q, k, v projections."""
    wb, emb = ("weight", "bias"), "bert.embeddings"
    table = [
        ("embedding.word.weight", f"{emb}.word_embeddings.weight"),
        ("embedding.position", f"{emb}.position_embeddings.weight"),
        ("embedding.token_type", f"{emb}.token_type_embeddings.weight"),
        ("lm_head.bias", "cls.predictions.bias"),
    ]
    for ours, theirs in (
        ("embedding.norm", f"{emb}.LayerNorm"),
        ("mlm_transform.dense", "cls.predictions.transform.dense"),
        ("mlm_transform.norm", "cls.predictions.transform.LayerNorm"),
        ("pooler.dense", "bert.pooler.dense"),
        ("sop_head", "cls.seq_relationship"),
    ):
        table += [(f"{ours}.{x}", f"{theirs}.{x}") for x in wb]
    sub = [
        ("attention.dense", "attention.output.dense"),
        ("attention_norm", "attention.output.LayerNorm"),
        ("mlp.fc1", "intermediate.dense"),
        ("mlp.fc2", "output.dense"),
        ("mlp_norm", "output.LayerNorm"),
    ]
    for i in range(cfg.num_layers):
        for ours, theirs in sub:
            table += [
                (f"layers.{i}.{ours}.{x}", f"bert.encoder.layer.{i}.{theirs}.{x}") for x in wb
            ]
    head = [("lm_head.weight", "cls.predictions.decoder.weight")]
    return table + ([] if cfg.tie_embeddings else head)


def _qkv_names(layer: int, kind: str) -> list[str]:
    """HF names of layer ``layer``'s q, k, v ``kind`` ("weight" or "bias")."""
    prefix = f"bert.encoder.layer.{layer}.attention.self"
    return [f"{prefix}.{name}.{kind}" for name in ("query", "key", "value")]


def state_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshtron full state dict from an HF BertForPreTraining state dict."""
    used, ours = set(), {}
    try:
        for mine, theirs in _renames(cfg):
            ours[mine] = hf[theirs]
            used.add(theirs)
        for i in range(cfg.num_layers):
            for kind in ("weight", "bias"):
                names = _qkv_names(i, kind)
                parts = [hf[n] for n in names]
                used.update(names)
                ours[f"layers.{i}.attention.qkv.{kind}"] = qkv_to_meshtron(*parts, cfg.num_heads)
    except KeyError as missing:
        raise KeyError(
            f"HF weights lack {missing}; expected a BertForPreTraining checkpoint"
        ) from None
    unused = [k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"HF weights meshtron does not know how to place: {unused[:5]}")
    return contiguous_copies(ours)


def state_to_hf(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf` (a tied decoder omitted, as save_pretrained does)."""
    hf = {theirs: ours[mine] for mine, theirs in _renames(cfg)}
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            q, k, v = qkv_from_meshtron(ours[f"layers.{i}.attention.qkv.{kind}"], cfg.num_heads)
            hf.update(zip(_qkv_names(i, kind), (q, k, v), strict=True))
    return contiguous_copies(hf)
