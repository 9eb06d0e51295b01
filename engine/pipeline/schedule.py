"""Running micro-batches through this rank's stages with a ``torch.distributed.pipelining``
schedule: GPipe, 1F1B, interleaved 1F1B, or one of the zero-bubble family (interleaved
zero bubble, ZB-V, DualPipeV), which split each backward into the input gradient, sent
upstream at once, and the weight gradient, run later to fill the bubble (torch's
``stage_backward_input`` / ``stage_backward_weight``). The point-to-point traffic between
stages is torch's, over the pipeline group.

The schedule's micro-batches are the step's gradient accumulation: each micro-batch's
loss is divided by their count before its backward (``scale_grads=False``: torch would
rescale ``.grad`` afterwards, which ZeRO-1 has already moved into its buckets), exactly
as the unpipelined loop does, so the gradients are the mean over micro-batches.

Under context parallelism (cp_size > 1) each micro-batch is cut to this cp rank's share
of every sequence before the schedule splits it (``model.context_shard``, as the local
runner cuts it: the load-balanced chunks r and 2·cp−1−r, labels alike) and the tokens'
global positions travel as a keyword input of every stage: the first stage embeds at them,
every stage's RoPE rotates at them, and each stage's attention is a ring over its cp
group. The last stage's loss is the mean over this rank's s/cp tokens; the trainer's
average over the ``loss`` role and the DP reduction's over ``grad`` (both dp × cp) make
it the whole sequence's, as at pp 1.

:class:`PipelineRunner` is also the trainer's step runner for pp_size > 1 (the
``engine.runner.StepRunner`` interface): besides the schedule it adds the stages' share to
the gradient norm, sums the tied embedding's gradient after the DP reduction, times the
bubble and declines the closing sample (generation runs unpipelined).

A model with MoE layers trains on its loss plus every router's losses, as at pp 1
(``engine.runner.local``), pooled per layer: each stage's chunk attaches its own layers'
losses to its output (``stages.attach_router_loss``), whose backward gives them the
micro-batch loss's factor, so the routers of every stage get their gradients, not only
the last stage's, and the objective is the local runner's. Each chunk's forward hands its
routers' statistics to ``moe_window`` (its close gathers every stage's layers over the
pipeline group for the console's moe line), and ``router_loss`` is the step mean of the
router losses, summed over the stages.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT

from engine import comm
from engine.data_parallel import DataParallel
from engine.models import ParallelModel
from engine.models.base import to_device
from engine.moe_observe import MoEWindow, router_layers
from engine.pipeline.stages import PipelineModel
from layers.router import TopKRouter, router_objective
from parallel_state import ParallelState

Autocast = Callable[[], contextlib.AbstractContextManager]
SCHEDULES = {  # the names of split.SCHEDULES
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE = ("gpipe", "1f1b")  # the schedules that take one stage, not a list


def pipeline_runner(
    model: ParallelModel, cfg, ps: ParallelState, *, autocast: Autocast = contextlib.nullcontext
) -> PipelineRunner:
    """The runner of a training config (``cfg.pipeline``) for the built ``model``: its
    micro-batches per step are the gradient accumulation steps."""
    t, p = cfg.trainer, cfg.pipeline
    stages = PipelineModel(
        model,
        pp_rank=ps.rank_in("pp"),
        pp_size=ps.size("pp"),
        pp_group=ps.group("pp"),
        virtual=p.virtual_stages,
        schedule=p.schedule,
        layers_per_stage=list(p.layers_per_stage) or None,
        embedding_group=ps.group("embedding"),
    )
    microbatches = t.global_batch // (t.micro_batch * ps.size("batch"))
    return PipelineRunner(
        stages,
        schedule=p.schedule,
        microbatches=microbatches,
        ps=ps,
        timed=t.step_timing,
        autocast=autocast,
    )


def _v_forwards(stages: list, microbatches: int, loss_fn: Callable) -> ScheduleZBVZeroBubble:
    """A forward-only schedule over V-placed stages (evaluation): ZB-V's order, its
    backward actions doing nothing. torch's forward-only run of a V schedule hands the
    second stage's (absent) input gradient to the first and fails; the forwards alone keep
    ZB-V's deadlock-free order, as nothing else waits."""
    schedule = ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    for kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):
        schedule.register_custom_function(kind, lambda action, ctx: None)
    return schedule


class PipelineRunner:
    """This rank's stages of ``model`` under the schedule ``schedule`` with ``microbatches``
    micro-batches per step; evaluation runs a forward-only GPipe schedule. ``stages`` are
    the training schedule's ``PipelineStage``s (the verifier watches their hand-offs).
    ``autocast()`` wraps the trainer's steps and evaluations (:meth:`forward_backward`,
    :meth:`fixed_set_loss`)."""

    sample_refusal = "no sample: generation runs unpipelined (pp_size=1)"

    def __init__(
        self,
        model: PipelineModel,
        *,
        schedule: str,
        microbatches: int,
        ps: ParallelState,
        timed: bool = False,
        autocast: Autocast = contextlib.nullcontext,
    ) -> None:
        self.model, self.ps, self.name, self.autocast = model, ps, schedule, autocast
        self.microbatches = microbatches
        self._factor = 1.0  # what each micro-batch's loss is multiplied by before backward
        self.has_experts = model.cfg.mlp == "moe"  # on every stage, so all take part in logs
        self.router_loss = torch.zeros((), device=ps.device)  # the last step's, detached
        self._router_sum, self._micros = torch.zeros((), device=ps.device), 1
        self.moe_window = (
            MoEWindow(model, ps.device, pp_group=ps.group("pp")) if self.has_experts else None
        )
        self._train, self.stages = self._build(schedule, microbatches, timed=timed, record=True)
        self._eval: dict[int, object] = {}  # forward-only schedules by micro-batch count
        self.compute_s = self.wall_s = 0.0  # the last training step's (timed=True)

    def _build(
        self, name: str, microbatches: int, *, timed: bool = False, record: bool = False
    ) -> tuple:
        """A schedule of ``microbatches`` over this rank's stages, and its PipelineStages;
        ``record``: each forward's router statistics go to ``moe_window`` (training)."""
        stages = [
            PipelineStage(
                chunk, index, self.model.num_stages, self.ps.device, group=self.ps.group("pp")
            )
            for index, chunk in zip(self.model.stage_ids, self.model.chunks, strict=True)
        ]
        for stage in stages:  # the shape inference of a schedule's first step (torch 2.13)
            stage._prepare_forward_infra = self._keeping_rng(stage._prepare_forward_infra)
            stage._prepare_backward_infra = self._keeping_rng(stage._prepare_backward_infra)
        for stage in stages if record and self.has_experts else ():
            stage.forward_one_chunk = self._recording(stage.forward_one_chunk, stage.submod)
        for stage in stages if timed else ():
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk)
            stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk)
        loss_fn: Callable = self._timed(self._loss) if timed else self._loss
        if name == "gpipe" and self.model.v_shape:  # evaluation of V-placed stages
            return _v_forwards(stages, microbatches, loss_fn), stages
        # evaluation of loop-placed stages: GPipe over every chunk
        cls = ScheduleLoopedBFS if name == "gpipe" and len(stages) > 1 else SCHEDULES[name]
        chunks = stages[0] if name in SINGLE_STAGE and len(stages) == 1 else stages
        return cls(chunks, microbatches, loss_fn=loss_fn, scale_grads=False), stages

    def _keeping_rng(self, method: Callable) -> Callable:
        """``method`` (a stage's metadata inference) leaving every random stream as it
        found it. The first step of a schedule runs each stage's forward (and backward) once
        on empty tensors to learn the shapes it sends; torch restores the default generator
        around that, and this restores the RNG tracker's named streams too, whose dropout
        draws would otherwise shift every later mask: a run resumed from a checkpoint (whose
        first step infers again) would then draw other masks than the run it continues."""
        tracker = self.ps.rng

        def run(*args, **kwargs):
            states = tracker.get_states()
            try:
                return method(*args, **kwargs)
            finally:
                tracker.set_states(states)

        return run

    def _recording(self, forward: Callable, chunk: torch.nn.Module) -> Callable:
        """``forward`` (a stage's forward of one micro-batch) handing its routers' losses
        to ``moe_window`` and their weighted sum (× 1 / micro-batches) to the step's
        router loss. The shape inference's forward does not pass here."""
        numbers = dict(zip(self._routers(self.model), router_layers(self.model), strict=True))
        routers = self._routers(chunk)

        def run(*args, **kwargs):
            out = forward(*args, **kwargs)
            losses = [one.last_losses for one in routers]
            if losses:
                self.moe_window.add(losses, [numbers[one] for one in routers])
                with torch.no_grad():
                    self._router_sum += (router_objective(losses) / self._micros).float()
            return out

        return run

    @staticmethod
    def _routers(module: torch.nn.Module) -> list[TopKRouter]:
        return [m for m in module.modules() if isinstance(m, TopKRouter)]

    def _now(self) -> float:
        if self.ps.device.type == "cuda":  # kernels run asynchronously: wait for them
            torch.cuda.synchronize(self.ps.device)
        return time.perf_counter()

    def _timed(self, method: Callable) -> Callable:
        """``method`` (a stage's forward, backward or loss of one micro-batch) adding its
        time to ``compute_s``: what the step spends outside these waits on other stages."""

        def run(*args, **kwargs):
            start = self._now()
            try:
                return method(*args, **kwargs)
            finally:
                self.compute_s += self._now() - start

        return run

    def timings(self) -> dict[str, float]:
        """The last step's stage compute, the time waiting on the other stages (the bubble
        and the hand-offs), and the wait over compute, to compare with (p − 1)/m."""
        wait = max(0.0, self.wall_s - self.compute_s)
        return {
            "pp_compute_s": self.compute_s,
            "pp_wait_s": wait,
            "pp_bubble_ratio": wait / self.compute_s if self.compute_s > 0 else 0.0,
        }

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model.micro_loss(logits, labels) * self._factor

    def train(self, micro_batches: list, loss_scale: float = 1.0) -> float:
        """Forward and backward of the step's micro-batches; the mean micro-batch loss, on
        every stage (the last stage's, broadcast over the pipeline group)."""
        self._factor = self.model.router_loss_scale = loss_scale / len(micro_batches)
        self._router_sum = torch.zeros((), device=self.ps.device)
        self._micros = len(micro_batches)
        self.compute_s, start = 0.0, self._now()
        total = self._run(self._train, micro_batches, forward_only=False)
        self.wall_s = self._now() - start
        if self.has_experts:  # every stage's routers: the sum over the pipeline group
            device = comm.collective_device(self.ps.group("pp"), self.ps.device)
            summed = comm.sum_(self._router_sum.to(device), self.ps.group("pp"))
            self.router_loss = summed.to(self.ps.device)
            self.moe_window.end_step(self.ps.group("loss"))  # sigmoid routers' biases move
        return total / loss_scale

    def eval_loss_sum(self, micro_batches: list, counted: int | None = None) -> float:
        """The sum of the first ``counted`` (default: all) micro-batches' losses (no
        backward), on every stage."""
        self._factor = 1.0
        count = len(micro_batches)
        if count not in self._eval:
            self._eval[count] = self._build("gpipe", count)[0]
        return self._run(self._eval[count], micro_batches, forward_only=True, counted=counted)

    def forward_backward(
        self, micro_batches: list, dp: DataParallel, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """:meth:`train` as the trainer's step: the schedule's micro-batches are the
        accumulation, so the DP reduction waits for :meth:`DataParallel.finish_grads`."""
        with dp.no_sync(), self.autocast():
            loss = self.train(micro_batches, loss_scale=loss_scale)
        return torch.tensor(loss, dtype=torch.float32, device=self.ps.device)

    @torch.no_grad()
    def fixed_set_loss(self, valid, batches: int) -> float:
        """``engine.runner.fixed_set_loss`` through the stages: the mean loss over
        micro-batches ``0 .. batches - 1`` of ``valid`` (j on batch rank j mod its size).

        Every batch rank runs the same number of micro-batches, ⌈batches / size⌉: under
        FSDP each stage's forward gathers its parameters over the grad group, so a rank
        past the last micro-batch runs one again and drops its loss (as the local runner
        does); with fewer forwards on some ranks the others waited forever."""
        size = self.ps.size("batch")
        rounds = range(self.ps.rank_in("batch"), -(-batches // size) * size, size)
        micro = []
        for j in rounds:
            valid.consumed_samples = (j % batches) * valid.global_batch
            micro += valid.next_step()  # one micro-batch
        self.model.eval()
        with self.autocast():
            total = self.eval_loss_sum(micro, counted=sum(j < batches for j in rounds))
        self.model.train()
        return comm.mean(total, self.ps.group("loss"), self.ps.device) * size / batches

    def _run(
        self, schedule, micro_batches: list, *, forward_only: bool, counted: int | None = None
    ) -> float:
        cp_size, cp_rank = self.ps.size("cp"), self.ps.rank_in("cp")
        if cp_size > 1:  # this cp rank's share of every sequence, at its global positions
            micro_batches = [
                self.model.context_shard(to_device(m, self.ps.device), cp_size, cp_rank)
                for m in micro_batches
            ]
        args, kwargs, target = self.model.schedule_inputs(micro_batches, self.ps.device)
        args = args if self.model.is_first else ()  # the others receive their inputs
        losses: list[torch.Tensor] = []
        if forward_only:
            schedule.eval(*args, target=target, losses=losses, **kwargs)
        else:
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        losses = losses[:counted]  # micro-batch order: the repeats come last
        total = torch.stack(losses).detach().double().sum().item() if losses else 0.0
        return comm.broadcast_object(total, self.ps.group("pp"), src=self.model.last_rank)

    def global_norm(self, stage_norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every stage from this stage's (TP- and DP-aware) one."""
        squared = stage_norm.double() ** 2
        device = comm.collective_device(self.ps.group("pp"), self.ps.device)
        total = comm.sum_(squared.to(device), self.ps.group("pp"))
        return total.sqrt().to(stage_norm.device)

    def post_reduction(self, dp) -> list[tuple[str, str, Callable[[], None]]]:
        """After the DP reduction: the tied embedding's gradient summed over the first and
        last stage (``PipelineModel.sum_tied_grads``)."""
        tied = functools.partial(self.model.sum_tied_grads, dp.reduced_grad)
        return [("tied embedding gradient sum", "pp", tied)]

    def waits_on(self) -> tuple[str, str]:
        stage = ", ".join(str(s) for s in self.model.stage_ids)
        return f"pipeline schedule (stage {stage})", "pp"

    def console_note(self) -> str:
        cp = self.ps.size("cp")
        ring = f" cp={cp} (ring attention)" if cp > 1 else ""
        return f" pp={self.ps.size('pp')} ({self.name}, {self.model.num_stages} stages){ring}"
