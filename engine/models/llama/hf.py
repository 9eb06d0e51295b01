"""Hugging Face LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
↔ meshtron, and through ``moe_hf`` the MoE variants MixtralForCausalLM / Qwen2MoeForCausalLM /
Qwen3MoeForCausalLM.

Pure relabelling and row permutation, so HF → meshtron → HF is bitwise:

* q, k, v (and Qwen2's biases): fused per head ``(heads three d)`` when every query head
  has its own KV head, else ``query`` ``(heads d)`` and ``key_value`` ``(kv_heads two d)``.
* gate and up: interleaved into one ``(ffn two)`` column-parallel weight (``layers.mlp``).
* Rotation pairs i with i + d/2 on both sides, so q and k rows need no permutation.
* Qwen3's ``q_norm`` / ``k_norm`` (RMSNorm over each head's ``head_dim``, before RoPE)
  ↔ ``attention.q_norm`` / ``attention.k_norm`` (``model.qk_norm``); its ``head_dim`` ↔
  ``attention_head_dim`` where heads × head_dim ≠ hidden.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.models import hf_layout as layout
from engine.models.config import ModelConfig
from engine.models.hf_layout import ConfigKey, Transform, rename, weights
from engine.models.llama import moe_hf
from layers.spec import mlp_name

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **moe_hf.ARCHITECTURES,
}

# Qwen3 and Qwen3-MoE: q and k normalized per head (model.qk_norm), no bias anywhere.
_QK_NORMED = ("qwen3", "qwen3_moe")

# Mistral and Mixtral: the window (when shorter than the context) on every layer.
_WINDOWED = ("mistral", "mixtral")

# The config.json keys the transformers decoders mapped here (Gemma 2's too) share, in the
# order import reads and export writes them; each family adds its tie_word_embeddings
# default, then keys of its own.
DECODER_KEYS = (
    *layout.SIZE_KEYS,
    ConfigKey("num_kv_heads", "num_key_value_heads", None, export="kv_heads"),
    ConfigKey("attention_dropout", "attention_dropout", 0.0, to_ours=float),
    ConfigKey("layernorm_eps", "rms_norm_eps", 1e-6),
    ConfigKey("init_std", "initializer_range", 0.02),
)
_CONFIG = (*DECODER_KEYS, ConfigKey("tie_embeddings", "tie_word_embeddings", False))

# rope_parameters (or rope_scaling) of rope_type "llama3"
_LLAMA3_ROPE = (
    ConfigKey("rope_scaling_factor", "factor", to_ours=float),
    ConfigKey("rope_low_freq_factor", "low_freq_factor", to_ours=float),
    ConfigKey("rope_high_freq_factor", "high_freq_factor", to_ours=float),
    ConfigKey("rope_original_max_positions", "original_max_position_embeddings", to_ours=int),
)


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling from either config spelling (``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``); a one-line error for scaling types not built."""
    source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = layout.hf_value(hf, source, (dict, type(None)), None) or {}
    where = f"{source}."
    theta = layout.hf_value(hf, "rope_theta", float, 10000.0)
    theta = layout.hf_value(params, "rope_theta", float, theta, prefix=where)
    if not 0 < theta < math.inf:  # NaN fails too
        raise ValueError(f"config.json rope_theta={theta}: expected a positive finite number")
    kind = layout.hf_value(params, "type", str, "default", prefix=where)
    kind = layout.hf_value(params, "rope_type", str, kind, prefix=where)
    older = hf.get("rope_scaling") if source == "rope_parameters" else None
    if isinstance(older, dict):  # both spellings given: a scaling in either must not be lost
        other = older.get("rope_type", older.get("type", "default"))
        if other != kind:
            raise ValueError(
                f"config.json rope_parameters.rope_type={kind!r} and rope_scaling's "
                f"{other!r} disagree; keep one of the two"
            )
    if kind == "default" and "factor" in params:
        raise ValueError(
            f"config.json {where}factor={params['factor']!r} scales RoPE but no rope_type "
            "says how; give rope_type (llama3 is supported)"
        )
    values: dict[str, Any] = dict(rope_theta=float(theta))
    if kind == "llama3":
        values.update(
            rope_scaling="llama3", **layout.config_values(params, _LLAMA3_ROPE, prefix=where)
        )
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported; use default or llama3")
    return values


def kv_heads(values: dict[str, Any]) -> int:
    """``num_kv_heads`` of the values read through :data:`DECODER_KEYS`: absent or null, one
    KV head per query head; a one-line error below 1, which ModelConfig would read as
    "unset" (one per query head) instead of refusing."""
    kv = values["num_kv_heads"]
    if kv is None:
        return values["num_heads"]
    if kv < 1:
        raise ValueError(f"config.json num_key_value_heads={kv}: expected >= 1 (or null)")
    return kv


def rotary_decoder(
    hf: dict[str, Any], arch: str, values: dict[str, Any], keys: tuple[ConfigKey, ...], **parts
) -> ModelConfig:
    """The validated ModelConfig a rotary decoder's ``config.json`` becomes: ``values`` (read
    through ``keys``) with their KV heads resolved, the family's ``parts`` (norm,
    activation, biases...), no dropout, rotary positions with the file's rope settings, and
    a head width of its own where ``head_dim`` is not hidden ÷ heads. Shared by the Llama
    and Gemma families' imports."""
    values = dict(values, num_kv_heads=kv_heads(values))
    cfg = ModelConfig(
        arch=arch, **values, **parts, hidden_dropout=0.0, position_embedding="rotary", **_rope(hf)
    )
    cfg = layout.validated(cfg, keys)
    head_dim = layout.hf_value(hf, "head_dim", (int, type(None)), None)
    if head_dim not in (None, cfg.head_dim):  # a width of its own: heads × d ≠ hidden
        cfg = dataclasses.replace(cfg, attention_head_dim=head_dim)
        cfg = layout.validated(cfg, (*keys, ConfigKey("attention_head_dim", "head_dim")))
    return cfg


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE
    ``config.json``; unsupported variants raise. Every value read is type-checked and the
    result validated before it is returned."""
    kind = hf["model_type"]
    if (act := layout.hf_value(hf, "hidden_act", str, "silu")) != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; use silu")
    qkv_bias, linear_bias = _biases(hf, kind)
    values = layout.config_values(hf, _CONFIG)
    if kind in moe_hf.ARCHITECTURES:
        values.update(moe_hf.config_values(hf))
    cfg = rotary_decoder(
        hf,
        "llama",
        values,
        _CONFIG + moe_hf.KEYS.get(kind, ()),
        norm="rmsnorm",
        activation="swiglu",
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        qk_norm=kind in _QK_NORMED,
    )
    if layout.hf_value(hf, "use_sliding_window", bool, kind in _WINDOWED):
        window = layout.hf_value(hf, "sliding_window", (int, type(None)), None)
        if window is not None and window < cfg.max_positions:
            if kind not in _WINDOWED:  # Qwen2's windows start at max_window_layers
                raise ValueError(
                    f"sliding_window {window} is not supported for {kind}; set it to null "
                    f"(or >= max_position_embeddings {cfg.max_positions})"
                )
            cfg = layout.validated(dataclasses.replace(cfg, sliding_window=window), _CONFIG)
    return cfg


def _biases(hf: dict[str, Any], kind: str) -> tuple[bool, bool]:
    """(``qkv_bias``, ``linear_bias``) of a ``config.json`` of ``kind``; one line for the
    bias layouts meshtron does not build."""
    attn_bias = layout.hf_value(hf, "attention_bias", bool, False)
    if kind in _QK_NORMED:  # attention_bias puts biases on q, k, v and o, none on the MLP
        if attn_bias:
            raise ValueError(
                f"attention_bias true is not supported for {kind} (biases on q, k, v and "
                "o but not the MLP); set it to false"
            )
        return False, False
    if kind == "qwen2":  # q, k and v biases always, no other
        return True, False
    if kind == "qwen2_moe":  # its config says
        return layout.hf_value(hf, "qkv_bias", bool, True), False
    mlp_bias = layout.hf_value(hf, "mlp_bias", bool, False)
    if kind == "llama" and attn_bias != mlp_bias:
        raise ValueError("attention_bias != mlp_bias is not supported; set both the same")
    return attn_bias, attn_bias


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    out = dict(base or {})
    kind = _export_kind(cfg, out.get("model_type"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", **layout.config_items(cfg, _LLAMA3_ROPE, {}))
    out = layout.config_json(cfg, _CONFIG, out, kind, ARCHITECTURES)
    out.update(hidden_act="silu", rope_theta=cfg.rope_theta, rope_parameters=rope)
    out.pop("rope_scaling", None)
    if kind == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.linear_bias)
    if kind in moe_hf.ARCHITECTURES:
        out.update(moe_hf.config_items(cfg, kind, out))
    if kind == "qwen2_moe":
        out.update(qkv_bias=cfg.qkv_bias)
    if kind in _QK_NORMED:
        out.update(attention_bias=False)
    if kind in _QK_NORMED or cfg.attention_head_dim or out.get("head_dim") is not None:
        out["head_dim"] = cfg.head_dim
    if cfg.sliding_window is not None:
        if kind not in _WINDOWED:
            raise ValueError(
                f"model.sliding_window={cfg.sliding_window} exports as mistral or mixtral "
                f"(every layer windowed), not {kind}"
            )
        out["sliding_window"] = cfg.sliding_window
    return out


def _export_kind(cfg: ModelConfig, original: str | None) -> str:
    """The ``model_type`` ``cfg`` exports as (``original``: the imported one, if any); a
    one-line ValueError where QK norms and the kind disagree."""
    if cfg.mlp == "moe":
        return moe_hf.moe_kind(cfg)
    plain = "mistral" if cfg.sliding_window is not None else "llama"
    kind = original or ("qwen2" if cfg.qkv_bias and not cfg.linear_bias else plain)
    if cfg.qk_norm:
        if cfg.qkv_bias or cfg.linear_bias:
            raise ValueError(
                "model.qk_norm=true exports as Qwen3, which has no biases: set "
                "model.qkv_bias=false and model.linear_bias=false"
            )
        return "qwen3"
    if kind in _QK_NORMED:
        raise ValueError(f"model.qk_norm=false: {kind} normalizes q and k; set it true")
    return kind


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _grouped_query(heads: int) -> Transform:
    """q, k, v ↔ ``query`` as is and ``key_value`` with rows ``(kv_heads two d)``."""
    return Transform(
        lambda q, k, v: (q, layout.interleave_rows((k, v), heads)),
        lambda q, kv: (q, *layout.split_rows(kv, heads, 2)),
    )


def _weights(cfg: ModelConfig) -> list[layout.Weights]:
    """Every tensor's meshtron name ↔ HF name, with its layout change."""
    ours, theirs = "layers.{i}", "model.layers.{i}"
    layer = [
        rename(f"{ours}.attention_norm.weight", f"{theirs}.input_layernorm.weight"),
        rename(f"{ours}.attention.dense.weight", f"{theirs}.self_attn.o_proj.weight"),
        rename(f"{ours}.mlp_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
    ]
    if cfg.qk_norm:
        layer += [
            rename(f"{ours}.attention.{x}_norm.weight", f"{theirs}.self_attn.{x}_norm.weight")
            for x in "qk"
        ]
    if cfg.linear_bias:
        layer.append(rename(f"{ours}.attention.dense.bias", f"{theirs}.self_attn.o_proj.bias"))
    fused = attention_rows(cfg, ours, theirs, _kinds(cfg.qkv_bias))
    rows = decoder_map(cfg, layer=layer, fused=fused)
    return rows + [row for i in range(cfg.num_layers) for row in _mlp(cfg, i)]


def _mlp(cfg: ModelConfig, i: int) -> list[layout.Weights]:
    """Layer ``i``'s MLP rows: experts (``moe_hf``) or the dense gate, up and down."""
    ours, theirs = f"layers.{i}.mlp", f"model.layers.{i}"
    if mlp_name(cfg, i) == "moe":
        return moe_hf.expert_rows(cfg, ours, theirs)
    kinds = _kinds(cfg.linear_bias)
    gate_up = [f"{theirs}.mlp.gate_proj", f"{theirs}.mlp.up_proj"]
    return [
        *weights(f"{ours}.fc2", f"{theirs}.mlp.down_proj", kinds=kinds),
        *weights(f"{ours}.fc1", gate_up, layout.interleaved(None, 2), kinds),
    ]


def attention_rows(
    cfg: ModelConfig, ours: str, theirs: str, kinds: tuple[str, ...]
) -> list[layout.Weights]:
    """``{theirs}.self_attn``'s q, k and v projections (parameter ``kinds``) ↔
    ``{ours}.attention``'s fused ``qkv`` when every query head has its own KV head, else
    its ``query`` and ``key_value``."""
    qkv = [f"{theirs}.self_attn.{x}_proj" for x in "qkv"]
    if cfg.kv_heads == cfg.num_heads:
        fused, transform = [f"{ours}.attention.qkv"], layout.interleaved(cfg.num_heads, 3)
    else:
        fused = [f"{ours}.attention.query", f"{ours}.attention.key_value"]
        transform = _grouped_query(cfg.kv_heads)
    return weights(fused, qkv, transform, kinds)


def decoder_map(
    cfg: ModelConfig, *, layer: list[layout.Weights], fused: list[layout.Weights]
) -> list[layout.Weights]:
    """:func:`layout.weight_map` of a transformers decoder: the family's ``layer`` and
    ``fused`` rows between ``model.embed_tokens``, ``model.norm`` and ``lm_head``."""
    return layout.weight_map(
        cfg,
        top=[
            rename("embedding.word.weight", "model.embed_tokens.weight"),
            rename("final_norm.weight", "model.norm.weight"),
        ],
        layer=layer,
        head=rename("lm_head.weight", "lm_head.weight"),
        fused=fused,
    )


def decoder_ignored(cfg: ModelConfig, key: str) -> bool:
    """HF keys a decoder's import skips: RoPE buffers, and a tied head's copy of the
    embedding."""
    return (cfg.tie_embeddings and key == "lm_head.weight") or "rotary_emb" in key


def _unfused_experts(cfg: ModelConfig, hf: layout.StateDict) -> layout.StateDict:
    """transformers' fused in-memory expert tensors, if given those, one per expert."""
    return moe_hf.unfused(cfg, hf) if cfg.mlp == "moe" else hf


# Read both ways: import (MoE experts also fused as transformers holds them in memory) and
# export (a tied head omitted, as save_pretrained does).
_STATE_MAP = layout.StateMap(_weights, "Llama-family", decoder_ignored, _unfused_experts)
state_from_hf = _STATE_MAP.state_from_hf
state_to_hf = _STATE_MAP.state_to_hf
