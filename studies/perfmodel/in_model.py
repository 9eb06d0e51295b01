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

import sys
from dataclasses import replace
from typing import Any

# Layouts the calibration runs for communication: (tp, dp, sequence parallel). Each covers
# one key of the tables; the quick set covers what the CI-sized validation prices.
RUNS = ((2, 1, False), (2, 1, True), (1, 2, False), (2, 2, False), (4, 1, False),
        (1, 4, False))  # fmt: skip
QUICK_RUNS = ((2, 1, False), (1, 2, False))
# Micro-batches of the runs: TP layouts run twice, (smallest hidden, 1) and (largest
# hidden, 2), so that their cost can be split into a part per collective and a part
# proportional to compute. The validation points run 4 and 16: none is a calibration run.
MICRO_BATCHES = (1, 2)
STEPS = 16


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


def _keyed(raw: dict, key: str) -> tuple:
    return tuple(tuple(r) for r in raw.get(key) or ())


def parse(raw: dict | None) -> dict[str, tuple]:
    """The ``in_model`` YAML section as tuples (hashable, for the frozen ClusterSpec)."""
    raw = raw or {}
    return {k: _keyed(raw, k) for k in ("tp", "dp_wait_us", "optimizer_us_per_tensor")}


def parameter_tensors(layers: int) -> int:
    """Parameter tensors of the GPT (each costs the optimizer host time): 12 per layer
    (two LayerNorms, QKV, projection, two MLP linears: weight and bias each) + word and
    position embeddings + the final LayerNorm's two."""
    return 12 * layers + 4


def _run(w: Any, tp: int, dp: int, sp: bool, micro_batch: int, cluster: Any):
    """(measured parts, the model's breakdown) of STEPS trainer steps at this layout."""
    from studies.perfmodel.model import Layout, predict
    from studies.perfmodel.validate import Point, _run_pretrain

    lay = Layout(tp, dp, micro_batch, sequence_parallel=sp, fused_attention=False, threads=1)
    label = f"h{w.hidden} tp{tp} dp{dp}{' sp' if sp else ''} mb{micro_batch}"
    print(f"calibrate: trainer run {label} ({STEPS} steps) ...", file=sys.stderr, flush=True)
    _, parts = _run_pretrain(Point(label, w, lay), steps=STEPS, log_every=4, timeout=600)
    return label, parts, predict(w, lay, cluster).breakdown


def _fit_tp(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(seconds per collective, fraction of compute) from (lost, collectives, compute) per
    micro-batch: lost = collectives·a + f·compute, solved exactly for two runs; with one
    run, or where the solution has a negative part, all of it is put on the collectives."""
    if len(samples) == 2:
        (l1, n1, c1), (l2, n2, c2) = samples
        det = n1 * c2 - n2 * c1
        if det:
            a, f = (l1 * c2 - l2 * c1) / det, (n1 * l2 - n2 * l1) / det
            if a >= 0 and f >= 0:
                return a, f
    return sum(lost / n for lost, n, _ in samples) / len(samples), 0.0


def measure(w: Any, hiddens: list[int], spec: dict, quick: bool) -> dict:
    """Run the trainer at the calibration layouts; return ``compute_scale`` and the
    ``in_model`` tables. ``spec`` is the cluster measured so far (its α-β and bandwidths
    price what the runs are compared with)."""
    from studies.perfmodel.cluster import cluster_from_dict

    w = replace(w, global_batch=16)
    bare = cluster_from_dict({k: v for k, v in spec.items() if k != "in_model"})
    scale, runs, opt = {}, [], {}

    def optimizer(ranks: int, parts: dict, priced: dict) -> None:
        extra = max(0.0, parts["optimizer_s"] - priced["optimizer_s"])
        opt.setdefault(ranks, []).append(extra * 1e6 / parameter_tensors(w.layers))

    for h in hiddens:  # one rank: the trainer's compute over the priced ops
        label, parts, priced = _run(replace(w, hidden=h), 1, 1, False, MICRO_BATCHES[-1], bare)
        scale[h] = round(parts["compute_s"] / priced["compute_s"], 4)
        runs.append({"run": label, **{k: round(v, 5) for k, v in parts.items()}})
        optimizer(1, parts, priced)
    cluster = replace(bare, compute_scale=scale)
    tp_rows, dp_rows = [], []
    for tp, dp, sp in QUICK_RUNS if quick else RUNS:
        shapes = [(min(hiddens), MICRO_BATCHES[0]), (max(hiddens), MICRO_BATCHES[-1])]
        samples = []
        for h, mb in shapes if tp > 1 else shapes[-1:]:
            wh = replace(w, hidden=h)
            label, parts, priced = _run(wh, tp, dp, sp, mb, cluster)
            runs.append({"run": label, **{k: round(v, 5) for k, v in parts.items()}})
            micro, ranks = w.global_batch // (dp * mb), tp * dp
            if tp > 1:
                lost = parts["compute_s"] + parts["tp_comm_s"] - priced["compute_s"]
                samples.append(
                    (lost / micro, tp_collectives(w.layers), priced["compute_s"] / micro)
                )
            if dp > 1 and h == max(hiddens):
                wait = max(0.0, parts["dp_comm_exposed_s"] - priced["dp_comm_exposed_s"])
                dp_rows.append([dp, ranks, round(wait * 1e6, 1)])
            if not sp:
                optimizer(ranks, parts, priced)
        if tp > 1:
            a, f = _fit_tp(samples)
            tp_rows.append([tp, "sp" if sp else "ar", ranks, round(a * 1e6, 1), round(f, 4)])
    opt_rows = [[r, round(sum(v) / len(v), 2)] for r, v in sorted(opt.items())]
    return {
        "compute_scale": scale,
        "in_model": {
            "tp": tp_rows,
            "dp_wait_us": dp_rows,
            "optimizer_us_per_tensor": opt_rows,
            "runs": runs,
        },
    }
