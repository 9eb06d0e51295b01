"""The target side of layout equivalence through the pipeline: the model cut into
``pp × virtual`` stages and trained by its schedule (``layouts.compare_layouts`` compares
what this yields with the unsplit reference).

Each DP rank's slice is cut into ``spec.microbatches`` micro-batches; the loss is their
mean (the last stage's, broadcast), the gradients are DP-averaged, the tied embedding's
copies summed, and every gradient is gathered to full shape over TP and the stages.
``mutate_runner(runner)`` may plant a fault in the hand-off between stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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


def pipeline_steps(
    spec,
    target: ParallelModel,
    local: dict[str, torch.Tensor],
    ps: ParallelState,
    mutate_runner: Callable[[PipelineRunner], None] | None = None,
) -> Iterator[tuple[float, dict[str, torch.Tensor] | None]]:
    """Per optimizer step of ``target`` on this DP rank's slice ``local``: (the mean loss
    over DP, every full gradient on the first step else None), before the update."""
    runner = pipeline_target(spec, target, ps)
    if mutate_runner is not None:
        mutate_runner(runner)
    stages = runner.model
    grad_sync = GradSync(stages.parameters(), dp_group=ps.dp_group, tp_group=ps.tp_group)
    optimizer = torch.optim.AdamW(stages.parameters(), lr=spec.lr)
    chunks = {key: value.chunk(spec.microbatches) for key, value in local.items()}
    micro = [{key: value[j] for key, value in chunks.items()} for j in range(spec.microbatches)]
    for step in range(spec.steps):
        with grad_sync.no_sync():
            loss = runner.train(micro)
        grad_sync.finish()
        stages.sum_tied_grads()
        grads = stages.full_grad_dict() if step == 0 else None  # over TP and the stages
        yield comm.mean(loss, ps.dp_group, ps.device), grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    grad_sync.remove()
