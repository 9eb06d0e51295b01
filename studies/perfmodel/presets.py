"""Model sizes by preset name, read from configs/model/*.yaml (no torch needed).

engine.models.preset reads the same files (one source per preset); reading the
YAML here gives the same sizes without importing the model code (or torch).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from studies.perfmodel.family_table import DEFAULT_ARCH, PLANNED

MODEL_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"


def model_preset(name: str, directory: Path = MODEL_DIR) -> dict:
    """The preset's values: hidden_size, num_layers, num_heads, vocab_size, max_positions..."""
    path = directory / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ValueError(f"unknown model preset {name!r}; choose one of {choices}")
    values = yaml.safe_load(path.read_text()) or {}
    values.pop("defaults", None)
    if values.get("arch", DEFAULT_ARCH) not in PLANNED:
        raise ValueError(
            f"model preset {name!r} is {values['arch']}: the planner models the decoder "
            f"families only ({', '.join(PLANNED)})"
        )
    return values
