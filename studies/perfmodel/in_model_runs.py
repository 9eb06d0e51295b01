"""The in-model calibration runs: short trainer runs at a few small layouts, fitted into
the ``compute_scale`` and ``in_model`` tables that :mod:`studies.perfmodel.in_model`
reads (what the tables mean is documented there and in docs/PERFMODEL.md).

Kept apart from the table readers so that the model (which reads the tables) and these
runs (which call the model to price what they measured) form no import circle.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from studies.perfmodel.cluster_spec import cluster_from_dict
from studies.perfmodel.in_model import parameter_tensors, tp_collectives
from studies.perfmodel.model import Layout, predict
from studies.perfmodel.validate import Point, run_pretrain

# Layouts the calibration runs for communication: (tp, dp, sequence parallel). Each covers
# one key of the tables; the quick set covers what the CI-sized validation prices.
RUNS = ((2, 1, False), (2, 1, True), (1, 2, False), (2, 2, False), (4, 1, False), (1, 4, False))
QUICK_RUNS = ((2, 1, False), (1, 2, False))
# Micro-batches of the runs: TP layouts run twice, (smallest hidden, 1) and (largest
# hidden, 2), so that their cost can be split into a part per collective and a part
# proportional to compute. The validation points run 4 and 16: none is a calibration run.
MICRO_BATCHES = (1, 2)
STEPS = 16
# --quick (the CI test: does the pipeline run, not how well it fits): each TP layout runs
# once, at the largest shape (so ``fit_tp`` puts all of the cost on the collectives), for
# QUICK_STEPS steps, the first window of which is the warm-up.
QUICK_STEPS = 6
# The fewest steps a run can have (``--in-model-steps``): two logging windows of 2 steps,
# the warm-up and one measured.
MIN_STEPS = 4


def _run(w: Any, tp: int, dp: int, sp: bool, micro_batch: int, cluster: Any, steps: int):
    """(measured parts, the model's breakdown) of ``steps`` trainer steps at this layout."""
    lay = Layout(tp, dp, micro_batch, sequence_parallel=sp, fused_attention=False, threads=1)
    label = f"h{w.hidden} tp{tp} dp{dp}{' sp' if sp else ''} mb{micro_batch}"
    print(f"calibrate: trainer run {label} ({steps} steps) ...", file=sys.stderr, flush=True)
    window = 4 if steps >= 8 else 2
    _, parts = run_pretrain(Point(label, w, lay), steps=steps, log_every=window, timeout=600)
    return label, parts, predict(w, lay, cluster).breakdown


def fit_tp(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(seconds per collective, fraction of compute) from (lost, collectives, compute) per
    micro-batch: lost = collectives·a + f·compute, solved exactly for two runs; with one
    run, or where the solution has a negative part, all of it is put on the collectives
    (never below zero)."""
    if len(samples) == 2:
        (l1, n1, c1), (l2, n2, c2) = samples
        det = n1 * c2 - n2 * c1
        if det:
            a, f = (l1 * c2 - l2 * c1) / det, (n1 * l2 - n2 * l1) / det
            if a >= 0 and f >= 0:
                return a, f
    # a run faster than its price (noise on a busy machine) costs nothing, not less
    return max(0.0, sum(lost / n for lost, n, _ in samples) / len(samples)), 0.0


def measure(w: Any, hiddens: list[int], spec: dict, quick: bool, steps: int | None = None) -> dict:
    """Run the trainer at the calibration layouts; return ``compute_scale`` and the
    ``in_model`` tables. ``spec`` is the cluster measured so far (its α-β and bandwidths
    price what the runs are compared with); ``steps`` per run (default STEPS, QUICK_STEPS
    when ``quick``)."""
    w = replace(w, global_batch=16)
    bare = cluster_from_dict({k: v for k, v in spec.items() if k != "in_model"})
    scale, runs, opt = {}, [], {}
    steps = steps or (QUICK_STEPS if quick else STEPS)

    def optimizer(ranks: int, parts: dict, priced: dict) -> None:
        extra = max(0.0, parts["optimizer_s"] - priced["optimizer_s"])
        opt.setdefault(ranks, []).append(extra * 1e6 / parameter_tensors(w.layers))

    for h in hiddens:  # one rank: the trainer's compute over the priced ops
        label, parts, priced = _run(
            replace(w, hidden=h), 1, 1, False, MICRO_BATCHES[-1], bare, steps
        )
        scale[h] = round(parts["compute_s"] / priced["compute_s"], 4)
        runs.append({"run": label, **{k: round(v, 5) for k, v in parts.items()}})
        optimizer(1, parts, priced)
    cluster = replace(bare, compute_scale=scale)
    tp_rows, dp_rows = [], []
    for tp, dp, sp in QUICK_RUNS if quick else RUNS:
        shapes = [(min(hiddens), MICRO_BATCHES[0]), (max(hiddens), MICRO_BATCHES[-1])]
        samples = []
        for h, mb in shapes if tp > 1 and not quick else shapes[-1:]:
            wh = replace(w, hidden=h)
            label, parts, priced = _run(wh, tp, dp, sp, mb, cluster, steps)
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
            a, f = fit_tp(samples)
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
