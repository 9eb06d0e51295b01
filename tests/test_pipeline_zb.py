"""The zero-bubble schedules (interleaved zero bubble, ZB-V, DualPipeV) against the
unsplit model, and their rules.

Each splits every backward into the input gradient (sent upstream at once) and the weight
gradient (run later, to fill the bubble): two ``autograd.grad`` calls over the graph one
``backward`` walks at 1F1B, so the weight gradients are the same sums, taken in another
order. float64, 1e-10 relative (the verifier's float64 tolerance), as tests/test_pipeline.py
argues: reordered sums stay near 1e-15 while a lost weight gradient or a stage run twice
shows as O(1).
"""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.test_pipeline import _check, _compare, _pp, two_chunk_eval

ZB_SPECS = {
    "zero_bubble": _pp("zero_bubble"),  # one stage per rank: the paper's ZB-H1
    "zbv": _pp("zbv", virtual_stages=2),
    "dualpipev": _pp("dualpipev", virtual_stages=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(ZB_SPECS))
def test_pp2_zero_bubble_schedules_match_unsplit(schedule):
    """GPT at pp 2 (tied embeddings: under a V rank 0 holds the first and the last stage,
    both reading the one word embedding): outputs, hand-offs, loss and every gradient."""
    _check(run_ranks(_compare, 2, [ZB_SPECS[schedule]], timeout=120)[0])


def _zero1_losses() -> list[tuple]:
    """ZeRO-1 under the split backward: torch's weight pass assigns ``.grad`` (no hook
    fires), so ZeRO-1's ``finish_grads`` must collect it. Its gradients live in the
    buckets, so the AdamW steps' losses show it (step 1 was 1.6e-2 off before)."""
    spec = _pp("zbv", model="llama", virtual_stages=2, dp_shard="optimizer", steps=2)
    return _compare([spec])


@pytest.mark.slow
def test_zero1_takes_the_weight_pass_gradients():
    _check(run_ranks(_zero1_losses, 2, timeout=120)[0])


@pytest.mark.slow
def test_v_placement_and_evaluation():
    """Rank r holds stages r and 2·pp − 1 − r; the loss (computed on rank 0, where the last
    stage is) reaches both ranks; fp64, sums in another order: 1e-12 relative."""
    (ids0, got0, want), (ids1, got1, _) = run_ranks(two_chunk_eval, 2, "zbv", timeout=120)
    assert (ids0, ids1) == ([0, 3], [1, 2])
    assert got0 == got1 and abs(got0 - want) <= 1e-12 * abs(want), (got0, want)


@pytest.mark.parametrize(
    "changes, line",
    [
        (
            {"pipeline.schedule": "dualpipev", "pipeline.virtual_stages": 2},
            "pipeline.schedule=dualpipev needs at least 2 × pp_size=2 = 4 micro-batches per step, "
            "got 2 (global_batch ÷ (micro_batch × dp_size)); change trainer.global_batch",
        ),
        (
            {"pipeline.schedule": "zbv"},
            "pipeline.virtual_stages=1 must be 2 for zbv (its V: stages r and 2·pp−1−r on rank r)",
        ),
        (
            {"pipeline.schedule": "zero_bubble", "trainer.global_batch": 12},
            "pipeline.schedule=zero_bubble needs micro-batches per step (3) divisible by pp_size=2",
        ),
        (
            {"pipeline.schedule": "zero_bubble", "parallel.dp_shard": "full"},
            "pipeline.schedule=zero_bubble under parallel.dp_shard=full is not built yet",
        ),
        (
            {
                "pipeline.schedule": "zbv",
                "pipeline.virtual_stages": 2,
                "parallel.dp_shard": "gradients",
            },
            "pipeline.schedule=zbv with tied embeddings under parallel.dp_shard=gradients is not",
        ),
    ],
)
def test_zero_bubble_config_errors_are_one_line(changes, line):
    """Refused before any worker starts, one line each (global batch 8 ÷ micro-batch 4 = 2
    micro-batches per step unless changed)."""
    from tests.test_pipeline import assert_refused_in_one_line

    assert_refused_in_one_line(changes, line)


def test_bubble_formulas_match_the_papers_fractions():
    """With equal forward, input-gradient and weight-gradient times (the zero-bubble paper's
    assumption, its published table): 1F1B (p−1)/m; ZB-H1 (``zero_bubble`` at one stage per
    rank) one third of it, (p−1)/(3m). ZB-V: the paper counts 0; the planner counts the
    warm-up no order avoids, the first forward's trip to the last rank, (p−1) chunk
    forwards of f/2: (p−1)·(1/2) over m·3, i.e. (p−1)/(6m)."""
    from studies.perfmodel.pipeline import bubble_fraction

    for p, m in ((2, 4), (4, 8), (4, 16), (8, 32)):
        assert bubble_fraction(p, m, "1f1b") == pytest.approx((p - 1) / m)
        assert bubble_fraction(p, m, "zero_bubble") == pytest.approx((p - 1) / (3 * m))
        assert bubble_fraction(p, m, "zero_bubble") == pytest.approx(
            bubble_fraction(p, m, "1f1b") / 3
        )
        assert bubble_fraction(p, m, "zbv", 2) == pytest.approx((p - 1) * 0.5 / (3 * m))
        assert bubble_fraction(p, m, "dualpipev", 2) == pytest.approx((p - 1) / (6 * m))
    # by hand, p = 2, m = 4, f = b = w = 1: ZB-H1 idles one unit (f + b − w) of 12
    assert bubble_fraction(2, 4, "zero_bubble") == pytest.approx(1 / 12)
    # a cheap weight pass (w = 0.2) leaves more to fill: f + b − w = 1.8 of 2.2 per m
    assert bubble_fraction(2, 4, "zero_bubble", w=0.2) == pytest.approx(1.8 / (4 * 2.2))


def _torch_order(schedule: str, pp: int, m: int, v: int) -> dict[int, list]:
    """torch's compute actions per rank for ``schedule`` (its private order builders, run
    without stages: the order is arithmetic on pp, m and v)."""
    import types

    from torch.distributed.pipelining import schedules as S

    if schedule == "zero_bubble":
        z = object.__new__(S.ScheduleInterleavedZeroBubble)
        z.pp_group_size, z._n_microbatches, z.n_local_stages = pp, m, v
        z.number_of_rounds = max(1, m // pp)
        z.microbatches_per_round = m // z.number_of_rounds
        z.pipeline_order = {r: z._calculate_single_rank_operations(r) for r in range(pp)}
        order = z._add_bubbles_to_actions(v * pp)
    else:
        cls = {"zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}[schedule]
        fake = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        order = {r: cls._calculate_single_rank_operations(fake, r) for r in range(pp)}
    flat = {}
    for r, actions in order.items():
        flat[r] = []
        for a in actions:
            if a is not None:
                flat[r] += list(a.sub_actions) if a.sub_actions else [a]  # DualPipeV's F&B
    return flat


def _simulated_bubble(order: dict[int, list], cost: dict[str, float]) -> float:
    """Idle over busy time of ``order`` run with ``cost`` per action kind (F, I, W and the
    full backward B), no transfer time: each action starts when its rank is free and what
    it reads is done (a forward the previous stage's, a backward the next stage's or, on
    the last stage, its own forward; a weight pass its input gradient)."""
    last = max(a.stage_index for actions in order.values() for a in actions)
    done, free, at = {}, dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    moved = True
    while moved:
        moved = False
        for r, actions in order.items():
            while at[r] < len(actions):
                a = actions[at[r]]
                kind, s, mb = a.computation_type.value, a.stage_index, a.microbatch_index
                if kind == "F":
                    needs = [("F", s - 1, mb)] if s > 0 else []
                elif kind in ("I", "B"):
                    needs = [("F", s, mb)] if s == last else [("I", s + 1, mb)]
                else:
                    needs = [("I", s, mb)]
                if any(n not in done for n in needs):
                    break
                free[r] = max([free[r]] + [done[n] for n in needs]) + cost[kind]
                done[("I" if kind == "B" else kind, s, mb)] = free[r]
                at[r], moved = at[r] + 1, True
    assert all(at[r] == len(order[r]) for r in order), "the order did not finish"
    busy = sum(cost[a.computation_type.value] for a in order[0])
    return (max(free.values()) - busy) / busy


@pytest.mark.parametrize(
    "times", [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 1, 0.2), (1, 1.2, 0.8)]
)
def test_bubble_formulas_match_torchs_orders(times):
    """The planner's formulas against torch's own orders run with unit costs (a stage's
    forward f, input gradient b, weight gradient w; a chunk of c per rank costs 1/c of
    them): exact at pp 2 for every cost mix, and at pp 4 with equal costs. At pp 4 with
    uneven costs torch's V orders idle more than the formula in some mixes (up to 1/3 more
    for ZB-V with w = 2, DualPipeV with b = 2): the planner's number is a floor there."""
    from studies.perfmodel.pipeline import bubble_fraction

    f, b, w = times
    cases = [(2, 8, times)] + ([(4, 16, times)] if times == (1, 1, 1) else [])
    for pp, m, _ in cases:
        for schedule, v in (("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)):
            cost = {"F": f / v, "I": b / v, "W": w / v, "B": (b + w) / v}
            got = _simulated_bubble(_torch_order(schedule, pp, m, v), cost)
            want = bubble_fraction(pp, m, schedule, v, f=f, b=b, w=w)
            assert got == pytest.approx(want), (schedule, pp, m, v, times)
