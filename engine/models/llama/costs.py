"""The Llama family's FLOP and parameter terms.

The formulas live in ``engine.formulas`` (plain Python, so the performance model reads them
without torch); this module is where the family's folder names them.
"""

from __future__ import annotations

from engine.formulas import (  # noqa: F401  (the family's public cost terms)
    llama_flops_per_iteration,
    llama_layer_weights,
    llama_params_count,
)
