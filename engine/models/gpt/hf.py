"""Hugging Face GPT2LMHeadModel ↔ meshtron: pure relabelling, transposition and row
permutation, so HF → meshtron → HF is bitwise.

* GPT-2's Conv1D stores weights as ``[in, out]``; meshtron (like nn.Linear) as ``[out, in]``.
* GPT-2's fused ``c_attn`` rows are ``[q | k | v]`` (each ``(heads d)``); meshtron's fused
  QKV orders them per head, ``(heads three d)``.
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

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}

# Buffers and the tied head copy HF may store, which hold no parameters of their own.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a GPT-2 ``config.json``; unsupported variants raise."""
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("only GPT-2 attention scaled by 1/sqrt(head_dim) is supported")
    values = dict(
        arch="gpt",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"),
        max_positions=hf["n_positions"],
        hidden_dropout=hf.get("resid_pdrop", 0.1),
        attention_dropout=hf.get("attn_pdrop", 0.1),
        layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )
    activation = activation_from_hf(hf.get("activation_function", "gelu_new"))
    tie = hf.get("tie_word_embeddings", True)
    return ModelConfig(**values, activation=activation, tie_embeddings=tie)


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    out = dict(base or {})
    out.update(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_inner=cfg.ffn_hidden_size,
        n_positions=cfg.max_positions,
        resid_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layernorm_eps,
        activation_function=activation_to_hf(cfg.activation, out.get("activation_function")),
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    out.setdefault("embd_pdrop", cfg.hidden_dropout)  # meshtron has one hidden dropout
    return out


def _renames(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(meshtron name, HF name, transposed) of every tensor except the fused QKV."""
    table = [
        ("embedding.word.weight", "transformer.wte.weight", False),
        ("embedding.position", "transformer.wpe.weight", False),
    ]
    table += [(f"final_norm.{x}", f"transformer.ln_f.{x}", False) for x in ("weight", "bias")]
    sub = [
        ("attention_norm", "ln_1", False),
        ("attention.dense", "attn.c_proj", True),
        ("mlp_norm", "ln_2", False),
        ("mlp.fc1", "mlp.c_fc", True),
        ("mlp.fc2", "mlp.c_proj", True),
    ]
    for i in range(cfg.num_layers):
        for ours, theirs, transposed in sub:
            layer = f"transformer.h.{i}.{theirs}"
            table.append((f"layers.{i}.{ours}.weight", f"{layer}.weight", transposed))
            table.append((f"layers.{i}.{ours}.bias", f"{layer}.bias", False))
    head = [] if cfg.tie_embeddings else [("lm_head.weight", "lm_head.weight", False)]
    return table + head


def state_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshtron full state dict from an HF GPT2LMHeadModel (or GPT2Model) state dict."""
    if "wte.weight" in hf:  # saved from GPT2Model: no "transformer." prefix
        hf = {f"transformer.{k}": v for k, v in hf.items()}
    used, ours = set(), {}
    try:
        for mine, theirs, transposed in _renames(cfg):
            ours[mine] = hf[theirs].t() if transposed else hf[theirs]
            used.add(theirs)
        for i in range(cfg.num_layers):
            for kind in ("weight", "bias"):
                name = f"transformer.h.{i}.attn.c_attn.{kind}"
                fused = hf[name].t() if kind == "weight" else hf[name]  # Conv1D [in, 3h]
                used.add(name)
                qkv = qkv_to_meshtron(*fused.chunk(3), cfg.num_heads)  # rows [q | k | v]
                ours[f"layers.{i}.attention.qkv.{kind}"] = qkv
    except KeyError as missing:
        raise KeyError(
            f"HF weights lack {missing}; expected a GPT2LMHeadModel checkpoint"
        ) from None
    unused = [k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"HF weights meshtron does not know how to place: {unused[:5]}")
    return contiguous_copies(ours)


def state_to_hf(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf` (a tied head omitted, as save_pretrained does)."""
    hf = {theirs: ours[mine].t() if tr else ours[mine] for mine, theirs, tr in _renames(cfg)}
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            q, k, v = qkv_from_meshtron(ours[f"layers.{i}.attention.qkv.{kind}"], cfg.num_heads)
            fused = torch.cat([q, k, v])
            hf[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
    return contiguous_copies(hf)
