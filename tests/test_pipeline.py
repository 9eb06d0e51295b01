"""Pipeline parallelism: the stage split, and the pipelined model against the unsplit one.

float64 proves the math: the stages run the same operations as the unsplit model, only the
sums over micro-batches, the DP average and the tied embedding's two copies are grouped
differently (~1e-16 per op; observed below 1e-14), so 1e-10 (the verifier's float64
tolerance) leaves room while a real bug (a micro-batch paired with another's labels, a
gradient lost between stages) shows as O(1).
"""

from __future__ import annotations

import pytest

import parallel_state
from engine.pipeline import layer_split
from parallel_state.dims import ParallelDims
from studies.verification.layouts import VerifySpec, compare_layouts
from tests.multiproc import run_ranks


def test_layer_split_even_and_explicit():
    assert layer_split(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert layer_split(5, 2, [2, 3]) == [range(0, 2), range(2, 5)]
    with pytest.raises(ValueError, match="not divisible by the 3 pipeline stages"):
        layer_split(4, 3)
    with pytest.raises(ValueError, match="must have 2 entries"):
        layer_split(4, 2, [1, 1, 2])


def _compare(specs: list[VerifySpec]) -> list[tuple]:
    out = []
    for spec in specs:
        dims = ParallelDims(spec.tp_size, spec.dp_size, spec.pp_size)
        parallel_state.initialize(dims)
        report = compare_layouts(spec)
        parallel_state.destroy()
        if report is not None:
            failure = report.first_failure
            worst = max(r.max_rel for r in report.rows)
            out.append((spec, len(report.rows), worst, failure and (failure.kind, failure.name)))
    return out


def _pp(schedule="1f1b", **kw) -> VerifySpec:
    base = dict(pp_size=2, num_layers=4, batch_size=4, microbatches=4, schedule=schedule)
    return VerifySpec(**(base | kw))


def _check(results):
    for spec, rows, worst, failure in results:
        print(
            f"{spec.model} pp={spec.pp_size} tp={spec.tp_size} dp={spec.dp_size} "
            f"{spec.schedule} v={spec.virtual_stages}: {rows} rows, max rel {worst:.2e}"
        )
        assert failure is None, (spec, failure)
        assert rows > 10  # the loss and every parameter's gradient were compared


def test_pp2_schedules_match_unsplit_gpt():
    specs = [_pp("gpipe"), _pp("1f1b"), _pp("interleaved_1f1b", virtual_stages=2)]
    _check(run_ranks(_compare, 2, specs, timeout=300)[0])
