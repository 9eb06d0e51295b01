"""Hugging Face LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM ↔ meshtron.

Pure relabelling and row permutation, so HF → meshtron → HF is bitwise:

* q, k, v (and Qwen2's biases): fused per head ``(heads three d)`` when every query head
  has its own KV head, else ``query`` ``(heads d)`` and ``key_value`` ``(kv_heads two d)``.
* gate and up: interleaved into one ``(ffn two)`` column-parallel weight (``layers.mlp``).
* Rotation pairs i with i + d/2 on both sides, so q and k rows need no permutation.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange

from engine.models.config import ModelConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling from either config spelling (``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``); a one-line error for scaling types not built."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    values: dict[str, Any] = dict(rope_theta=float(theta))
    if kind == "llama3":
        values.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_positions=int(params["original_max_position_embeddings"]),
        )
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported; use default or llama3")
    return values


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Llama, Mistral or Qwen2 ``config.json``; unsupported variants raise."""
    kind = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; use silu")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size/heads; not supported")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", kind == "mistral") else None
    if window is not None and window < hf["max_position_embeddings"]:
        raise ValueError(f"sliding_window {window} is not supported; set it to null")
    attn_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if kind == "llama" and attn_bias != mlp_bias:
        raise ValueError("attention_bias != mlp_bias is not supported; set both the same")
    return ModelConfig(
        arch="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_positions=hf["max_position_embeddings"],
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        layernorm_eps=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        norm="rmsnorm",
        position_embedding="rotary",
        activation="swiglu",
        qkv_bias=True if kind == "qwen2" else attn_bias,
        linear_bias=False if kind == "qwen2" else attn_bias,
        **_rope(hf),
    )


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    out = dict(base or {})
    kind = out.get("model_type", "qwen2" if cfg.qkv_bias and not cfg.linear_bias else "llama")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_positions,
        )
    out.update(
        architectures=[ARCHITECTURES[kind]],
        model_type=kind,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=cfg.layernorm_eps,
        hidden_act="silu",
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=cfg.attention_dropout,
        rope_theta=cfg.rope_theta,
        rope_parameters=rope,
    )
    out.pop("rope_scaling", None)
    if kind == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.linear_bias)
    return out


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(meshtron name, HF name) of every tensor moved as is."""
    table = [
        ("embedding.word.weight", "model.embed_tokens.weight"),
        ("final_norm.weight", "model.norm.weight"),
    ]
    sub = [
        ("attention_norm.weight", "input_layernorm.weight"),
        ("attention.dense.weight", "self_attn.o_proj.weight"),
        ("mlp_norm.weight", "post_attention_layernorm.weight"),
        ("mlp.fc2.weight", "mlp.down_proj.weight"),
    ]
    if cfg.linear_bias:
        sub += [
            ("attention.dense.bias", "self_attn.o_proj.bias"),
            ("mlp.fc2.bias", "mlp.down_proj.bias"),
        ]
    for i in range(cfg.num_layers):
        table += [(f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}") for ours, theirs in sub]
    return table + ([] if cfg.tie_embeddings else [("lm_head.weight", "lm_head.weight")])


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def state_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshtron full state dict from an HF Llama-family state dict."""
    used, ours = set(), {}
    try:
        for mine, theirs in _renames(cfg):
            ours[mine] = hf[theirs]
            used.add(theirs)
        for i in range(cfg.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for kind in _kinds(cfg.qkv_bias):
                names = [f"{attn}.{x}_proj.{kind}" for x in "qkv"]
                ours.update(_attention_to_meshtron(cfg, i, kind, *(hf[n] for n in names)))
                used.update(names)
            for kind in _kinds(cfg.linear_bias):
                names = [f"{mlp}.gate_proj.{kind}", f"{mlp}.up_proj.{kind}"]
                gate_up = torch.stack([hf[n] for n in names])
                ours[f"layers.{i}.mlp.fc1.{kind}"] = rearrange(gate_up, "two f ... -> (f two) ...")
                used.update(names)
    except KeyError as missing:
        raise KeyError(f"HF weights lack {missing}; expected a Llama-family checkpoint") from None
    tied_copy = "lm_head.weight" if cfg.tie_embeddings else None
    unused = [k for k in hf if k not in used and k != tied_copy and "rotary_emb" not in k]
    if unused:
        raise ValueError(f"HF weights meshtron does not know how to place: {unused[:5]}")
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in ours.items()}


def _attention_to_meshtron(cfg: ModelConfig, i: int, kind: str, q, k, v) -> dict:
    prefix = f"layers.{i}.attention"
    if cfg.kv_heads == cfg.num_heads:
        fused = rearrange(
            torch.stack([q, k, v]), "three (h d) ... -> (h three d) ...", h=cfg.num_heads
        )
        return {f"{prefix}.qkv.{kind}": fused}
    kv = rearrange(torch.stack([k, v]), "two (h d) ... -> (h two d) ...", h=cfg.kv_heads)
    return {f"{prefix}.query.{kind}": q, f"{prefix}.key_value.{kind}": kv}


def state_to_hf(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf` (a tied head omitted, as save_pretrained does)."""
    hf = {theirs: ours[mine] for mine, theirs in _renames(cfg)}
    for i in range(cfg.num_layers):
        attn, mlp, prefix = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"layers.{i}"
        for kind in _kinds(cfg.qkv_bias):
            if cfg.kv_heads == cfg.num_heads:
                q, k, v = rearrange(
                    ours[f"{prefix}.attention.qkv.{kind}"],
                    "(h three d) ... -> three (h d) ...",
                    h=cfg.num_heads,
                    three=3,
                )
            else:
                q = ours[f"{prefix}.attention.query.{kind}"]
                k, v = rearrange(
                    ours[f"{prefix}.attention.key_value.{kind}"],
                    "(h two d) ... -> two (h d) ...",
                    h=cfg.kv_heads,
                    two=2,
                )
            hf.update(
                {f"{attn}.q_proj.{kind}": q, f"{attn}.k_proj.{kind}": k, f"{attn}.v_proj.{kind}": v}
            )
        for kind in _kinds(cfg.linear_bias):
            gate, up = rearrange(
                ours[f"{prefix}.mlp.fc1.{kind}"], "(f two) ... -> two f ...", two=2
            )
            hf.update({f"{mlp}.gate_proj.{kind}": gate, f"{mlp}.up_proj.{kind}": up})
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in hf.items()}
