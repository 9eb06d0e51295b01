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
import torch

import parallel_state
from engine.models import build_model
from engine.pipeline import PipelineModel, PipelineRunner
from parallel_state.dims import ParallelDims
from studies.verification.layouts import make_batch, solo_group
from tests.multiproc import run_ranks
from tests.test_pipeline import _check, _compare, _pp

ZB_SPECS = {
    "zero_bubble": _pp("zero_bubble"),  # one stage per rank: the paper's ZB-H1
    "zbv": _pp("zbv", virtual_stages=2),
    "dualpipev": _pp("dualpipev", virtual_stages=2),
}


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


def test_zero1_takes_the_weight_pass_gradients():
    _check(run_ranks(_zero1_losses, 2, timeout=120)[0])


def _v_eval() -> tuple[float, float]:
    """Evaluation through V-placed stages (ZB-V's forwards, forward-only), 3 micro-batches:
    the pipeline's loss sum and the unsplit model's."""
    ps = parallel_state.initialize(ParallelDims(1, 1, 2))
    spec = _pp("zbv", virtual_stages=2, batch_size=6)
    models = []
    for tp_group in (ps.tp_group, solo_group(ps)):  # the same seed: the same weights
        ps.seed(spec.seed)
        models.append(build_model(spec.model_config(), tp_group=tp_group, dtype=torch.float64))
    stages = PipelineModel(
        models[0], pp_rank=ps.pp_rank, pp_size=2, pp_group=ps.pp_group, virtual=2, schedule="zbv"
    )
    runner = PipelineRunner(stages, schedule="zbv", microbatches=4, ps=ps)
    batch = make_batch(spec)
    micro = [{k: v.chunk(3)[j] for k, v in batch.items()} for j in range(3)]
    with torch.no_grad():
        got = runner.eval_loss_sum(micro)
        want = sum(models[1].loss(m).item() for m in micro)
    parallel_state.destroy()
    return stages.stage_ids, got, want


def test_v_placement_and_evaluation():
    """Rank r holds stages r and 2·pp − 1 − r; the loss (computed on rank 0, where the last
    stage is) reaches both ranks; fp64, sums in another order: 1e-12 relative."""
    (ids0, got0, want), (ids1, got1, _) = run_ranks(_v_eval, 2, timeout=120)
    assert (ids0, ids1) == ([0, 3], [1, 2])
    assert got0 == got1 and abs(got0 - want) <= 1e-12 * abs(want), (got0, want)


@pytest.mark.parametrize(
    "changes, line",
    [
        (
            {"pipeline.schedule": "dualpipev", "pipeline.virtual_stages": 2},
            "pipeline.schedule=dualpipev needs at least 2 × pp_size=4 micro-batches per step, "
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
    from engine.config import Config, parallel_dims, validate

    cfg = Config(tp_size=1, dp_size=1, pp_size=2)
    cfg.model.num_layers, cfg.trainer.global_batch, cfg.trainer.micro_batch = 4, 8, 4
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    problems = validate(cfg, parallel_dims(cfg, None))
    assert any(line in p for p in problems), problems
    assert all("\n" not in p for p in problems)
