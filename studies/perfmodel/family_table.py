"""The model family table (``engine/models/families.py``), read without torch.

The planner runs where torch is not installed, and importing the table through its
package runs ``engine/models/__init__.py``, which imports torch. The table itself imports
nothing of ours (tests/test_models.py holds it to that), so it loads on its own from its
file: the same rows, the same traits. A family's own modules (``costs.py`` and the rest)
import torch, so the planner prices a family by its traits and ``engine.formulas``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parents[2] / "engine" / "models" / "families.py"


def _load_table():
    name = f"{__name__}._table"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TABLE_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # registered first: dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


FAMILIES = _load_table().FAMILIES
# ModelConfig.arch's default, the family a preset without ``arch`` is: the table's first row
# (tests/test_code_map.py checks the two agree).
DEFAULT_ARCH = next(iter(FAMILIES))
# The families the planner prices: the decoders (its terms are a causal LM's step).
PLANNED = tuple(arch for arch, fam in FAMILIES.items() if fam.causal)


def display_name(arch: str) -> str:
    """The family as the planner's report names it: its class without "Model"."""
    return FAMILIES[arch].model.removesuffix("Model")
