"""Search the layouts of a model on a cluster: rank those that fit, explain those that do not."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from engine.formulas import whole_percentages
from engine.pipeline.split import V_SCHEDULES
from studies.perfmodel import comm_cost as comm
from studies.perfmodel.cluster_spec import ClusterSpec
from studies.perfmodel.memory_model import DP_SHARD
from studies.perfmodel.model import OFFLOAD, Layout, Prediction, Workload, layout_problems, predict


@dataclass
class Candidate:
    """A layout that divides and fits, with its prediction and why it ranks where it does."""

    layout: Layout
    prediction: Prediction
    reason: str


@dataclass
class Rejected:
    """A pp × tp × dp split (or one DP sharding mode, or one option, of it) that cannot run,
    and why."""

    tp: int
    dp: int
    reason: str
    pp: int = 1
    dp_shard: str | None = None  # None: the whole split
    option: str | None = None  # e.g. "schedule=zbv", "dp_replicate=2", "offload=optimizer"


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


# The schedules a search tries at pp > 1 (GPipe holds more for the same bubble as 1F1B, so
# only when asked).
SEARCHED_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


def _pipelines(pp: int, layers: int, only: dict) -> list[tuple[str, int]]:
    """(schedule, virtual stages) tried at ``pp`` stages: 1F1B, interleaved 1F1B at every
    chunk count that divides the stage's layers (more chunks: a smaller bubble, more
    hand-offs), zero bubble as ZB-H1 (one chunk; its interleaved form only at the chunk
    counts asked for, which keeps the options to chunks + 4), and the V schedules at the
    two chunks their V is (``engine.pipeline.split.virtual_rule``)."""
    if pp == 1:
        return [("1f1b", 1)]
    chunks = [v for v in divisors(layers // pp) if v >= 2]
    chunks = list(only.get("virtual_stages", chunks))
    per_schedule = {
        "interleaved_1f1b": chunks,
        "zero_bubble": list(only.get("virtual_stages", (1,))),
        **{s: [2] for s in V_SCHEDULES},
    }
    schedules = only.get("schedule", SEARCHED_SCHEDULES)
    return [(s, v) for s in schedules for v in per_schedule.get(s, [1])]


def _sharding(tp: int, dp: int, base: Layout, only: dict, gpus_per_node: int) -> list:
    """(dp_shard, dp_replicate) pairs tried: every mode unreplicated (at dp × cp 1 there is
    nothing to shard over: "none" only), and the FSDP modes (gradients, full: the runtime's
    HSDP modes) also with R = the nodes one DP group spans, so its shards stay inside a node
    and only the replicas' all-reduce crosses nodes (other R only when asked: R = nodes is
    the one that moves the gathers onto the fast link)."""
    d = dp * base.cp
    modes = [z for z in only.get("dp_shard", DP_SHARD) if d > 1 or z == "none"]
    spans = comm.place_groups(tp, d, gpus_per_node)[1].nodes
    replicas = dict.fromkeys(only.get("dp_replicate", (1, spans)))
    return [(z, r) for z in modes for r in replicas if r == 1 or z in ("gradients", "full")]


@dataclass(frozen=True)
class _Space:
    """What every split of one search shares: the model, the options not searched
    (``base``), the restrictions (``only``), a pinned micro-batch, the node size."""

    w: Workload
    base: Layout
    only: dict
    fixed_micro: int | None
    gpus_per_node: int

    @property
    def offloads(self) -> tuple[str, ...]:
        """The offload values allowed: "optimizer" is priced only for a sharded mode that
        fits nowhere without it (or when it is the only one asked for)."""
        return tuple(self.only.get("offload", OFFLOAD))


def _axes(pp: int, tp: int, dp: int, sp: _Space) -> tuple[list, ...]:
    """The values tried within one split: micro-batches, recomputes, sequence parallelism,
    (DP sharding mode, HSDP replicas), (schedule, virtual stages)."""
    w, only = sp.w, sp.only
    micros = [sp.fixed_micro] if sp.fixed_micro else divisors(max(1, w.global_batch // dp))
    sps = only.get("sequence_parallel", (False, True) if tp > 1 else (False,))
    recomputes = only.get(
        "recompute", ("none", "full") if sp.base.fused_attention else ("none", "selective", "full")
    )
    shards = _sharding(tp, dp, sp.base, only, sp.gpus_per_node)
    return list(micros), list(recomputes), list(sps), shards, _pipelines(pp, w.layers, only)


def _work(pp: int, tp: int, dp: int, sp: _Space) -> int:
    """Layouts one split may price: every option, and each sharded one again offloaded."""
    axes = _axes(pp, tp, dp, sp)
    sharded = sum(z != "none" for z, _ in axes[3]) if "optimizer" in sp.offloads else 0
    return math.prod(len(a) for a in axes) // max(1, len(axes[3])) * (len(axes[3]) + sharded)


def _options(pp: int, tp: int, dp: int, sp: _Space) -> list[Layout]:
    return [
        replace(
            sp.base,
            pp=pp,
            tp=tp,
            dp=dp,
            micro_batch=mb,
            recompute=rc,
            sequence_parallel=seq_par,
            dp_shard=z,
            dp_replicate=r,
            schedule=sched,
            virtual_stages=v,
            offload="none",
        )
        for mb, rc, seq_par, (z, r), (sched, v) in itertools.product(*_axes(pp, tp, dp, sp))
    ]


def _why_fast(p: Prediction) -> str:
    """The step's parts in whole percent, summing to 100 (the parts add up to the step)."""
    b = p.breakdown
    parts = {"compute": b["compute_s"]}
    if b["tp_comm_s"]:
        parts["TP comm"] = b["tp_comm_s"]
    if b.get("cp_comm_total_s"):
        parts["CP exposed"] = b["cp_comm_exposed_s"]
    if b.get("ep_a2a_s"):
        parts["EP all-to-all"] = b["ep_a2a_s"]
    if b["pp_bubble_s"] or b["pp_p2p_s"]:
        parts["PP bubble"], parts["p2p"] = b["pp_bubble_s"], b["pp_p2p_s"]
    if b["dp_comm_total_s"]:
        parts["DP exposed"] = b["dp_comm_exposed_s"]
    parts["optimizer"] = b["optimizer_s"]
    percents = whole_percentages(list(parts.values()))
    return ", ".join(f"{name} {pct}%" for name, pct in zip(parts, percents, strict=True))


def _no_fit_reason(options: list[tuple[Layout, Prediction]], limit_gib: float) -> str:
    lay, p = min(options, key=lambda o: o[1].memory_gib_per_gpu)
    terms = p.memory.as_dict() if p.memory else {}
    worst = max(terms, key=terms.get) if terms else "?"
    # Two decimals where one would print the two sides equal ("5.9 GiB > 5.9 GiB").
    digits = 1 if f"{p.memory_gib_per_gpu:.1f}" != f"{limit_gib:.1f}" else 2
    return (
        f"does not fit: needs >= {p.memory_gib_per_gpu:.{digits}f} GiB > "
        f"{limit_gib:.{digits}f} GiB even at "
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
            if tp not in only.get("tp", (tp,)):
                continue
            dp = gpus // (pp * cp * tp)
            probe = replace(base, pp=pp, tp=tp, dp=dp, micro_batch=micro_batch or 1)
            yield pp, tp, dp, _split_problems(w, probe, gpus)


def _fitting(
    w: Workload, cluster: ClusterSpec, group: list[Layout], limit: float, offloads: tuple
) -> tuple[list[tuple[Layout, Prediction]], list[tuple[str | None, str]]]:
    """The fitting layouts of one (DP sharding mode, replicas) group, and (option, reason)
    for each offload choice that fits nowhere: on the device first; offloaded only when
    nothing fits there (the offload's copies and CPU step only ever cost time)."""
    mode, misses = group[0].dp_shard, []
    sharded = mode != "none" and "optimizer" in offloads
    if "none" in offloads:
        priced = [(lay, predict(w, lay, cluster)) for lay in group]
        if fits := [(lay, p) for lay, p in priced if p.memory_gib_per_gpu <= limit]:
            return fits, misses
        why = _no_fit_reason(priced, limit)
        if mode == "none" and "optimizer" in offloads:
            why += " (offload=optimizer needs a sharded dp_shard)"
        misses.append(("offload=none" if sharded else None, why))
    if not sharded:
        if "none" not in offloads:
            misses.append((None, "offload=optimizer needs a sharded dp_shard"))
        return [], misses
    offloaded = [replace(lay, offload="optimizer") for lay in group]
    priced = [(lay, predict(w, lay, cluster)) for lay in offloaded]
    if fits := [(lay, p) for lay, p in priced if p.memory_gib_per_gpu <= limit]:
        return fits, misses
    why = _no_fit_reason(priced, limit).replace("does not fit", "does not fit even offloaded", 1)
    return [], misses + [("offload=optimizer", why)]


def _price_split(
    w: Workload,
    cluster: ClusterSpec,
    options: list[Layout],
    limit: float,
    split: tuple[int, int, int],
    offloads: tuple[str, ...] = OFFLOAD,
) -> tuple[list[Candidate], list[Rejected]]:
    """The fitting layouts of one split, and the rejections of each DP sharding mode (and
    HSDP replicas, and offload choice) with none."""
    pp, tp, dp = split
    feasible, rejected = [], []
    groups: dict[tuple[str, int], list[Layout]] = {}
    for lay in options:
        groups.setdefault((lay.dp_shard, lay.dp_replicate), []).append(lay)
    for (mode, r), group in groups.items():
        fits, misses = _fitting(w, cluster, group, limit, offloads)
        hsdp = f"dp_replicate={r}" if r > 1 else None
        for option, why in misses:
            option = " ".join(o for o in (hsdp, option) if o) or None
            rejected.append(Rejected(tp, dp, why, pp, mode, option))
        for lay, p in fits:
            reason = f"fits {p.memory_gib_per_gpu:.1f}/{limit:.3g} GiB; {_why_fast(p)}"
            feasible.append(Candidate(lay, p, reason))
    return feasible, rejected


def _option_label(name: str, lay: Layout) -> str | None:
    """How a rejection names the schedule or the HSDP replicas of ``lay`` (None: the
    default, which the split's own rejection covers)."""
    if name == "schedule":
        v = (
            f" v={lay.virtual_stages}"
            if lay.schedule in ("interleaved_1f1b", "zero_bubble")
            else ""
        )
        return f"schedule={lay.schedule}{v}" if lay.pp > 1 else None
    return f"dp_replicate={lay.dp_replicate}" if lay.dp_replicate > 1 else None


def _option_rejections(laid: list[tuple[Layout, list[str]]], split: tuple) -> list[Rejected]:
    """One rejection per schedule (or HSDP replicas) none of whose layouts divides, with the
    problems of the one that came closest (the runtime's rules, e.g. DualPipeV's 2·pp
    micro-batches)."""
    pp, tp, dp = split
    rejected = []
    for name in ("schedule", "dp_replicate"):
        groups: dict[str, list[list[str]]] = {}
        for lay, problems in laid:
            if label := _option_label(name, lay):
                groups.setdefault(label, []).append(problems)
        for label, problems in groups.items():
            if all(problems):
                why = "does not divide: " + "; ".join(min(problems, key=len))
                rejected.append(Rejected(tp, dp, why, pp, option=label))
    return rejected


def _bounded_splits(sp: _Space, gpus: int, max_layouts: int) -> list[tuple]:
    """The pp × tp × dp splits of ``gpus`` (with their problems), once the work of pricing
    them is known to stay under ``max_layouts`` (offloaded layouts counted as if every
    sharded one needed them): a ValueError saying so before any is priced."""
    w = sp.w
    if w.global_batch > MAX_GLOBAL_BATCH:
        raise ValueError(
            f"global_batch={w.global_batch} must be <= {MAX_GLOBAL_BATCH} (2**24) sequences"
        )
    splits = list(_splits(w, gpus, sp.base, sp.fixed_micro, sp.only))
    work = sum(_work(pp, tp, dp, sp) for pp, tp, dp, problems in splits if not problems)
    if work > max_layouts:
        raise ValueError(
            f"the search would price {work:,} layouts, more than {max_layouts:,} (~20 s): "
            "narrow it with --micro-batch, --pp, --dp-shard, --schedule or --offload"
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

    Within a split, micro-batch, recompute, sequence parallelism, the DP sharding mode,
    HSDP (``dp_replicate`` R = the nodes a DP group spans, gradients and full only), and
    (pp > 1) the schedule (1F1B, interleaved 1F1B, zero bubble, ZB-V, DualPipeV) are varied
    (selective recompute only with unfused attention: a fused kernel already stores no
    scores); a sharded mode that fits nowhere is priced again with ``offload=optimizer``.
    ``base`` carries the options not searched (overlap, fused attention); ``only``
    restricts the searched ones (e.g. ``{"recompute": ("full",)}``, ``{"pp": (1,)}``, ``{"tp": (8,)}``,
    ``{"dp_shard": ("optimizer",)}``, ``{"dp_replicate": (1,)}``, ``{"offload":
    ("none",)}``). A schedule or R that never divides is rejected with the runtime's rule.

    The work is bounded up front: a global batch above ``MAX_GLOBAL_BATCH``, or more than
    ``max_layouts`` layouts to price, is a ValueError saying so before any is priced.
    """
    only = only or {}
    limit = memory_gib if memory_gib is not None else cluster.rank_memory_bytes(gpus) / 2**30
    base = base or Layout(tp=1, dp=1, micro_batch=1)
    space = _Space(w, base, only, micro_batch, cluster.gpus_per_node)
    splits = _bounded_splits(space, gpus, max_layouts)
    feasible: list[Candidate] = []
    rejected: list[Rejected] = []
    for pp, tp, dp, problems in splits:
        if problems:
            rejected.append(Rejected(tp, dp, "does not divide: " + "; ".join(problems), pp))
            continue
        laid = [(lay, layout_problems(w, lay, gpus)) for lay in _options(pp, tp, dp, space)]
        options = [lay for lay, problems in laid if not problems]
        if not options:
            reason = "does not divide: no micro-batch gives enough micro-batches per stage"
            if dp == 1 and "none" not in only.get("dp_shard", ("none",)):
                reason = "dp=1: no DP axis to shard over (dp_shard none only)"
            rejected.append(Rejected(tp, dp, reason, pp))
            continue
        rejected += _option_rejections(laid, (pp, tp, dp))
        fits, no = _price_split(w, cluster, options, limit, (pp, tp, dp), space.offloads)
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
