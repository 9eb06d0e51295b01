"""Pipeline parallelism: the stage split, and the pipelined model against the unsplit one.

float64 proves the math: the stages run the same operations as the unsplit model, only the
sums over micro-batches, the DP average and the tied embedding's two copies are grouped
differently (~1e-16 per op; observed below 1e-14), so 1e-10 (the verifier's float64
tolerance) leaves room while a real bug (a micro-batch paired with another's labels, a
gradient lost between stages) shows as O(1).
"""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.slow
def test_pp2_with_tp_dp_sp_and_llama_match_unsplit():
    specs = [
        _pp("1f1b", tp_size=2),
        _pp("1f1b", tp_size=2, sequence_parallel=True, recompute="full"),
        _pp("1f1b", dp_size=2, batch_size=8),
        _pp("interleaved_1f1b", model="llama", tp_size=2, virtual_stages=2),
    ]
    _check(run_ranks(_compare, 4, specs, timeout=600)[0])


def _delay_labels(runner) -> None:
    """Planted: the last stage scores each micro-batch against the previous one's labels."""
    inner, previous = runner.model.micro_loss, []

    def shifted(logits, labels):
        previous.append(labels)
        return inner(logits, previous[-2] if len(previous) > 1 else labels)

    runner.model.micro_loss = shifted


def _drop_input_grad(runner) -> None:
    """Planted: stage 1 sends a zero gradient back to stage 0."""
    for chunk, stage in zip(runner.model.chunks, runner.model.stage_ids, strict=True):
        if stage > 0:
            chunk.register_forward_pre_hook(
                lambda _, args: args[0].register_hook(torch.zeros_like) and None
            )


def _planted(name: str) -> tuple:
    bug = {"order": _delay_labels, "dropped": _drop_input_grad}[name]
    parallel_state.initialize(ParallelDims(1, 1, 2))
    report = compare_layouts(_pp(), mutate_runner=bug)
    parallel_state.destroy()
    return report and (report.first_failure.kind, report.first_failure.name)


@pytest.mark.parametrize(
    "bug, kind, where", [("order", "loss", "loss (step 0)"), ("dropped", "grad", "layers.1.")]
)
def test_planted_handoff_bugs_are_caught(bug, kind, where):
    got_kind, got_name = run_ranks(_planted, 2, bug, timeout=300)[0]
    assert got_kind == kind and got_name.startswith(where), (got_kind, got_name)
