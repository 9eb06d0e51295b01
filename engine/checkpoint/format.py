"""Layout-independent model weights on disk.

A checkpoint is a directory holding

* ``model.safetensors``: every parameter at full shape under its stable global name (the
  module path, the same at every TP size), vocabulary unpadded;
* ``meshtron.json``: the format version, the ModelConfig and optional extra metadata;
* ``tokenizer.json`` (when the model has one): a copy of the tokenizer it was trained with.

So a checkpoint written at one TP size loads at any other. Writes go to a temporary
sibling directory that is renamed into place, so a crash never leaves a half-written
checkpoint under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from engine import comm
from engine.checkpoint.tensorfile import write_tensors
from engine.checkpoint.tokenizer import (
    TOKENIZER_FILE,
    TOKENIZER_SIDE_FILES,
    copy_tokenizer,
    tokenizer_record,
)
from engine.data.fsutil import file_problem, read_json_object
from engine.models import ModelConfig, ParallelModel, build_model

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
META_FILE = "meshtron.json"
# Fields that fix parameter shapes; the rest (dropout, recompute, sequence parallelism,
# kernels) may differ between the writer and the reader.
SHAPE_FIELDS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "ffn_size",
    "kv_heads",
    "max_positions",
    "num_token_types",
    "tie_embeddings",
)
# The config key a user sets for a derived field above.
_CONFIG_KEY = {"ffn_size": "ffn_hidden_size", "kv_heads": "num_kv_heads"}


@dataclass
class Checkpoint:
    """A checkpoint read into memory."""

    state: dict[str, torch.Tensor]
    config: ModelConfig
    extra: dict[str, Any] = field(default_factory=dict)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.save_file`` with the permissions the umask gives ordinary files.

    safetensors creates its files 0600, which would shut teammates on a shared cluster out
    of checkpoints and exported models.
    """
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_checkpoint(
    directory: str | os.PathLike,
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    *,
    extra: dict[str, Any] | None = None,
    tokenizer: str | os.PathLike | None = None,
    tokenizer_files: Iterable[str | os.PathLike] = (),
) -> None:
    """Write full-shape ``state`` and ``config`` to ``directory``, replacing it atomically;
    with ``tokenizer`` (a tokenizer.json) a copy of it, and its origin in the metadata;
    ``tokenizer_files``: copies of the Hugging Face files beside it (``TOKENIZER_SIDE_FILES``)."""
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        # Written from the tensors' own memory (views and shared storage too), fsynced.
        tensors = {k: v.detach().cpu() for k, v in state.items()}
        write_tensors(tmp / WEIGHTS_FILE, tensors, metadata={"format": "meshtron"})
        extra = dict(extra or {})
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp)
            extra["tokenizer"] = tokenizer_record(tokenizer)
        for side in map(Path, tokenizer_files):
            if side.name not in TOKENIZER_SIDE_FILES:
                raise ValueError(f"{side} is not one of {', '.join(TOKENIZER_SIDE_FILES)}")
            shutil.copyfile(side, tmp / side.name)
        meta = {"format_version": FORMAT_VERSION, "model_config": config.to_dict(), "extra": extra}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_dir(directory: str | os.PathLike) -> None:
    """Raise ValueError unless :func:`write_checkpoint` may write ``directory``: it must be
    missing, empty, or a model checkpoint itself (which is replaced). Anything else there
    would be deleted by the replacement, so a user's file or directory is refused."""
    path = Path(directory)
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path} is a file; give a new directory to write the model to")
    extra = sorted(
        p.name
        for p in path.iterdir()
        if p.name not in (META_FILE, WEIGHTS_FILE, TOKENIZER_FILE, *TOKENIZER_SIDE_FILES)
    )
    if extra or (any(path.iterdir()) and not (path / META_FILE).is_file()):
        raise ValueError(
            f"{path} exists and holds other files ({', '.join(extra[:3]) or 'no ' + META_FILE}); "
            "give a new or empty directory"
        )


def _move_into_place(tmp: Path, final: Path) -> None:
    if not final.exists():
        os.rename(tmp, final)
        return
    # rename() cannot replace a non-empty directory: park the old one, then drop it.
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """(model config, extra metadata) of the checkpoint in ``directory``: its meshtron.json,
    read and checked (an object, this format version, a ``model_config`` whose keys and
    value types are ModelConfig's). Reads no weights. A damaged file is a one-line
    ValueError naming it; a directory without one, FileNotFoundError."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a meshtron checkpoint (no {META_FILE})")
    meta = read_json_object(meta_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version {meta.get('format_version')!r}, "
            f"this meshtron reads {FORMAT_VERSION}"
        )
    if "model_config" not in meta:
        raise ValueError(f"{meta_path} is damaged: it has no model_config")
    try:
        config = ModelConfig.from_dict(meta["model_config"])
    except ValueError as err:
        raise ValueError(f"{meta_path} is damaged: model_config: {err}") from None
    extra = meta.get("extra", {})
    if not isinstance(extra, dict):
        raise ValueError(
            f"{meta_path} is damaged: extra is a {type(extra).__name__}, not an object"
        )
    return config, extra


def check_weights(path: str | os.PathLike) -> None:
    """Raise a one-line ValueError naming ``path`` unless it is a safetensors file whose
    header reads and covers the file (a truncated file fails here); reads no tensors."""
    if problem := file_problem(path):  # a FIFO would wait for a writer
        raise ValueError(f"{path} {problem}; a safetensors file is read")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err})") from None


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``; a one-line ValueError naming it when it
    is missing or damaged."""
    check_weights(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err})") from None


def read_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint directory written by :func:`write_checkpoint` (errors: see
    :func:`read_meta` and :func:`read_weights`)."""
    config, extra = read_meta(directory)
    return Checkpoint(read_weights(Path(directory) / WEIGHTS_FILE), config, extra)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_model(
    model: ParallelModel,
    directory: str | os.PathLike,
    *,
    extra: dict[str, Any] | None = None,
    tokenizer: str | os.PathLike | None = None,
    more: dict[str, torch.Tensor] | None = None,
) -> None:
    """Gather ``model``'s full weights and write them (global rank 0 writes), with a copy of
    ``tokenizer`` when given; ``more``: tensors to write beside the weights (the sigmoid
    routers' biases, which ``load_full_state_dict`` takes too).

    Every rank must call this: the gather is collective over TP, and all ranks wait at a
    barrier so that none reads the checkpoint before it exists.
    """
    state = model.full_state_dict() | (more or {})
    if _rank() == 0:
        write_checkpoint(directory, state, model.cfg, extra=extra, tokenizer=tokenizer)
    comm.barrier(comm.world())


def check_compatible(model_cfg: ModelConfig, ckpt_cfg: ModelConfig) -> None:
    """Raise if the checkpoint's parameter shapes cannot fit ``model_cfg``."""
    for key in SHAPE_FIELDS:
        mine, theirs = getattr(model_cfg, key), getattr(ckpt_cfg, key)
        if mine != theirs:
            key = _CONFIG_KEY.get(key, key)
            raise ValueError(f"checkpoint has model.{key}={theirs!r}, the model {mine!r}")


def load_into(model: ParallelModel, directory: str | os.PathLike) -> Checkpoint:
    """Load a checkpoint into an existing model at its own TP layout; returns what was read."""
    ckpt = read_checkpoint(directory)
    check_compatible(model.cfg, ckpt.config)
    model.load_full_state_dict(ckpt.state)
    return ckpt


def load_model(
    directory: str | os.PathLike,
    *,
    tp_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    overrides: dict[str, Any] | None = None,
) -> ParallelModel:
    """Build the checkpoint's model on this rank's TP shard and load its weights.

    ``overrides`` changes layout fields of the stored config (e.g. sequence_parallel,
    recompute, dropout); ``dtype`` defaults to the stored one.
    """
    ckpt = read_checkpoint(directory)
    cfg = replace(ckpt.config, **(overrides or {}))
    check_compatible(cfg, ckpt.config)
    dtype = dtype or next(iter(ckpt.state.values())).dtype
    model = build_model(cfg, tp_group=tp_group, dtype=dtype, device=device)
    model.load_full_state_dict(ckpt.state)
    return model
