"""Search the layouts of a model on a cluster: rank those that fit, explain those that do not."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from studies.perfmodel.cluster_spec import ClusterSpec
from studies.perfmodel.memory_model import DP_SHARD
from studies.perfmodel.model import Layout, Prediction, Workload, layout_problems, predict


@dataclass
class Candidate:
    """A layout that divides and fits, with its prediction and why it ranks where it does."""

    layout: Layout
    prediction: Prediction
    reason: str


@dataclass
class Rejected:
    """A pp × tp × dp split (or one DP sharding mode of it) that cannot run, and why."""

    tp: int
    dp: int
    reason: str
    pp: int = 1
    dp_shard: str | None = None  # None: the whole split


@dataclass
class SearchResult:
    """Feasible layouts, fastest first, and the rejected splits and modes."""

    feasible: list[Candidate]
    rejected: list[Rejected]


# Bounds on the work of a search, checked before any layout is priced: the divisors of the
# global batch (the micro-batches tried) are enumerated up to its square root, and pricing
# a layout takes ~0.2 ms, so 10**5 layouts are ~20 s.
MAX_GLOBAL_BATCH = 1 << 24  # sequences; ~10**3 times the largest published batches
MAX_LAYOUTS = 100_000


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` >= 1, ascending, found in O(sqrt(n)) steps."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return tuple(small + [n // k for k in reversed(small) if k * k != n])


def _pipelines(pp: int, layers: int, only: dict) -> list[tuple[str, int]]:
    """(schedule, virtual stages) tried at ``pp`` stages: 1F1B (GPipe holds more for the
    same bubble, so only when asked) and interleaved 1F1B at every chunk count that divides
    the stage's layers (more chunks: a smaller bubble, more hand-offs)."""
    if pp == 1:
        return [("1f1b", 1)]
    chunks = [v for v in divisors(layers // pp) if v >= 2]
    chunks = list(only.get("virtual_stages", chunks))
    schedules = only.get("schedule", ("1f1b", "interleaved_1f1b"))
    return [(s, v) for s in schedules for v in (chunks if s == "interleaved_1f1b" else [1])]


def _axes(
    pp: int, tp: int, dp: int, fixed_micro: int | None, w: Workload, base: Layout, only: dict
) -> tuple[list, ...]:
    """The values tried within one split: micro-batches, recomputes, sequence parallelism,
    DP sharding modes, (schedule, virtual stages)."""
    micros = [fixed_micro] if fixed_micro else divisors(max(1, w.global_batch // dp))
    sps = only.get("sequence_parallel", (False, True) if tp > 1 else (False,))
    # at dp 1 there is nothing to shard over: every mode is "none"
    shards = [z for z in only.get("dp_shard", DP_SHARD) if dp * base.cp > 1 or z == "none"]
    recomputes = only.get(
        "recompute", ("none", "full") if base.fused_attention else ("none", "selective", "full")
    )
    return list(micros), list(recomputes), list(sps), shards, _pipelines(pp, w.layers, only)


def _options(
    pp: int, tp: int, dp: int, fixed_micro: int | None, w: Workload, base: Layout, only: dict
) -> list[Layout]:
    return [
        replace(
            base,
            pp=pp,
            tp=tp,
            dp=dp,
            micro_batch=mb,
            recompute=rc,
            sequence_parallel=sp,
            dp_shard=z,
            schedule=sched,
            virtual_stages=v,
        )
        for mb, rc, sp, z, (sched, v) in itertools.product(
            *_axes(pp, tp, dp, fixed_micro, w, base, only)
        )
    ]


def _why_fast(p: Prediction) -> str:
    b = p.breakdown
    step = p.step_time_s
    parts = [f"compute {100 * b['compute_s'] / step:.0f}%"]
    if b["tp_comm_s"]:
        parts.append(f"TP comm {100 * b['tp_comm_s'] / step:.0f}%")
    if b.get("cp_comm_total_s"):
        parts.append(f"CP exposed {100 * b['cp_comm_exposed_s'] / step:.0f}%")
    if b.get("ep_a2a_s"):
        parts.append(f"EP all-to-all {100 * b['ep_a2a_s'] / step:.0f}%")
    if b["pp_bubble_s"] or b["pp_p2p_s"]:
        parts.append(f"PP bubble {100 * b['pp_bubble_s'] / step:.0f}%")
        parts.append(f"p2p {100 * b['pp_p2p_s'] / step:.0f}%")
    if b["dp_comm_total_s"]:
        parts.append(f"DP exposed {100 * b['dp_comm_exposed_s'] / step:.0f}%")
    parts.append(f"optimizer {100 * b['optimizer_s'] / step:.0f}%")
    return ", ".join(parts)


def _no_fit_reason(options: list[tuple[Layout, Prediction]], limit_gib: float) -> str:
    lay, p = min(options, key=lambda o: o[1].memory_gib_per_gpu)
    terms = p.memory.as_dict() if p.memory else {}
    worst = max(terms, key=terms.get) if terms else "?"
    return (
        f"does not fit: needs >= {p.memory_gib_per_gpu:.1f} GiB > {limit_gib:.1f} GiB even at "
        f"micro_batch={lay.micro_batch}, recompute={lay.recompute}, "
        f"sp={lay.sequence_parallel}; largest term {worst} {terms.get(worst, 0.0):.1f} GiB"
    )


def _split_problems(w: Workload, probe: Layout, gpus: int) -> list[str]:
    """What stops a split whatever its micro-batch and options."""
    problems = [
        p
        for p in layout_problems(w, probe, gpus)
        if "micro_batch" not in p and "micro-batches" not in p
    ]
    if w.global_batch % probe.dp:
        problems.append(f"global_batch={w.global_batch} is not divisible by dp={probe.dp}")
    return problems


def _splits(w: Workload, gpus: int, base: Layout, micro_batch: int | None, only: dict):
    """(pp, tp, dp, what stops it) of every pp × tp × dp (× ``base.cp``) = ``gpus`` split
    searched."""
    cp = base.cp
    for pp in only.get("pp", divisors(gpus)):
        if gpus % (pp * cp) or pp > w.layers:
            continue
        for tp in divisors(gpus // (pp * cp)):
            dp = gpus // (pp * cp * tp)
            probe = replace(base, pp=pp, tp=tp, dp=dp, micro_batch=micro_batch or 1)
            yield pp, tp, dp, _split_problems(w, probe, gpus)


def _price_split(
    w: Workload,
    cluster: ClusterSpec,
    options: list[Layout],
    limit: float,
    split: tuple[int, int, int],
) -> tuple[list[Candidate], list[Rejected]]:
    """The fitting layouts of one split, and one rejection per DP sharding mode with none."""
    pp, tp, dp = split
    feasible, rejected = [], []
    for mode in dict.fromkeys(lay.dp_shard for lay in options):
        priced = [(lay, predict(w, lay, cluster)) for lay in options if lay.dp_shard == mode]
        fits = [(lay, p) for lay, p in priced if p.memory_gib_per_gpu <= limit]
        if not fits:
            rejected.append(Rejected(tp, dp, _no_fit_reason(priced, limit), pp, mode))
        for lay, p in fits:
            reason = f"fits {p.memory_gib_per_gpu:.1f}/{limit:.0f} GiB; {_why_fast(p)}"
            feasible.append(Candidate(lay, p, reason))
    return feasible, rejected


def _bounded_splits(w, gpus, base, micro_batch, only, max_layouts: int) -> list[tuple]:
    """The pp × tp × dp splits of ``gpus`` (with their problems), once the work of pricing
    them is known to stay under ``max_layouts``: a ValueError saying so before any is
    priced."""
    if w.global_batch > MAX_GLOBAL_BATCH:
        raise ValueError(
            f"global_batch={w.global_batch} must be <= {MAX_GLOBAL_BATCH} (2**24) sequences"
        )
    splits = list(_splits(w, gpus, base, micro_batch, only))
    work = sum(
        math.prod(len(axis) for axis in _axes(pp, tp, dp, micro_batch, w, base, only))
        for pp, tp, dp, problems in splits
        if not problems
    )
    if work > max_layouts:
        raise ValueError(
            f"the search would price {work:,} layouts, more than {max_layouts:,} (~20 s): "
            "narrow it with --micro-batch, --pp, --dp-shard or --schedule"
        )
    return splits


def search(
    w: Workload,
    cluster: ClusterSpec,
    gpus: int,
    *,
    memory_gib: float | None = None,
    micro_batch: int | None = None,
    base: Layout | None = None,
    only: dict[str, tuple] | None = None,
    max_layouts: int = MAX_LAYOUTS,
) -> SearchResult:
    """Every pp × tp × dp = ``gpus`` split: the fitting layouts ranked by tokens/s, the rest
    explained (a split that does not divide once; a DP sharding mode that fits nowhere in a
    split once).

    Within a split, micro-batch, recompute, sequence parallelism, the DP sharding mode and
    (pp > 1) the schedule are varied (selective recompute only with unfused attention: a
    fused kernel already stores no scores); ``base`` carries the options not searched
    (overlap, fused attention); ``only`` restricts the searched ones (e.g.
    ``{"recompute": ("full",)}``, ``{"pp": (1,)}``, ``{"dp_shard": ("optimizer",)}``).

    The work is bounded up front: a global batch above ``MAX_GLOBAL_BATCH``, or more than
    ``max_layouts`` layouts to price, is a ValueError saying so before any is priced.
    """
    only = only or {}
    limit = memory_gib if memory_gib is not None else cluster.memory_bytes / 2**30
    base = base or Layout(tp=1, dp=1, micro_batch=1)
    splits = _bounded_splits(w, gpus, base, micro_batch, only, max_layouts)
    feasible: list[Candidate] = []
    rejected: list[Rejected] = []
    for pp, tp, dp, problems in splits:
        if problems:
            rejected.append(Rejected(tp, dp, "does not divide: " + "; ".join(problems), pp))
            continue
        options = [
            lay
            for lay in _options(pp, tp, dp, micro_batch, w, base, only)
            if not layout_problems(w, lay, gpus)
        ]
        if not options:
            reason = "does not divide: no micro-batch gives enough micro-batches per stage"
            if dp == 1 and "none" not in only.get("dp_shard", ("none",)):
                reason = "dp=1: no DP axis to shard over (dp_shard none only)"
            rejected.append(Rejected(tp, dp, reason, pp))
            continue
        fits, no = _price_split(w, cluster, options, limit, (pp, tp, dp))
        feasible += fits
        rejected += no
    feasible.sort(key=lambda c: (-c.prediction.tokens_per_s, c.prediction.memory_gib_per_gpu))
    return SearchResult(feasible, rejected)


def best_per_split(result: SearchResult) -> list[Candidate]:
    """The fastest feasible layout of each pp × tp × dp split, fastest first."""
    seen: dict[tuple[int, int, int], Candidate] = {}
    for cand in result.feasible:
        seen.setdefault((cand.layout.pp, cand.layout.tp, cand.layout.dp), cand)
    return list(seen.values())
