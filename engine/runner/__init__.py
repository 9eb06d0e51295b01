"""Step runners: how one training step runs its micro-batches on this rank.

The trainer holds one :class:`StepRunner`, chosen once by :func:`build_step_runner`, and
never asks which it is. Two implement it today:

- :class:`LocalRunner` (``local.py``, here): the whole model on this rank, micro-batches
  in turn (pp_size=1);
- :class:`engine.pipeline.PipelineRunner` (``engine/pipeline/schedule.py``, beside the
  stages it schedules): this rank's stages under a ``torch.distributed.pipelining``
  schedule.

This package holds the interface, the choice and the local runner; the pipeline's runner
stays in the pipeline package, which knows nothing of this one (the interface is a
Protocol: it matches by shape). The next way to run a step (a context-parallel loss mean,
an auxiliary MoE loss) is a runner here, not a branch in the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from engine.data.loader import DataIterator
from engine.data_parallel import DataParallel
from engine.runner.local import Autocast, LocalRunner, fixed_set_loss
from parallel_state import ParallelState

__all__ = [
    "AUTOCAST_DTYPES",
    "Autocast",
    "LocalRunner",
    "StepRunner",
    "autocast_for",
    "build_step_runner",
    "fixed_set_loss",
]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no autocast

# A step's work between the DP reduction and the gradient norm: what the watchdog is told
# this rank does, the role or axis whose group it waits on, and the call.
Hook = tuple[str, str, Callable[[], None]]


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward's autocast for a resolved ``precision`` (none for fp32)."""
    if precision not in AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])


class StepRunner(Protocol):
    """What the trainer asks of a step: run it, evaluate, and complete its gradients."""

    model: nn.Module  # what this rank trains: the DP strategy wraps it, checkpoints save it
    sample_refusal: str | None  # the line said instead of a closing sample (None: it samples)

    def forward_backward(
        self, micro_batches: list, dp: DataParallel, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (gradients accumulated, the DP
        reduction launched by the end); their mean loss, detached, on every rank."""
        ...

    def fixed_set_loss(self, valid: DataIterator, batches: int) -> float:
        """The mean loss over micro-batches ``0 .. batches - 1`` of ``valid``, on every rank."""
        ...

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The whole model's gradient norm from the DP strategy's ``norm`` of this rank's."""
        ...

    def post_reduction(self, dp: DataParallel) -> list[Hook]:
        """What completes the gradients after ``dp``'s reduction, in order."""
        ...

    def timings(self) -> dict[str, float]:
        """The last step's extra time metrics (read when step timing is on)."""
        ...

    def waits_on(self) -> tuple[str, str]:
        """What the forward/backward does, for the watchdog, and the group it waits on."""
        ...

    def console_note(self) -> str:
        """What the run's first console line adds after ``dp=N`` ("" for nothing)."""
        ...


def build_step_runner(
    model: nn.Module, cfg, ps: ParallelState, *, autocast: Autocast
) -> StepRunner:
    """The runner for ``model`` (built whole) under ``cfg`` on this rank: the pipeline's
    when the mesh has stages, else the local one. ``autocast()`` wraps every forward."""
    if ps.size("pp") > 1:
        # imported here: torch.distributed.pipelining brings in dynamo and FSDP, ~2 s of
        # CPU in every rank process, which only a pipelined run needs
        from engine.pipeline import pipeline_runner

        return pipeline_runner(model, cfg, ps, autocast=autocast)
    return LocalRunner(model, ps, autocast)
