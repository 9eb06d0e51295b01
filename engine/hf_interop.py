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
An import keeps the Hugging Face tokenizer files beside it (``TOKENIZER_SIDE_FILES``: its
bos/eos, a chat template), which the server reads and the export gives back unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.checkpoint.format import (
    META_FILE,
    check_output_dir,
    read_checkpoint,
    save_tensors,
    write_checkpoint,
)
from engine.checkpoint.tokenizer import (
    TOKENIZER_FILE,
    TOKENIZER_SIDE_FILES,
    check_tokenizer,
    write_hf_tokenizer,
)
from engine.data.fsutil import MISSING, file_problem, read_json_object
from engine.models import ModelConfig
from engine.models.families import FAMILIES, family


def hf_model_types() -> dict[str, str]:
    """Every ``config.json`` ``model_type`` meshtron reads → the family (``model.arch``)."""
    return {kind: f.arch for f in FAMILIES.values() for kind in f.hf.ARCHITECTURES}


def hf_architectures(arch: str) -> tuple[str, ...]:
    """The transformers classes (``config.json`` ``architectures``) of family ``arch``."""
    return tuple(family(arch).hf.ARCHITECTURES.values())


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig for a ``config.json`` of any family's ``model_type``, type-checked and
    validated (``ModelConfig.validate``); unsupported variants and bad values raise a
    one-line ValueError naming the key."""
    if not isinstance(hf, dict):
        raise ValueError(f"config.json holds a {type(hf).__name__}, expected an object")
    kind, kinds = hf.get("model_type"), hf_model_types()
    if not isinstance(kind, str) or kind not in kinds:
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


def state_from_hf(
    cfg: ModelConfig, hf: dict[str, torch.Tensor], *, tp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """meshtron full state dict from the HF state dict of ``cfg``'s family, every tensor's
    shape and dtype checked first (``tp_group``: the group the caller builds its model
    over, for the check's meta model; None in a plain single process)."""
    return family(cfg.arch).hf.state_from_hf(cfg, hf, tp_group=tp_group)


def state_to_hf(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf` (tied copies omitted, as save_pretrained does)."""
    return family(cfg.arch).hf.state_to_hf(cfg, ours)


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a local HF directory; a clear error if there is none."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    return read_json_object(path)


def read_hf_dir(
    hf_dir: str | os.PathLike, *, tp_group: dist.ProcessGroup | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(ModelConfig, meshtron full state dict, original config.json) of a local HF directory
    (``tp_group``: see :func:`state_from_hf`)."""
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    cfg = config_from_hf(hf_config)
    weights: dict[str, torch.Tensor] = {}
    shard_of: dict[str, str] = {}  # tensor name → the shard it came from
    for shard_name in hf_weight_files(hf_dir):
        if problem := file_problem(hf_dir / shard_name):  # a FIFO would wait for a writer
            raise ValueError(f"{hf_dir / shard_name} {problem}; a safetensors file is read")
        try:
            tensors = load_file(str(hf_dir / shard_name))
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"{hf_dir / shard_name} is not a readable safetensors file ({err})"
            ) from None
        for name in tensors:  # which copy would win is a guess; refuse to make it
            if name in shard_of:
                raise ValueError(
                    f"{name} is in both {shard_of[name]} and {shard_name}; a tensor belongs "
                    "to one shard"
                )
            shard_of[name] = shard_name
        weights.update(tensors)
    return cfg, state_from_hf(cfg, weights, tp_group=tp_group), hf_config


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
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
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
    _check_new_dir(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(state_to_hf(cfg, state), hf_dir / "model.safetensors", metadata={"format": "pt"})
    _write_json(hf_dir / "config.json", config_to_hf(cfg, base_config))


def _check_new_dir(hf_dir: Path) -> None:
    if hf_dir.exists() and (not hf_dir.is_dir() or any(hf_dir.iterdir())):
        raise FileExistsError(f"{hf_dir} exists and is not empty; export into a new directory")


GENERATION_FILE = "generation_config.json"
# Checkpoint metadata (``Checkpoint.extra``) an import records for its export: the original
# config.json (its eos/bos/pad ids among the keys no family maps) and generation config.
HF_CONFIG, HF_GENERATION_CONFIG = "hf_config", "hf_generation_config"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def import_hf(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> ModelConfig:
    """Convert a local HF directory into a meshtron checkpoint (usable at any TP size).

    Everything is read and checked (config values, every tensor's shape and dtype against
    the family's model, shards, the generation config) before anything is written."""
    check_output_dir(ckpt_dir)
    cfg, state, hf_config = read_hf_dir(hf_dir)
    extra: dict[str, Any] = {HF_CONFIG: hf_config}
    generation, tokenizer = (
        _optional_file(hf_dir, GENERATION_FILE),
        _optional_file(hf_dir, TOKENIZER_FILE),
    )
    if generation is not None:
        extra[HF_GENERATION_CONFIG] = read_json_object(generation)
    sides = []  # how the tokenizer is used (bos/eos, a chat template): kept beside it
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg.vocab_size)
        sides = [p for name in TOKENIZER_SIDE_FILES if (p := _optional_file(hf_dir, name))]
    write_checkpoint(ckpt_dir, state, cfg, extra=extra, tokenizer=tokenizer, tokenizer_files=sides)
    return cfg


def _optional_file(hf_dir: str | os.PathLike, name: str) -> Path | None:
    """``hf_dir/name`` if it is a regular file, None if there is none; a one-line
    ValueError for a FIFO, directory or the like there (not silently skipped)."""
    path = Path(hf_dir) / name
    problem = file_problem(path)
    if problem == MISSING:
        return None
    if problem is not None:
        raise ValueError(f"{path} {problem}; give a regular file or none")
    return path


def export_hf(ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike) -> ModelConfig:
    """Write a meshtron checkpoint back as a Hugging Face directory: a model export
    (``ROOT/final``, ``export-model``'s or an import's directory) or a training checkpoint
    (a root, its latest step, or a step directory; its shards are merged, as
    ``export-model`` merges them, and the tokenizer it records goes along).

    config.json names the special tokens by id: an imported model's own ids, else those its
    tokenizer assigns to the family's roles (``Family.special_tokens``). A decoder's
    generation_config.json is the imported one, else the ids (so ``generate`` stops at eos).
    """
    hf_dir = Path(hf_dir)
    _check_new_dir(hf_dir)  # before the weights are read
    if (Path(ckpt_dir) / META_FILE).is_file():
        ckpt = read_checkpoint(ckpt_dir)
        cfg, state, extra = ckpt.config, ckpt.state, ckpt.extra
        tokenizer = Path(ckpt_dir) / TOKENIZER_FILE
        tokenizer = tokenizer if tokenizer.is_file() else None
        sides = [Path(ckpt_dir) / n for n in TOKENIZER_SIDE_FILES if (Path(ckpt_dir) / n).is_file()]
    else:  # a training checkpoint, or a CheckpointError naming what the directory is
        from engine.checkpoint.convert import read_model_state, resolve
        from engine.checkpoint.storage import CheckpointError
        from engine.checkpoint.tokenizer import recorded_tokenizer

        if not Path(ckpt_dir).exists():
            raise FileNotFoundError(
                f"{ckpt_dir} does not exist: give a model export (ROOT/final) or a training "
                "checkpoint (checkpoints/NAME, as a run prints, or one of its step directories)"
            )
        try:
            step = resolve(ckpt_dir)
        except CheckpointError as err:
            raise CheckpointError(f"{err}, and not a model export (no {META_FILE})") from None
        cfg, state, index = read_model_state(step)
        extra, tokenizer, sides = {}, recorded_tokenizer(index.get("trainer_state")), []
    if cfg.mlp == "moe" and not family(cfg.arch).hf_experts:
        raise ValueError(
            f"{ckpt_dir} holds a {cfg.arch} model with experts (model.mlp=moe), and "
            f"transformers has no {cfg.arch} architecture with experts to export it to "
            "(only the llama family's: Mixtral, Qwen2-MoE, Qwen3-MoE); nothing was written"
        )
    # Written beside the target and renamed into place once whole: an export that fails
    # (a full disk, a tokenizer it cannot convert) leaves no half-written directory.
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = hf_dir.parent / f".{hf_dir.name}.partial-{os.getpid()}"
    try:
        _write_hf_export(partial, cfg, state, extra, tokenizer, sides)
        if hf_dir.exists():
            hf_dir.rmdir()  # empty (checked above)
        partial.rename(hf_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return cfg


def _write_hf_export(
    hf_dir: Path, cfg: ModelConfig, state, extra: dict, tokenizer, sides: list[Path]
) -> None:
    """export_hf's files in ``hf_dir``: weights and config, tokenizer (and ``sides``, the
    Hugging Face tokenizer files an import kept), generation config."""
    write_hf_dir(hf_dir, cfg, state, extra.get(HF_CONFIG))
    config = json.loads((hf_dir / "config.json").read_text())
    if tokenizer is not None:  # the model's own tokenizer, in the files AutoTokenizer reads
        ids = write_hf_tokenizer(tokenizer, hf_dir, arch=cfg.arch, max_positions=cfg.max_positions)
        config.update({k: v for k, v in ids.items() if config.get(k) is None})
        _write_json(hf_dir / "config.json", config)
        for side in sides:  # an imported model's own: they win
            shutil.copyfile(side, hf_dir / side.name)
    generation = extra.get(HF_GENERATION_CONFIG)
    if generation is None and cfg.causal:
        generation = {k: config[k] for k in SPECIAL_IDS if config.get(k) is not None} or None
    if generation is not None:
        _write_json(hf_dir / GENERATION_FILE, generation)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
