"""Model sizes by preset name, read from configs/model/*.yaml (no torch needed).

engine.models.preset reads the same files (one source per preset); reading the
YAML here gives the same sizes without importing the model code (or torch).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from studies.perfmodel.family_table import DEFAULT_ARCH, PLANNED

MODEL_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
# The schema's defaults (engine/models/config.py ModelConfig) for the keys a preset may leave
# out and the planner reads; tests/test_perfmodel_cp_moe.py holds them equal.
SCHEMA_DEFAULTS = {
    "mlp": "dense",
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_ffn_hidden_size": None,
    "moe_shared_ffn_hidden_size": 0,
    "moe_layer_freq": 1,
    "attention_head_dim": None,
}


def moe_sizes(name: str, values: dict) -> dict:
    """The planner's MoE fields (experts, top_k, moe_ffn, shared_experts) of preset ``name``
    (``values``: :func:`model_preset`'s), empty for a dense one. Raises ValueError for what
    the planner does not model: experts on some layers only, or a shared expert whose width
    is not a whole number of routed experts' widths."""
    get = {**SCHEMA_DEFAULTS, **values}.get
    if get("mlp") != "moe":
        return {}
    if get("moe_layer_freq") != 1:
        raise ValueError(
            f"model preset {name!r} puts experts on every {get('moe_layer_freq')}th layer "
            "(moe_layer_freq): the planner prices every layer as an MoE one"
        )
    expert = get("moe_ffn_hidden_size") or values.get("ffn_hidden_size")
    shared = get("moe_shared_ffn_hidden_size")
    if shared and (not expert or shared % expert):
        raise ValueError(
            f"model preset {name!r} has a shared expert of width {shared}, not a multiple of "
            f"its experts' {expert}: give --shared-experts and --moe-ffn"
        )
    return {
        "experts": get("moe_num_experts"),
        "top_k": get("moe_top_k"),
        "moe_ffn": expert,
        "shared_experts": shared // expert if shared else 0,
    }


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


def preset_fields(name: str) -> dict:
    """Preset ``name`` as Workload keyword arguments (sizes, family, MoE), the one reading
    of a preset the planner and the calibration share; flags override them."""
    pre = model_preset(name)
    return {
        "hidden": pre.get("hidden_size"),
        "layers": pre.get("num_layers"),
        "heads": pre.get("num_heads"),
        "vocab": pre.get("vocab_size"),
        "seq": pre.get("max_positions"),
        "ffn": pre.get("ffn_hidden_size"),
        "family": pre.get("arch", DEFAULT_ARCH),
        "kv_heads": pre.get("num_kv_heads"),
        "head_dim": pre.get("attention_head_dim"),
        **moe_sizes(name, pre),
    }
