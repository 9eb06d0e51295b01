"""Layout equivalence through the pipeline: the target cut into ``pp × virtual`` stages and
run by its schedule, against the unsplit reference (``layouts.compare_layouts`` calls this).

Each DP rank's slice is cut into ``spec.microbatches`` micro-batches; the loss is their
mean (the last stage's, broadcast), the gradients are DP-averaged, the tied embedding's
copies summed, and every gradient is gathered to full shape over TP and the stages.
``mutate_runner(runner)`` may plant a fault in the hand-off between stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import comm
from engine.data_parallel import GradSync
from engine.models import ParallelModel
from engine.pipeline import PipelineModel, PipelineRunner
from parallel_state import ParallelState


def pipeline_target(spec, model: ParallelModel, ps: ParallelState) -> PipelineRunner:
    """This rank's stages of ``model`` under ``spec``'s schedule."""
    stages = PipelineModel(
        model,
        pp_rank=ps.pp_rank,
        pp_size=ps.pp_size,
        pp_group=ps.pp_group,
        virtual=spec.virtual_stages,
        embedding_group=ps.embedding_group,
    )
    return PipelineRunner(stages, schedule=spec.schedule, microbatches=spec.microbatches, ps=ps)


def train_and_compare_pipeline(
    spec,
    target: ParallelModel,
    reference: ParallelModel | None,
    batch: dict[str, torch.Tensor],
    ps: ParallelState,
    mutate_runner: Callable[[PipelineRunner], None] | None = None,
) -> list:
    """Rows of the loss (every step) and of every gradient (the first step), on rank 0."""
    from studies.verification.layouts import _grad_rows, compare, dp_slice

    runner = pipeline_target(spec, target, ps)
    if mutate_runner is not None:
        mutate_runner(runner)
    stages, tol, rows = runner.model, spec.tolerance, []
    grad_sync = GradSync(stages.parameters(), dp_group=ps.dp_group, tp_group=ps.tp_group)
    models = [m for m in (stages, reference) if m is not None]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=spec.lr) for m in models]
    local = dp_slice(batch, ps)
    micro = [
        {"input_ids": ids, "labels": labels}
        for ids, labels in zip(
            local["input_ids"].chunk(spec.microbatches),
            local["labels"].chunk(spec.microbatches),
            strict=True,
        )
    ]
    for step in range(spec.steps):
        with grad_sync.no_sync():
            loss = runner.train(micro)
        grad_sync.finish()
        stages.sum_tied_grads()
        loss = comm.mean(loss, ps.dp_group, ps.device)
        if reference is not None:
            ref_loss = reference.loss(batch)
            ref_loss.backward()
            rows.append(
                compare(
                    "loss",
                    f"loss (step {step})",
                    torch.tensor(loss, dtype=torch.float64),
                    ref_loss,
                    tol,
                )
            )
        if step == 0:
            rows += _grad_rows(stages, reference, tol)  # collective over TP and the stages
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    grad_sync.remove()
    return rows
