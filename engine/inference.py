"""Where a model to sample from comes from: a training checkpoint, a model export or a
Hugging Face GPT-2 directory, and the tokenizer that belongs to it.

The tokenizer is a ``tokenizer.json`` beside the weights (every export carries one), or the
one the training checkpoint records (path and SHA-256: a file replaced since is refused).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.models import ModelConfig
from parallel_state import ParallelState


@dataclass(frozen=True)
class ModelSource:
    """A model on disk: exactly one of ``ckpt`` (training root/step or export) or ``hf_dir``."""

    ckpt: str | None = None
    hf_dir: str | None = None

    def kind(self) -> str:
        """``"export"``, ``"training"`` or ``"hf"``; raises naming the path when it is none."""
        from engine.checkpoint.format import META_FILE

        if self.hf_dir is not None:
            if not (Path(self.hf_dir) / "config.json").is_file():
                raise FileNotFoundError(f"--hf-dir {self.hf_dir}: no config.json there")
            return "hf"
        if self.ckpt is None:
            raise ValueError(
                "pass --ckpt DIR (a training checkpoint or model export) or --hf-dir DIR"
            )
        if (Path(self.ckpt) / META_FILE).is_file():
            return "export"
        from engine.checkpoint.convert import resolve

        resolve(self.ckpt)  # raises CheckpointError naming what the directory is instead
        return "training"

    def config(self) -> ModelConfig:
        """The stored model config (cheap: no weights are read)."""
        kind = self.kind()
        if kind == "hf":
            from engine.hf_interop import config_from_hf, read_hf_config

            return config_from_hf(read_hf_config(self.hf_dir))
        if kind == "export":
            from engine.checkpoint.format import read_meta

            return read_meta(self.ckpt)[0]  # a damaged meshtron.json is named
        return ModelConfig.from_dict(self._index()["model_config"])

    def check_weights(self) -> None:
        """Raise a one-line ValueError naming the file if an export's or HF directory's
        weights cannot be read (a truncated file; reads only the headers), or a training
        checkpoint's files are missing or of other sizes than its index records (their
        checksums are checked when read)."""
        from engine.checkpoint.format import WEIGHTS_FILE, check_weights

        kind = self.kind()
        if kind == "training":
            step = self._step_dir()
            for fname, record in self._index()["files"].items():
                path = step / fname
                size = path.stat().st_size if path.is_file() else None
                if size != record.get("bytes"):
                    have = "is missing" if size is None else f"holds {size} bytes"
                    raise ValueError(
                        f"{path} {have}, and the checkpoint's index records {record.get('bytes')}"
                        " (a damaged checkpoint: use another step or checkpoint)"
                    )
        elif kind == "export":
            check_weights(Path(self.ckpt) / WEIGHTS_FILE)
        elif kind == "hf":
            from engine.hf_interop import hf_weight_files

            for name in hf_weight_files(self.hf_dir):
                check_weights(Path(self.hf_dir) / name)

    def load(
        self, state: ParallelState | None = None
    ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        """(config, full-shape weights), read on the calling rank (``state``: its mesh, for
        the training checkpoint's shape check)."""
        kind = self.kind()
        if kind == "hf":
            from engine.hf_interop import read_hf_dir

            cfg, state, _ = read_hf_dir(self.hf_dir)
            return cfg, state
        if kind == "export":
            from engine.checkpoint.format import read_checkpoint

            ckpt = read_checkpoint(self.ckpt)
            return ckpt.config, ckpt.state
        from engine.checkpoint.convert import read_model_state

        cfg, weights, _ = read_model_state(self.ckpt, state)
        return cfg, weights

    def tokenizer_path(self) -> str | None:
        """The tokenizer saved with the model's data, if one can be found."""
        directory = Path(self.hf_dir or self.ckpt)
        if (directory / "tokenizer.json").is_file():
            return str(directory / "tokenizer.json")
        index = None
        if self.kind() == "training":
            index = self._index()
        elif self.kind() == "export":  # ROOT/final: the run's checkpoints sit beside it
            index = _training_index(directory.parent)
        from engine.checkpoint.tokenizer import recorded_tokenizer

        return recorded_tokenizer((index or {}).get("trainer_state"))

    def name(self) -> str:
        """What to call the model: its directory's name, or for a training run's step
        directory or final export (``ROOT/final``), the run's (ROOT's) name."""
        from engine.checkpoint.storage import INDEX, LATEST

        directory = Path(self.hf_dir or self.ckpt).resolve()
        if self.hf_dir is None and (
            (directory / INDEX).is_file() or (directory.parent / LATEST).is_file()
        ):
            return directory.parent.name
        return directory.name

    def recorded_run_config(self) -> dict:
        """The run config a training checkpoint records, or for a run's final export
        (``ROOT/final``, its checkpoints beside it) the run's; ``{}`` for any other source."""
        kind = self.kind()
        if kind == "training":
            index = self._index()
        elif kind == "export":
            index = _training_index(Path(self.ckpt).parent) or {}
        else:
            return {}
        return (index.get("trainer_state") or {}).get("config") or {}

    def _step_dir(self) -> Path:
        from engine.checkpoint.convert import resolve

        return resolve(self.ckpt)

    def _index(self) -> dict:
        from engine.checkpoint.storage import read_index

        return read_index(self._step_dir())


def _training_index(root: Path) -> dict | None:
    from engine.checkpoint.convert import resolve
    from engine.checkpoint.storage import CheckpointError, read_index

    try:
        return read_index(resolve(root))
    except (CheckpointError, OSError):
        return None


def inference_config(cfg: ModelConfig) -> ModelConfig:
    """The layout options that only matter for training, switched off."""
    return replace(
        cfg, sequence_parallel=False, recompute="none", hidden_dropout=0.0, attention_dropout=0.0
    )


def init_source(path: str) -> ModelSource:
    """``checkpoint.init_from``'s directory as a source: a Hugging Face directory when it
    holds a config.json and no meshtron.json, else a meshtron export or checkpoint."""
    from engine.checkpoint.format import META_FILE

    hf = (Path(path) / "config.json").is_file() and not (Path(path) / META_FILE).is_file()
    return ModelSource(hf_dir=path) if hf else ModelSource(ckpt=path)


def init_from_problems(cfg) -> list[str]:
    """One line each for why ``cfg`` (a run's Config, its data resolved) cannot start from
    ``checkpoint.init_from``: no such model, another model (the keys a resume keeps,
    ``RESUME_FIXED``), or data tokenized with another vocabulary than the model's own
    tokenizer. Checked before any rank starts, from configs, tokenizers and the weight
    files' headers and sizes (not the weights)."""
    from engine.checkpoint.storage import CheckpointError
    from engine.config_cli import model_overrides

    path = cfg.checkpoint.init_from
    if not path:
        return []
    where = f"checkpoint.init_from={path}"
    if not Path(path).is_dir():
        return [
            f"{where} is not a directory: give a model export, a training checkpoint or a "
            "Hugging Face directory"
        ]
    source = init_source(path)
    try:
        saved = source.config()
        source.check_weights()
        theirs = source.tokenizer_path()
    except (OSError, ValueError, KeyError, CheckpointError) as err:
        return [f"{where}: {err}"]
    changes = cfg.model.resume_changes(saved)
    if changes:
        differ = "; ".join(f"model.{key}={old!r}, the run {new!r}" for key, old, new in changes)
        back = model_overrides(cfg.model, saved)
        return [f"{where} holds another model (it has {differ}); set {back} to start from it"]
    mine = cfg.data.tokenizer
    if theirs and mine and Path(mine).is_file() and _vocab(theirs) != _vocab(mine):
        return [
            f"{where} was trained with the tokenizer {theirs}, and data.tokenizer={mine} has "
            f"another vocabulary: tokenize the data with its tokenizer (tools/"
            f"preprocess_data.py --tokenizer {theirs}) and pass data.tokenizer={theirs}"
        ]
    return []


def _vocab(path: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab()


def initial_weights(cfg, model, ps: ParallelState) -> list[str]:
    """Load ``checkpoint.init_from``'s weights into ``model`` (this rank's shard of the whole
    model, before the pipeline cut and the DP wrap) when the run has no checkpoint of its
    own to resume; the console lines that say what was done."""
    from engine.checkpoint.manager import checkpoint_dir, newest_index

    path = cfg.checkpoint.init_from
    if not path:
        return []
    root = checkpoint_dir(cfg)
    if cfg.checkpoint.resume and newest_index(root) is not None:
        return [f"checkpoint.init_from={path} is not read: the run resumes its own checkpoint"]
    start, source = time.perf_counter(), init_source(path)
    _, state = source.load(ps)
    model.load_full_state_dict(state)
    kind = {"hf": "a Hugging Face directory", "export": "a model export"}.get(
        source.kind(), "a training checkpoint's weights"
    )
    return [
        f"initialized the weights from {path} ({kind}, loaded in "
        f"{time.perf_counter() - start:.2f} s); the optimizer, the step count and the data "
        "start afresh"
    ]
