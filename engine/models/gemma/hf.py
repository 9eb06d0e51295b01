"""Hugging Face Gemma2ForCausalLM ↔ meshtron: pure relabelling and row permutation, so
HF → meshtron → HF is bitwise.

* q, k, v: fused per head ``(heads three d)`` when every query head has its own KV head,
  else ``query`` ``(heads d)`` and ``key_value`` ``(kv_heads two d)`` (as the Llama map).
* gate and up: interleaved into one ``(ffn two)`` column-parallel weight (``layers.mlp``).
* The four norms of a layer: ``input_layernorm`` → ``attention_norm``,
  ``post_attention_layernorm`` → ``post_attention_norm`` (Gemma 2's, on attention's
  output: not the pre-MLP norm Llama's name means), ``pre_feedforward_layernorm`` →
  ``mlp_norm``, ``post_feedforward_layernorm`` → ``post_mlp_norm``. Their weights are
  stored as Gemma stores them, the scale less one (``layers.norm.GemmaRMSNorm``).
* ``layer_types`` ↔ ``full_attention_every``: the window on every layer but each k-th.
* ``head_dim`` ↔ ``attention_head_dim`` where it is not hidden / heads (the released
  Gemma 2 sizes: 2304 wide, 8 heads of 256).

What it shares with the Llama map (the decoder keys, RoPE keys, q, k, v rows, outer
tensors and skipped buffers) it reads from ``engine.models.llama.hf``.
"""

from __future__ import annotations

from typing import Any

from engine.models import hf_layout as layout
from engine.models.config import ModelConfig
from engine.models.hf_layout import ConfigKey, rename, weights
from engine.models.llama.hf import (
    DECODER_KEYS,
    attention_rows,
    decoder_ignored,
    decoder_map,
    rotary_decoder,
)

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM"}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _scalar_to_hf(value: float | None, original: Any) -> Any:
    """``query_pre_attn_scalar`` as transformers types it, an int (its Gemma2Config
    refuses 32.0), or as the imported original held it."""
    if value is None or isinstance(original, float) or not float(value).is_integer():
        return value
    return int(value)


_CONFIG = (
    *DECODER_KEYS,
    ConfigKey("tie_embeddings", "tie_word_embeddings", True),
    ConfigKey(
        "query_pre_attn_scalar",
        "query_pre_attn_scalar",
        256,
        to_ours=_optional_float,
        to_hf=_scalar_to_hf,
    ),
    ConfigKey("attn_logit_softcapping", "attn_logit_softcapping", 50.0, to_ours=_optional_float),
    ConfigKey("final_logit_softcapping", "final_logit_softcapping", 30.0, to_ours=_optional_float),
)


def _layer_pattern(every: int, layers: int, window: int | None) -> list[str]:
    """transformers' ``layer_types`` of ``full_attention_every`` (no window: all full)."""
    if window is None:
        return [_FULL] * layers
    return [_FULL if every and (i + 1) % every == 0 else _SLIDING for i in range(layers)]


def _window(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``full_attention_every`` of ``sliding_window`` and
    ``layer_types`` (absent: sliding on layers 0, 2, 4..., as transformers fills it in); a
    one-line error for a layer pattern that is not "all but each k-th"."""
    window = layout.hf_value(hf, "sliding_window", (int, type(None)), 4096)
    types = hf.get("layer_types") or _layer_pattern(2, layers, 1)
    if not isinstance(types, list) or len(types) != layers or set(types) - {_SLIDING, _FULL}:
        raise ValueError(
            f"config.json layer_types: expected {layers} entries of {_SLIDING!r} or {_FULL!r}"
        )
    if window is None or _SLIDING not in types:
        return dict(sliding_window=None, full_attention_every=0)
    if window < 1:
        raise ValueError(f"config.json sliding_window={window}: expected >= 1 (or null)")
    for every in (0, *range(2, layers + 1)):
        if _layer_pattern(every, layers, window) == types:
            return dict(sliding_window=window, full_attention_every=every)
    raise ValueError(
        "config.json layer_types: only the window on every layer but each k-th is built "
        f"(got {types[:6]}...)"
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Gemma 2 ``config.json``; unsupported variants raise. Every value
    read is type-checked and the result validated before it is returned."""
    act = layout.hf_value(hf, "hidden_activation", str, "gelu_pytorch_tanh")
    if layout.GELU_NAMES.get(act) != "gelu_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported; use gelu_pytorch_tanh")
    if layout.hf_value(hf, "attention_bias", bool, False):
        raise ValueError("attention_bias=true is not supported; Gemma 2 has no biases")
    if layout.hf_value(hf, "use_bidirectional_attention", (bool, type(None)), None):
        raise ValueError("use_bidirectional_attention=true is not supported (causal only)")
    values = layout.config_values(hf, _CONFIG)
    return rotary_decoder(
        hf,
        "gemma",
        values,
        _CONFIG,
        **_window(hf, values["num_layers"]),
        norm="gemma_rmsnorm",
        activation="geglu",
        qkv_bias=False,
        linear_bias=False,
        embedding_scale=True,
        post_norms=True,
    )


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg`` on top of ``base`` (the imported original, if any)."""
    out = layout.config_json(cfg, _CONFIG, base, "gemma2", ARCHITECTURES)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out.pop("rope_scaling", None)
    out.update(
        hidden_activation=out.get("hidden_activation", "gelu_pytorch_tanh"),
        head_dim=cfg.head_dim,
        attention_bias=False,
        rope_theta=cfg.rope_theta,
        rope_parameters=rope,
        layer_types=_layer_pattern(cfg.full_attention_every, cfg.num_layers, cfg.sliding_window),
    )
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    return out


def _weights(cfg: ModelConfig) -> list[layout.Weights]:
    """Every tensor's meshtron name ↔ HF name, with its layout change."""
    ours, theirs = "layers.{i}", "model.layers.{i}"
    norms = (
        ("attention_norm", "input_layernorm"),
        ("post_attention_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_feedforward_layernorm"),
        ("post_mlp_norm", "post_feedforward_layernorm"),
    )
    layer = [rename(f"{ours}.{a}.weight", f"{theirs}.{b}.weight") for a, b in norms]
    layer += [
        rename(f"{ours}.attention.dense.weight", f"{theirs}.self_attn.o_proj.weight"),
        rename(f"{ours}.mlp.fc2.weight", f"{theirs}.mlp.down_proj.weight"),
    ]
    gate_up = [f"{theirs}.mlp.gate_proj", f"{theirs}.mlp.up_proj"]
    fused = [
        *attention_rows(cfg, ours, theirs, ("weight",)),
        *weights(f"{ours}.mlp.fc1", gate_up, layout.interleaved(None, 2), ("weight",)),
    ]
    return decoder_map(cfg, layer=layer, fused=fused)


# Read both ways: import (also of a Gemma2Model's state dict, which lacks "model.") and
# export (a tied head omitted, as save_pretrained does).
_STATE_MAP = layout.StateMap(
    _weights,
    "Gemma2ForCausalLM",
    decoder_ignored,
    layout.with_prefix("embed_tokens.weight", "model."),
)
state_from_hf = _STATE_MAP.state_from_hf
state_to_hf = _STATE_MAP.state_to_hf
