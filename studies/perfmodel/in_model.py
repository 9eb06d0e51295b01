"""What collectives cost inside training, measured by short runs of the trainer (CPU ranks).

On CPU ranks a collective's price from the back-to-back probe (α + β·n) misses most of
what it costs inside a training step. Timing each TP collective of a real step with the
ranks' arrival times showed why (docs/PERFMODEL.md, "In-model calibration"): the same
256 KB all-reduce took 0.3 ms when both ranks were running and 3–5 ms when one had gone
to sleep in it; ranks that sleep in collectives then compute more slowly after them; and
a synchronous DP step waits for its slowest rank. None of these is a property of the
link, and none shows in a loop of collectives. So ``tools/calibrate.py`` runs the
trainer itself (``engine.pretrain``, 16 steps) at a few small layouts, at micro-batches
of its own, and recordsmicro-batch of its own, and records:

- ``compute_scale`` (in ``device``): one rank's forward-backward seconds over the model's
  price of the same ops, per hidden size;
- ``tp``: rows [TP size, kind, ranks on the machine, µs per collective, fraction]: a step
  loses (forward-backward − priced compute) = collectives × µs + fraction × priced compute
  to TP; kind ``ar`` is all-reduce, ``sp`` the sequence-parallel all-gather /
  reduce-scatter pair. Two runs per row (a small and a larger micro-batch × hidden) split
  the loss into its two parts;
- ``dp_wait_us``: rows [DP size, ranks, µs]: the DP wait after backward beyond the α-β
  price of the gradient reduction (the wait for the slowest rank);
- ``optimizer_us_per_tensor``: rows [ranks, µs]: the optimizer phase beyond its priced
  bandwidth, per parameter tensor (host time per tensor, plus the gradient-norm and
  bad-step collectives).

The model uses these where they exist (``in_model`` in the cluster YAML); GPU clusters
have none and keep the α-β prices. The module is pure Python: the runs are subprocesses.
"""

from __future__ import annotations

import math


def tp_collectives(layers: int, recompute: str = "none") -> int:
    """TP collectives of one micro-batch on one rank, as the trainer runs them.

    Per layer two forward and two backward. Full recompute repeats only the first of the
    two forward ones: torch's checkpoint stops recomputing once it has every tensor the
    backward needs, before the MLP's row-parallel all-reduce. The vocab-parallel embedding
    and the LM head's input gradient add one each; the vocab-parallel cross-entropy two
    small ones (row max; sum of exponentials stacked with the target logit). Counted on
    real steps (tests/test_perfmodel_in_model.py): 12 at two layers, 14 with full recompute.
    """
    return layers * (5 if recompute == "full" else 4) + 2 + 2


def nearest(rows: tuple | list, key: tuple, ranks: int) -> tuple | None:
    """The row whose leading fields equal ``key``, at the rank count nearest ``ranks``
    (rows are [*key, ranks, value...]; a tie goes to more ranks); None when none has it."""
    width = len(key)
    match = [tuple(r) for r in rows if tuple(r[:width]) == key]
    if not match:
        return None
    return min(match, key=lambda r: (abs(r[width] - ranks), -r[width]))


def lookup(rows: tuple | list, key: tuple, ranks: int) -> float | None:
    """Seconds of the nearest row's last field (µs), or None (see ``nearest``)."""
    row = nearest(rows, key, ranks)
    return None if row is None else float(row[-1]) * 1e-6


# The rows of each table: a kind is a word, every other field a finite number >= 0.
ROWS = {
    "tp": "[tp, kind, ranks, us, fraction]",
    "dp_wait_us": "[dp, ranks, us]",
    "optimizer_us_per_tensor": "[ranks, us]",
}


def _field_ok(value, is_kind: bool) -> bool:
    if is_kind:
        return isinstance(value, str)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= 0


def _keyed(raw: dict, key: str, where: str) -> tuple:
    rows, fields = raw.get(key) or [], ROWS[key][1:-1].split(", ")
    ok = isinstance(rows, list) and all(
        isinstance(r, list)
        and len(r) == len(fields)
        and all(_field_ok(v, f == "kind") for v, f in zip(r, fields, strict=True))
        for r in rows
    )
    if not ok:
        raise ValueError(
            f"{where}.in_model.{key} must be a list of {ROWS[key]} rows (numbers finite, >= 0)"
        )
    return tuple(tuple(r) for r in rows)


def parse(raw: dict | None, where: str = "cluster") -> dict[str, tuple]:
    """The ``in_model`` YAML section as tuples (hashable, for the frozen ClusterSpec);
    ValueError naming ``where.in_model.KEY`` when a table is malformed. Empty when absent."""
    if not raw:
        return {}
    return {k: _keyed(raw, k, where) for k in ROWS}


def parameter_tensors(layers: int) -> int:
    """Parameter tensors of the GPT (each costs the optimizer host time): 12 per layer
    (two LayerNorms, QKV, projection, two MLP linears: weight and bias each) + word and
    position embeddings + the final LayerNorm's two."""
    return 12 * layers + 4
