"""Search the layouts of a model on a cluster: rank those that fit, explain those that do not."""

from __future__ import annotations

from dataclasses import dataclass, replace

from studies.perfmodel.cluster_spec import ClusterSpec
from studies.perfmodel.model import Layout, Prediction, Workload, layout_problems, predict


@dataclass
class Candidate:
    """A layout that divides and fits, with its prediction and why it ranks where it does."""

    layout: Layout
    prediction: Prediction
    reason: str


@dataclass
class Rejected:
    """A tp × dp split that cannot run, and why."""

    tp: int
    dp: int
    reason: str


@dataclass
class SearchResult:
    """Feasible layouts, fastest first, and the rejected tp × dp splits."""

    feasible: list[Candidate]
    rejected: list[Rejected]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _options(
    tp: int, dp: int, fixed_micro: int | None, w: Workload, base: Layout, only: dict
) -> list[Layout]:
    micros = [fixed_micro] if fixed_micro else _divisors(max(1, w.global_batch // dp))
    sps = only.get("sequence_parallel", (False, True) if tp > 1 else (False,))
    zeros = only.get("zero1", (False, True) if dp > 1 else (False,))
    recomputes = only.get(
        "recompute", ("none", "full") if base.fused_attention else ("none", "selective", "full")
    )
    return [
        replace(base, tp=tp, dp=dp, micro_batch=mb, recompute=rc, sequence_parallel=sp, zero1=z)
        for mb in micros
        for rc in recomputes
        for sp in sps
        for z in zeros
    ]


def _why_fast(p: Prediction) -> str:
    b = p.breakdown
    step = p.step_time_s
    parts = [f"compute {100 * b['compute_s'] / step:.0f}%"]
    if b["tp_comm_s"]:
        parts.append(f"TP comm {100 * b['tp_comm_s'] / step:.0f}%")
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
        f"sp={lay.sequence_parallel}, zero1={lay.zero1}; largest term {worst} "
        f"{terms.get(worst, 0.0):.1f} GiB"
    )


def search(
    w: Workload,
    cluster: ClusterSpec,
    gpus: int,
    *,
    memory_gib: float | None = None,
    micro_batch: int | None = None,
    base: Layout | None = None,
    only: dict[str, tuple] | None = None,
) -> SearchResult:
    """Every tp × dp = ``gpus`` split: the fitting layouts ranked by tokens/s, the rest explained.

    Within a split, micro-batch, recompute, sequence parallelism and ZeRO-1 are varied
    (selective recompute only with unfused attention: a fused kernel already stores no scores);
    ``base`` carries the options not searched (overlap, fused attention); ``only`` restricts
    the searched ones (e.g. ``{"recompute": ("full",)}``).
    """
    limit = memory_gib if memory_gib is not None else cluster.memory_bytes / 2**30
    base = base or Layout(tp=1, dp=1, micro_batch=1)
    feasible: list[Candidate] = []
    rejected: list[Rejected] = []
    for tp in _divisors(gpus):
        dp = gpus // tp
        probe = replace(base, tp=tp, dp=dp, micro_batch=micro_batch or 1)
        problems = [p for p in layout_problems(w, probe, gpus) if "micro_batch" not in p]
        if w.global_batch % dp:
            problems.append(f"global_batch={w.global_batch} is not divisible by dp={dp}")
        if problems:
            rejected.append(Rejected(tp, dp, "does not divide: " + "; ".join(problems)))
            continue
        options = [
            lay
            for lay in _options(tp, dp, micro_batch, w, base, only or {})
            if not layout_problems(w, lay, gpus)
        ]
        if not options:
            rejected.append(Rejected(tp, dp, f"does not divide: micro_batch={micro_batch}"))
            continue
        priced = [(lay, predict(w, lay, cluster)) for lay in options]
        fits = [(lay, p) for lay, p in priced if p.memory_gib_per_gpu <= limit]
        if not fits:
            rejected.append(Rejected(tp, dp, _no_fit_reason(priced, limit)))
            continue
        for lay, p in fits:
            reason = f"fits {p.memory_gib_per_gpu:.1f}/{limit:.0f} GiB; {_why_fast(p)}"
            feasible.append(Candidate(lay, p, reason))
    feasible.sort(key=lambda c: (-c.prediction.tokens_per_s, c.prediction.memory_gib_per_gpu))
    return SearchResult(feasible, rejected)


def best_per_split(result: SearchResult) -> list[Candidate]:
    """The fastest feasible layout of each tp × dp split, fastest first."""
    seen: dict[tuple[int, int], Candidate] = {}
    for cand in result.feasible:
        seen.setdefault((cand.layout.tp, cand.layout.dp), cand)
    return list(seen.values())
