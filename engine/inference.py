"""Where a model to sample from comes from: a training checkpoint, a model export or a
Hugging Face GPT-2 directory, and the tokenizer that belongs to it.

The tokenizer is a ``tokenizer.json`` beside the weights (every export carries one), or the
one the training checkpoint records (path and SHA-256: a file replaced since is refused).
"""

from __future__ import annotations

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
        weights cannot be read (a truncated file); reads only the headers. A training
        checkpoint's files are checked against its index when read."""
        from engine.checkpoint.format import WEIGHTS_FILE, check_weights

        kind = self.kind()
        if kind == "export":
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
        """The run config a training checkpoint records (``{}`` for any other source)."""
        if self.kind() != "training":
            return {}
        return (self._index().get("trainer_state") or {}).get("config") or {}

    def _index(self) -> dict:
        from engine.checkpoint.convert import resolve
        from engine.checkpoint.storage import read_index

        return read_index(resolve(self.ckpt))


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
