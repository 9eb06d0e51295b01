"""Hugging Face GPT-2 / BERT checkpoints ↔ meshtron's layout-independent weights.

The logits parity check against transformers is studies/verification/hf_parity.py.

Only local ``save_pretrained`` directories are read (``config.json`` and safetensors
weights); nothing is fetched. The conversions are pure relabelling, transposition and
row permutation, so HF → meshtron → HF reproduces every tensor bit for bit.

Layout differences handled here:

* GPT-2's Conv1D stores weights as ``[in, out]``; meshtron (like nn.Linear) as ``[out, in]``.
* GPT-2's fused ``c_attn`` rows are ``[q | k | v]`` (each ``(heads d)``) and BERT has
  separate q, k, v; meshtron's fused QKV orders rows per head, ``(heads three d)``, so
  each TP rank's contiguous slice holds whole heads.
* Vocabulary tables stay unpadded on disk (meshtron pads them when it builds a model).

A ``tokenizer.json`` travels both ways; an export adds ``tokenizer_config.json`` and
``special_tokens_map.json`` so that ``AutoTokenizer.from_pretrained`` opens the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.checkpoint.format import (
    META_FILE,
    check_output_dir,
    read_checkpoint,
    save_tensors,
    write_checkpoint,
)
from engine.checkpoint.tokenizer import TOKENIZER_FILE, write_hf_tokenizer
from engine.models import ModelConfig
from engine.models.llama import hf as llama_hf

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def qkv_to_meshtron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Fuse q, k, v (rows ``(heads d)``) into meshtron's per-head ``(heads three d)`` rows."""
    return rearrange(
        torch.stack([q, k, v]), "three (heads d) ... -> (heads three d) ...", heads=heads
    )


def qkv_from_meshtron(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`qkv_to_meshtron`: (q, k, v), each with rows ``(heads d)``."""
    return tuple(rearrange(qkv, "(heads three d) ... -> three (heads d) ...", heads=heads, three=3))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig for a GPT-2 or BERT ``config.json``; unsupported variants raise."""
    kind = hf.get("model_type")
    try:
        if kind in llama_hf.ARCHITECTURES:
            return llama_hf.config_from_hf(hf)
        values = _config_values(kind, hf)
    except KeyError as missing:
        raise ValueError(f"{kind!r} config.json lacks {missing}") from None
    act = values.pop("act")
    if act not in _ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
    tie = hf.get("tie_word_embeddings", True)
    return ModelConfig(**values, activation=_ACTIVATIONS[act], tie_embeddings=tie)


def _config_values(kind: str | None, hf: dict[str, Any]) -> dict[str, Any]:
    if kind == "gpt2":
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
            act=hf.get("activation_function", "gelu_new"),
        )
    elif kind == "bert":
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
            act=hf.get("hidden_act", "gelu"),
        )
    else:
        raise ValueError(
            f"model_type {kind!r} is not supported; use gpt2, bert, llama, mistral or qwen2"
        )
    return values


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg``, on top of ``base`` (the imported original, if any)."""
    if cfg.arch == "llama":
        return llama_hf.config_to_hf(cfg, base)
    out = dict(base or {})
    key = "activation_function" if cfg.arch == "gpt" else "hidden_act"
    act = "gelu_new" if cfg.activation == "gelu_tanh" else "gelu"
    if _ACTIVATIONS.get(out.get(key)) == cfg.activation:
        act = out[key]  # keep the original's spelling (gelu_pytorch_tanh vs gelu_new)
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings)
    if cfg.arch == "gpt":
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
            activation_function=act,
            **common,
        )
        out.setdefault("embd_pdrop", cfg.hidden_dropout)  # meshtron has one hidden dropout
    else:
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
            hidden_act=act,
            **common,
        )
    return out


def _renames(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(meshtron name, HF name, transposed) for every tensor except the fused QKV."""
    wb = ("weight", "bias")
    if cfg.arch == "gpt":
        table = [
            ("embedding.word.weight", "transformer.wte.weight", False),
            ("embedding.position", "transformer.wpe.weight", False),
        ]
        table += [(f"final_norm.{x}", f"transformer.ln_f.{x}", False) for x in wb]
        sub = [
            ("attention_norm", "ln_1", False),
            ("attention.dense", "attn.c_proj", True),
            ("mlp_norm", "ln_2", False),
            ("mlp.fc1", "mlp.c_fc", True),
            ("mlp.fc2", "mlp.c_proj", True),
        ]
        layer_prefix, head = "transformer.h", [("lm_head.weight", "lm_head.weight", False)]
    else:
        emb = "bert.embeddings"
        table = [
            ("embedding.word.weight", f"{emb}.word_embeddings.weight", False),
            ("embedding.position", f"{emb}.position_embeddings.weight", False),
            ("embedding.token_type", f"{emb}.token_type_embeddings.weight", False),
            ("lm_head.bias", "cls.predictions.bias", False),
        ]
        for ours, theirs in (
            ("embedding.norm", f"{emb}.LayerNorm"),
            ("mlm_transform.dense", "cls.predictions.transform.dense"),
            ("mlm_transform.norm", "cls.predictions.transform.LayerNorm"),
            ("pooler.dense", "bert.pooler.dense"),
            ("sop_head", "cls.seq_relationship"),
        ):
            table += [(f"{ours}.{x}", f"{theirs}.{x}", False) for x in wb]
        sub = [
            ("attention.dense", "attention.output.dense", False),
            ("attention_norm", "attention.output.LayerNorm", False),
            ("mlp.fc1", "intermediate.dense", False),
            ("mlp.fc2", "output.dense", False),
            ("mlp_norm", "output.LayerNorm", False),
        ]
        layer_prefix = "bert.encoder.layer"
        head = [("lm_head.weight", "cls.predictions.decoder.weight", False)]
    for i in range(cfg.num_layers):
        for ours, theirs, transposed in sub:
            table.append(
                (f"layers.{i}.{ours}.weight", f"{layer_prefix}.{i}.{theirs}.weight", transposed)
            )
            table.append((f"layers.{i}.{ours}.bias", f"{layer_prefix}.{i}.{theirs}.bias", False))
    return table + ([] if cfg.tie_embeddings else head)


def _qkv_names(cfg: ModelConfig, layer: int, kind: str) -> list[str]:
    """HF names holding layer ``layer``'s q, k, v ``kind`` ("weight"/"bias"): 1 fused or 3."""
    if cfg.arch == "gpt":
        return [f"transformer.h.{layer}.attn.c_attn.{kind}"]
    prefix = f"bert.encoder.layer.{layer}.attention.self"
    return [f"{prefix}.{name}.{kind}" for name in ("query", "key", "value")]


# Buffers and tied copies HF may store that carry no parameters of their own.
_IGNORED_SUFFIXES = (
    ".attn.bias",
    ".attn.masked_bias",
    "position_ids",
    "lm_head.weight",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
)


def state_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshtron full state dict from an HF GPT2LMHeadModel / BertForPreTraining / Llama-family
    state dict."""
    if cfg.arch == "llama":
        return llama_hf.state_from_hf(cfg, hf)
    if cfg.arch == "gpt" and "wte.weight" in hf:  # saved from GPT2Model: no "transformer."
        hf = {f"transformer.{k}": v for k, v in hf.items()}
    used, ours = set(), {}
    try:
        for mine, theirs, transposed in _renames(cfg):
            ours[mine] = hf[theirs].t() if transposed else hf[theirs]
            used.add(theirs)
        for i in range(cfg.num_layers):
            for kind in ("weight", "bias"):
                names = _qkv_names(cfg, i, kind)
                parts = [hf[n] for n in names]
                used.update(names)
                if cfg.arch == "gpt":  # Conv1D [in, 3h] → [3h, in], rows [q | k | v]
                    parts = (parts[0].t() if kind == "weight" else parts[0]).chunk(3)
                ours[f"layers.{i}.attention.qkv.{kind}"] = qkv_to_meshtron(*parts, cfg.num_heads)
    except KeyError as missing:
        want = "GPT2LMHeadModel" if cfg.arch == "gpt" else "BertForPreTraining"
        raise KeyError(f"HF weights lack {missing}; expected a {want} checkpoint") from None
    unused = [k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"HF weights meshtron does not know how to place: {unused[:5]}")
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in ours.items()}


def state_to_hf(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf` (tied copies omitted, as save_pretrained does)."""
    if cfg.arch == "llama":
        return llama_hf.state_to_hf(cfg, ours)
    hf = {theirs: ours[mine].t() if tr else ours[mine] for mine, theirs, tr in _renames(cfg)}
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            q, k, v = qkv_from_meshtron(ours[f"layers.{i}.attention.qkv.{kind}"], cfg.num_heads)
            names = _qkv_names(cfg, i, kind)
            if cfg.arch == "gpt":
                fused = torch.cat([q, k, v])
                hf[names[0]] = fused.t() if kind == "weight" else fused
            else:
                hf.update(zip(names, (q, k, v), strict=True))
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in hf.items()}


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a local HF directory; a clear error if there is none."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def read_hf_dir(
    hf_dir: str | os.PathLike,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(ModelConfig, meshtron full state dict, original config.json) of a local HF directory."""
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    cfg = config_from_hf(hf_config)
    shards = hf_weight_files(hf_dir)
    weights: dict[str, torch.Tensor] = {}
    for shard_name in shards:
        try:
            weights.update(load_file(str(hf_dir / shard_name)))
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"{hf_dir / shard_name} is not a readable safetensors file ({err})"
            ) from None
    return cfg, state_from_hf(cfg, weights), hf_config


def hf_weight_files(hf_dir: str | os.PathLike) -> list[str]:
    """The safetensors files holding ``hf_dir``'s weights; raises if there are none."""
    hf_dir = Path(hf_dir)
    # A single model.safetensors wins over an index, as in transformers' from_pretrained.
    if (hf_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return _shard_names(index)
    raise FileNotFoundError(f"{hf_dir} has no model.safetensors (only safetensors is read)")


def _shard_names(index: Path) -> list[str]:
    """The shard files an index names, each a plain file name inside its directory.

    ``weight_map`` values are joined to the directory, so ``../x`` or ``/x`` would read
    outside it; such an index is refused, as the checkpoint reader refuses such names.
    """
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise ValueError(f"{index} is not a safetensors index (no weight_map object)") from None
    for name in names:
        plain = isinstance(name, str) and Path(name).name == name and "\\" not in name
        if not plain or not name.endswith(".safetensors"):
            raise ValueError(
                f"{index} names shard {name!r}: only a .safetensors file name inside that "
                "directory is read (no paths)"
            )
    return names


def write_hf_dir(
    hf_dir: str | os.PathLike,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    base_config: dict[str, Any] | None = None,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers' from_pretrained reads.

    ``hf_dir`` must not exist or be empty: stale files from another save (an index and its
    shards) would otherwise sit beside the new weights.
    """
    hf_dir = Path(hf_dir)
    if hf_dir.exists() and (not hf_dir.is_dir() or any(hf_dir.iterdir())):
        raise FileExistsError(f"{hf_dir} exists and is not empty; export into a new directory")
    hf_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(state_to_hf(cfg, state), hf_dir / "model.safetensors", metadata={"format": "pt"})
    text = json.dumps(config_to_hf(cfg, base_config), indent=2, sort_keys=True)
    (hf_dir / "config.json").write_text(text + "\n")


def import_hf(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> ModelConfig:
    """Convert a local HF directory into a meshtron checkpoint (usable at any TP size)."""
    check_output_dir(ckpt_dir)
    cfg, state, hf_config = read_hf_dir(hf_dir)
    tokenizer = Path(hf_dir) / TOKENIZER_FILE
    write_checkpoint(
        ckpt_dir,
        state,
        cfg,
        extra={"hf_config": hf_config},
        tokenizer=tokenizer if tokenizer.is_file() else None,
    )
    return cfg


def export_hf(ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike) -> ModelConfig:
    """Write a meshtron checkpoint back as a Hugging Face directory."""
    if not (Path(ckpt_dir) / META_FILE).is_file():
        raise FileNotFoundError(
            f"{ckpt_dir} is not a meshtron model checkpoint (no {META_FILE}); for a training "
            "checkpoint root pass ROOT/final, or first run python tools/checkpoint.py "
            "export-model ROOT --out DIR"
        )
    ckpt = read_checkpoint(ckpt_dir)
    write_hf_dir(hf_dir, ckpt.config, ckpt.state, ckpt.extra.get("hf_config"))
    tokenizer = Path(ckpt_dir) / TOKENIZER_FILE
    if tokenizer.is_file():  # the model's own tokenizer, in the files AutoTokenizer reads
        ids = write_hf_tokenizer(
            tokenizer, hf_dir, arch=ckpt.config.arch, max_positions=ckpt.config.max_positions
        )
        # config.json names the special tokens by id too (GPT-2's defaults are 50256)
        config_path = Path(hf_dir) / "config.json"
        config = {**json.loads(config_path.read_text()), **ids}
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ckpt.config
