"""Hugging Face checkpoints ↔ meshtron's layout-independent weights, for every family.

The logits parity check against transformers is studies/verification/hf_parity.py.

Only local ``save_pretrained`` directories are read (``config.json`` and safetensors
weights, one file or shards with ``model.safetensors.index.json``); nothing is fetched.
Which family a directory holds is its ``config.json`` ``model_type``; each family's
``hf.py`` (``engine/models/<arch>/hf.py``) maps its config and weight names, by pure
relabelling, transposition and row permutation, so HF → meshtron → HF reproduces every
tensor bit for bit. Vocabulary tables stay unpadded on disk (meshtron pads them when it
builds a model).

A ``tokenizer.json`` travels both ways; an export adds ``tokenizer_config.json`` and
``special_tokens_map.json`` so that ``AutoTokenizer.from_pretrained`` opens the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
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
from engine.models.families import FAMILIES, family


def hf_model_types() -> dict[str, str]:
    """Every ``config.json`` ``model_type`` meshtron reads → the family (``model.arch``)."""
    return {kind: f.arch for f in FAMILIES.values() for kind in f.hf.ARCHITECTURES}


def hf_architectures(arch: str) -> tuple[str, ...]:
    """The transformers classes (``config.json`` ``architectures``) of family ``arch``."""
    return tuple(family(arch).hf.ARCHITECTURES.values())


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig for a ``config.json`` of any family's ``model_type``; unsupported
    variants raise."""
    kind, kinds = hf.get("model_type"), hf_model_types()
    if kind not in kinds:
        names = list(kinds)
        raise ValueError(
            f"model_type {kind!r} is not supported; use {', '.join(names[:-1])} or {names[-1]}"
        )
    try:
        return family(kinds[kind]).hf.config_from_hf(hf)
    except KeyError as missing:
        raise ValueError(f"{kind!r} config.json lacks {missing}") from None


def config_to_hf(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``cfg``, on top of ``base`` (the imported original, if any)."""
    return family(cfg.arch).hf.config_to_hf(cfg, base)


def state_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshtron full state dict from the HF state dict of ``cfg``'s family."""
    return family(cfg.arch).hf.state_from_hf(cfg, hf)


def state_to_hf(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf` (tied copies omitted, as save_pretrained does)."""
    return family(cfg.arch).hf.state_to_hf(cfg, ours)


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
