"""Pipeline parallelism: the stage split, and the pipelined model against the unsplit one.

float64 proves the math: the stages run the same operations as the unsplit model, only the
sums over micro-batches, the DP average and the tied embedding's two copies are grouped
differently (~1e-16 per op; observed below 2e-15), so 1e-10 (the verifier's float64
tolerance) leaves room while a real bug (a micro-batch paired with another's labels, a
gradient lost between stages) shows as O(1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import parallel_state
from engine.models import build_model
from engine.pipeline import PipelineModel, PipelineRunner, layer_split
from parallel_state.dims import ParallelDims
from studies.verification.layouts import VerifySpec, compare_layouts, make_batch, solo_group
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


def two_chunk_eval(schedule: str) -> tuple[list[int], float, float]:
    """Evaluation through two stages per rank under ``schedule`` (a forward-only run over
    both chunks of each rank), 3 micro-batches: this rank's stage ids, the pipeline's loss
    sum and the unsplit model's."""
    ps = parallel_state.initialize(ParallelDims(1, 1, 2))
    spec = _pp(schedule, virtual_stages=2, batch_size=6)
    models = []
    for tp_group in (ps.tp_group, solo_group(ps)):  # the same seed: the same weights
        ps.seed(spec.seed)
        models.append(build_model(spec.model_config(), tp_group=tp_group, dtype=torch.float64))
    stages = PipelineModel(
        models[0], pp_rank=ps.pp_rank, pp_size=2, pp_group=ps.pp_group, virtual=2, schedule=schedule
    )
    runner = PipelineRunner(stages, schedule=schedule, microbatches=4, ps=ps)
    batch = make_batch(spec)
    micro = [{k: v.chunk(3)[j] for k, v in batch.items()} for j in range(3)]
    with torch.no_grad():
        got = runner.eval_loss_sum(micro)
        want = sum(models[1].loss(m).item() for m in micro)
    parallel_state.destroy()
    return stages.stage_ids, got, want


def _fast(specs: list[VerifySpec]) -> tuple:
    return _compare(specs), two_chunk_eval("interleaved_1f1b")[1:]


@pytest.mark.slow
def test_pp2_schedules_match_unsplit_gpt_and_bert():
    """BERT: token types on stage 0, the MLM and sentence-order heads and the tied word
    embedding on stage 1, the padding mask given to both (the batch pads its rows, so a
    stage without it diverges). Evaluation through interleaved stages too."""
    specs = [_pp("gpipe"), _pp("1f1b"), _pp("interleaved_1f1b", virtual_stages=2)]
    specs.append(_pp("1f1b", model="bert", microbatches=2))
    results, (got, want) = run_ranks(_fast, 2, specs, timeout=300)[0]
    _check(results)
    assert abs(got - want) <= 1e-10 * abs(want), (got, want)


@pytest.mark.slow
def test_pp2_with_tp_dp_sp_and_llama_match_unsplit():
    """Also the sharded DP modes under a pipeline: FSDP2 on each stage chunk (ZeRO-3 for
    GPT, whose tied embedding copy is sharded on the last stage alike; ZeRO-2 for BERT),
    driven by torch's schedule."""
    specs = [
        _pp("1f1b", tp_size=2),
        _pp("1f1b", dp_size=2, batch_size=8),
        _pp("interleaved_1f1b", model="llama", tp_size=2, virtual_stages=2),
        _pp("1f1b", dp_size=2, batch_size=8, dp_shard="full"),
        _pp("1f1b", model="bert", dp_size=2, batch_size=8, microbatches=2, dp_shard="gradients"),
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


def _corrupt_stage_output(runner) -> None:
    """Planted: stage 0 sends its output off by one part in a million."""
    for chunk, stage in zip(runner.model.chunks, runner.model.stage_ids, strict=True):
        if stage == 0:
            chunk.register_forward_hook(lambda _, args, out: out * (1 + 1e-6))


def _planted(names: list[str]) -> list[tuple]:
    found = []
    bugs = {"order": _delay_labels, "dropped": _drop_input_grad, "sent": _corrupt_stage_output}
    for name in names:
        bug = bugs[name]
        parallel_state.initialize(ParallelDims(1, 1, 2))
        report = compare_layouts(_pp(), mutate_runner=bug)
        parallel_state.destroy()
        found.append(report and (report.first_failure.kind, report.first_failure.name))
    return found


@pytest.mark.slow
def test_planted_handoff_bugs_are_caught():
    """A wrong micro-batch order shows first in the loss; a gradient dropped between the
    stages in the last parameter of stage 0 (layers.1, in backward order); a corrupted
    stage output in what stage 0 sent, named by its last module and the first micro-batch
    (every module's own output before it still agrees)."""
    bugs = ["order", "dropped", "sent"]
    order, dropped, sent = run_ranks(_planted, 2, bugs, timeout=300)[0]
    assert order == ("loss", "loss (step 0)"), order
    assert dropped[0] == "grad" and dropped[1].startswith("layers.1."), dropped
    assert sent == ("stage out", "layers.1 (stage 0), micro-batch 0"), sent


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"model.num_layers": 3}, "model.num_layers=3 is not divisible by the 2 pipeline stages"),
        ({"pipeline.layers_per_stage": [1, 2]}, "pipeline.layers_per_stage=[1, 2] must have 2"),
        ({"trainer.global_batch": 4}, "needs at least pp_size=2 micro-batches per step, got"),
        ({"pipeline.schedule": "zb"}, "pipeline.schedule='zb' is not one of gpipe, 1f1b"),
        ({"pipeline.schedule": "interleaved_1f1b"}, "virtual_stages=1 must be >= 2 for inter"),
        ({"pipeline.virtual_stages": 2}, "pipeline.virtual_stages=2 must be 1 for 1f1b"),
    ],
)
def test_pipeline_config_errors_are_one_line(changes, line):
    assert_refused_in_one_line(changes, line)


def assert_refused_in_one_line(changes: dict, line: str) -> None:
    """pp 2 over 4 layers, global batch 8 of micro-batches of 4, with ``changes``
    ({"section.key": value}): the config check names ``line``, one line per problem."""
    from engine.config import Config, parallel_dims, validate

    cfg = Config(tp_size=1, dp_size=1, pp_size=2)
    cfg.model.num_layers, cfg.trainer.global_batch, cfg.trainer.micro_batch = 4, 8, 4
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    problems = validate(cfg, parallel_dims(cfg, None))
    assert any(line in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_valid_pipeline_configs_pass():
    from engine.config import Config, parallel_dims, validate

    cfg = Config(tp_size=1, dp_size=1, pp_size=2)
    cfg.model.num_layers = 4
    cfg.pipeline.schedule, cfg.pipeline.virtual_stages = "interleaved_1f1b", 2
    assert validate(cfg, parallel_dims(cfg, None)) == []  # 16 ÷ 4 = 4 micro-batches
    cfg.pipeline.schedule, cfg.pipeline.virtual_stages = "gpipe", 1
    cfg.pipeline.layers_per_stage = [3, 1]
    assert validate(cfg, parallel_dims(cfg, None)) == []


def _timed_step() -> dict:
    ps = parallel_state.initialize(ParallelDims(1, 1, 2))
    spec = _pp()
    ps.seed(spec.seed)
    model = build_model(spec.model_config(), ps, dtype=torch.float64)
    stages = PipelineModel(model, pp_rank=ps.pp_rank, pp_size=2, pp_group=ps.pp_group)
    runner = PipelineRunner(stages, schedule="1f1b", microbatches=4, ps=ps, timed=True)
    batch = make_batch(spec)
    micro = [
        {"input_ids": i, "labels": j}
        for i, j in zip(batch["input_ids"].chunk(4), batch["labels"].chunk(4), strict=True)
    ]
    runner.train(micro)
    out = runner.timings() | {"wall_s": runner.wall_s}
    parallel_state.destroy()
    return out


@pytest.mark.slow
def test_step_timing_splits_the_step_into_compute_and_wait():
    """Behaviour, not speed: both parts are measured and add up to the step's wall time."""
    for t in run_ranks(_timed_step, 2, timeout=300):
        assert t["pp_compute_s"] > 0 and t["pp_wait_s"] >= 0, t
        torch.testing.assert_close(t["pp_compute_s"] + t["pp_wait_s"], t["wall_s"])
        assert t["pp_bubble_ratio"] == t["pp_wait_s"] / t["pp_compute_s"]


def _first_and_later_step_draws() -> tuple[list[float], bool]:
    """The same step (same weights, batch and random states) run as a schedule's first
    step, which infers the stage shapes by running the stages once, and again as a later
    step: its losses, and whether it left the random streams in the same state."""
    ps = parallel_state.initialize(ParallelDims(1, 1, 2))
    spec = _pp()
    ps.seed(spec.seed)
    cfg = dataclasses.replace(spec.model_config(), hidden_dropout=0.2, attention_dropout=0.2)
    model = build_model(cfg, ps, dtype=torch.float64)
    stages = PipelineModel(model, pp_rank=ps.pp_rank, pp_size=2, pp_group=ps.pp_group)
    runner = PipelineRunner(stages, schedule="1f1b", microbatches=4, ps=ps)
    batch = make_batch(spec)
    micro = [
        {"input_ids": i, "labels": j}
        for i, j in zip(batch["input_ids"].chunk(4), batch["labels"].chunk(4), strict=True)
    ]
    start, losses, after = ps.rng.get_states(), [], []
    for _ in range(2):
        ps.rng.set_states(start)
        losses.append(runner.train(micro))
        after.append(ps.rng.get_states())
    same = after[0].keys() == after[1].keys()
    same = same and all(torch.equal(after[0][k], after[1][k]) for k in after[0])
    parallel_state.destroy()
    return losses, same


@pytest.mark.slow
def test_shape_inference_draws_no_random_numbers():
    """With dropout, a schedule's first step draws the same masks as any later step from
    the same random state: the shape inference torch runs before it leaves the RNG
    tracker's streams alone. It did not (a run resumed from a checkpoint, whose first step
    infers again, drew other masks than the run it continued: step 3 loss 9.0223 against
    9.0227 at pp 2)."""
    for (first, later), same_states in run_ranks(_first_and_later_step_draws, 2, timeout=300):
        assert first == later, (first, later)  # bitwise: the same masks, the same sums
        assert same_states


def _pipelined_eval(dp_shard: str, batches: int) -> tuple[float, float]:
    """The pipelined fixed-set loss at pp 2 × dp 2 under ``dp_shard`` over ``batches``
    micro-batches (3: one batch rank gets two, the other one), and the unsplit model's
    mean loss over the same micro-batches."""
    from engine.config import OptimConfig
    from engine.data.loader import DataIterator
    from engine.data_parallel import build_data_parallel

    ps = parallel_state.initialize(ParallelDims(1, 2, 2, dp_shard=dp_shard))
    spec = _pp("1f1b", dp_size=2)
    models = []
    for tp_group in (ps.tp_group, solo_group(ps)):  # the same seed: the same weights
        ps.seed(spec.seed)
        model = build_model(spec.model_config(), tp_group=tp_group, rng=ps.rng, dtype=torch.float64)
        models.append(model)
    stages = PipelineModel(
        models[0],
        pp_rank=ps.pp_rank,
        pp_size=2,
        pp_group=ps.pp_group,
        embedding_group=ps.group("embedding"),
    )
    runner = PipelineRunner(stages, schedule="1f1b", microbatches=2, ps=ps)
    build_data_parallel(
        stages,
        OptimConfig(),
        grad_group=ps.group("grad"),
        tp_group=ps.tp_group,
        device=torch.device("cpu"),
        dp_shard=dp_shard,
    )
    gen = torch.Generator().manual_seed(7)
    windows = list(torch.randint(spec.vocab_size, (2 * batches, spec.seq_len + 1), generator=gen))
    valid = DataIterator(windows, global_batch=2, micro_batch=2, dp_rank=0, dp_size=1)
    got = runner.fixed_set_loss(valid, batches)
    with torch.no_grad():
        want = sum(
            models[1].loss(torch.stack(windows[2 * j : 2 * j + 2])).item() for j in range(batches)
        )
    parallel_state.destroy()
    return got, want / batches


@pytest.mark.slow
@pytest.mark.parametrize("dp_shard", ["none", "optimizer", "full"])
def test_pipelined_evaluation_runs_the_same_forwards_on_every_rank(dp_shard):
    """Issue 39: at pp 2 × dp 2 with FSDP, evaluation over a batch count that is no
    multiple of dp froze (a rank with fewer micro-batches skipped a forward whose parameter
    gathers the others waited in). Every DP mode now finishes, on every rank, with the
    unsplit model's mean loss (fp64: sums in another order, 1e-12 relative)."""
    results = run_ranks(_pipelined_eval, 4, dp_shard, 3, timeout=180)
    for got, want in results:
        assert abs(got - want) <= 1e-12 * abs(want), (dp_shard, got, want)
