"""What the planner reads of the model family table (``engine/models/families.py``).

The table and its package import no torch (the package loads its modules on first use),
so the torch-free planner reads the same rows as the runtime. A family's own modules
(``costs.py`` and the rest) import torch, so the planner prices a family by its traits
and ``engine.formulas``.
"""

from __future__ import annotations

from engine.models.families import FAMILIES

# ModelConfig.arch's default, the family a preset without ``arch`` is: the table's first row
# (tests/test_code_map.py checks the two agree).
DEFAULT_ARCH = next(iter(FAMILIES))
# The families the planner prices: the decoders (its terms are a causal LM's step).
PLANNED = tuple(arch for arch, fam in FAMILIES.items() if fam.causal)


def display_name(arch: str) -> str:
    """The family as the planner's report names it: its class without "Model"."""
    return FAMILIES[arch].model.removesuffix("Model")
