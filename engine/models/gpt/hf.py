"""Hugging Face GPT2LMHeadModel ↔ meshtron: pure relabelling, transposition and row
permutation, so HF → meshtron → HF is bitwise.

* GPT-2's Conv1D stores weights as ``[in, out]``; meshtron (like nn.Linear) as ``[out, in]``.
* GPT-2's fused ``c_attn`` rows are ``[q | k | v]`` (each ``(heads d)``); meshtron's fused
  QKV orders them per head, ``(heads three d)``.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models import hf_layout as layout
from engine.models.config import ModelConfig
from engine.models.hf_layout import TRANSPOSE, ConfigKey, Transform, rename, weights

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}

_CONFIG = (
    ConfigKey("vocab_size", "vocab_size"),
    ConfigKey("hidden_size", "n_embd"),
    ConfigKey("num_layers", "n_layer"),
    ConfigKey("num_heads", "n_head"),
    ConfigKey("ffn_hidden_size", "n_inner", None),
    ConfigKey("max_positions", "n_positions"),
    ConfigKey("hidden_dropout", "resid_pdrop", 0.1),
    ConfigKey("attention_dropout", "attn_pdrop", 0.1),
    ConfigKey("layernorm_eps", "layer_norm_epsilon", 1e-5),
    layout.gelu_key("activation_function", "gelu_new"),
    ConfigKey("tie_embeddings", "tie_word_embeddings", True),
)

# Buffers and the tied head copy HF may store, which hold no parameters of their own.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a GPT-2 ``config.json``; unsupported variants raise."""
    scaled = layout.hf_value(hf, "scale_attn_weights", bool, True)
    if not scaled or layout.hf_value(hf, "scale_attn_by_inverse_layer_idx", bool, False):
        raise ValueError("only GPT-2 attention scaled by 1/sqrt(head_dim) is supported")
    return layout.validated(ModelConfig(arch="gpt", **layout.config_values(hf, _CONFIG)), _CONFIG)


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    out = layout.config_json(cfg, _CONFIG, base, "gpt2", ARCHITECTURES)
    out.setdefault("embd_pdrop", cfg.hidden_dropout)  # meshtron has one hidden dropout
    return out


def _conv1d(ours: str, theirs: str) -> list[layout.Weights]:
    """A Conv1D: its ``[in, out]`` weight transposed, its bias as is."""
    return [
        rename(f"{ours}.weight", f"{theirs}.weight", TRANSPOSE),
        rename(f"{ours}.bias", f"{theirs}.bias"),
    ]


def _fused_qkv(heads: int, conv1d: bool) -> Transform:
    """``c_attn`` (rows ``[q | k | v]``; a Conv1D ``[in, 3h]`` weight) ↔ per-head QKV."""

    def to_ours(fused: torch.Tensor) -> tuple[torch.Tensor]:
        rows = fused.t() if conv1d else fused
        return (layout.interleave_rows(rows.chunk(3), heads),)

    def to_hf(qkv: torch.Tensor) -> tuple[torch.Tensor]:
        fused = torch.cat(layout.split_rows(qkv, heads, 3))
        return (fused.t() if conv1d else fused,)

    return Transform(to_ours, to_hf)


def _weights(cfg: ModelConfig) -> list[layout.Weights]:
    """Every tensor's meshtron name ↔ HF name, with its layout change."""
    ours, h = "layers.{i}", "transformer.h.{i}"
    qkv = [
        rename(f"{ours}.attention.qkv.{kind}", f"{h}.attn.c_attn.{kind}", transform)
        for kind, transform in (
            ("weight", _fused_qkv(cfg.num_heads, conv1d=True)),
            ("bias", _fused_qkv(cfg.num_heads, conv1d=False)),
        )
    ]
    return layout.weight_map(
        cfg,
        top=[
            rename("embedding.word.weight", "transformer.wte.weight"),
            rename("embedding.position", "transformer.wpe.weight"),
            *weights("final_norm", "transformer.ln_f"),
        ],
        layer=[
            *weights(f"{ours}.attention_norm", f"{h}.ln_1"),
            *_conv1d(f"{ours}.attention.dense", f"{h}.attn.c_proj"),
            *weights(f"{ours}.mlp_norm", f"{h}.ln_2"),
            *_conv1d(f"{ours}.mlp.fc1", f"{h}.mlp.c_fc"),
            *_conv1d(f"{ours}.mlp.fc2", f"{h}.mlp.c_proj"),
        ],
        head=rename("lm_head.weight", "lm_head.weight"),
        fused=qkv,
    )


# Read both ways: import (also of a GPT2Model's state dict, which lacks "transformer.";
# its tied head copy and buffers ignored) and export (a tied head omitted).
_STATE_MAP = layout.StateMap(
    _weights,
    "GPT2LMHeadModel",
    lambda cfg, key: key.endswith(_IGNORED_SUFFIXES),
    layout.with_prefix("wte.weight", "transformer."),
)
state_from_hf = _STATE_MAP.state_from_hf
state_to_hf = _STATE_MAP.state_to_hf
