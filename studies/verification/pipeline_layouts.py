"""The target side of layout equivalence through the pipeline: the model cut into
``pp × virtual`` stages and trained by its schedule, compared with the unsplit reference.

Each DP rank's slice is cut into ``spec.microbatches`` micro-batches (under cp the runner
gives each stage its cp rank's share of every sequence, at global positions); the loss is
their mean (the last stage's, broadcast, then averaged over the loss role: dp × cp), the
gradients are averaged over the grad role (dp × cp), the tied embedding's
copies summed, and every gradient is gathered to full shape over TP and the stages.
``mutate_runner(runner)`` may plant a fault in the hand-off between stages.

The forwards of the first step are watched (``StageCapture``): every module's output, and
at each stage boundary what the stage sent and what the next stage received, per
micro-batch. They are compared with the reference's output of the same module (for a
hand-off, the rows of the reference's batch that micro-batch holds), in model order, so
the first failing row names the module, the stage and the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch

from engine import comm
from engine.models import ParallelModel
from engine.models.base import ParallelLMHead
from engine.pipeline import PipelineModel, PipelineRunner
from layers.moe import moe_losses
from layers.router import TopKRouter, router_objective
from parallel_state import ParallelState
from studies.verification.dp_step import TargetStep
from studies.verification.outputs import OutputCapture, Row, compare, output_tp_dim

SENT, RECEIVED = "stage out", "stage in"  # the row kinds of a hand-off


def pipeline_target(spec, model: ParallelModel, ps: ParallelState) -> PipelineRunner:
    """This rank's stages of ``model`` under ``spec``'s schedule."""
    stages = PipelineModel(
        model,
        pp_rank=ps.pp_rank,
        pp_size=ps.pp_size,
        pp_group=ps.pp_group,
        virtual=spec.virtual_stages,
        schedule=spec.schedule,
        embedding_group=ps.embedding_group,
    )
    return PipelineRunner(stages, schedule=spec.schedule, microbatches=spec.microbatches, ps=ps)


class StageCapture(OutputCapture):
    """The outputs of this rank's stages in the forwards the schedule runs, per micro-batch:
    every module's, and per hand-off what a stage sends (its return value, after any hook)
    and what the next stage receives. Keys: module names; hand-offs are
    ``(kind, module, stage, micro-batch, reference module)``.

    Only ``forward_one_chunk`` counts: torch's shape inference and recomputation in
    backward run the modules too, on other inputs or again.
    """

    def __init__(self, runner: PipelineRunner) -> None:
        self.micro: int | None = None  # the micro-batch a stage is running forward
        self.per_micro: dict[str, dict[int, torch.Tensor]] = {}
        self.handoffs: dict[tuple, torch.Tensor] = {}
        self.layout: dict = {}  # key -> (TP dim of the output, vocabulary trim)
        super().__init__(runner.model)
        self.model, self.stages = runner.model, runner.stages
        self._forwards = [stage.forward_one_chunk for stage in self.stages]
        for stage, forward in zip(self.stages, self._forwards, strict=True):
            stage.forward_one_chunk = partial(self._forward, stage, forward)
            if not stage.is_first:
                hook = partial(self._received, stage.stage_index)
                self._handles.append(stage.submod.register_forward_pre_hook(hook))

    def _layout(self, name: str) -> tuple[int | None, int | None]:
        module = self.model.get_submodule(name)
        trim = self.model.cfg.vocab_size if isinstance(module, ParallelLMHead) else None
        return output_tp_dim(module), trim

    def _keep(self, name, trim, module, args, out) -> None:
        if self.micro is None or not isinstance(out, torch.Tensor):
            return
        self.per_micro.setdefault(name, {}).setdefault(self.micro, out.detach().clone())
        self.layout[name] = (output_tp_dim(module), trim)
        self.copies[name] = getattr(module, "copies", 1)  # KV heads held by several ranks

    def _forward(self, stage, forward, micro: int, *args, **kwargs):
        self.micro = micro
        try:
            out = forward(micro, *args, **kwargs)
        finally:
            self.micro = None
        split = self.model.split[stage.stage_index]
        outs = out if isinstance(out, tuple) else (out,)
        # The last stage returns the LM head's logits, then a sentence-order head's if any.
        last = ("lm_head", "sop_head")[: len(outs)]
        names = last if stage.is_last else (f"layers.{split[-1]}",)
        for name, tensor in zip(names, outs, strict=True):
            self._hand_off((SENT, name, stage.stage_index, micro, name), tensor, name)
        return out

    def _received(self, stage: int, module, args) -> None:
        if self.micro is None:  # torch's shape inference
            return
        first = self.model.split[stage][0]
        key = (RECEIVED, f"layers.{first}", stage, self.micro, f"layers.{first - 1}")
        self._hand_off(key, args[0], f"layers.{first}")  # its input: the same layout

    def _hand_off(self, key: tuple, tensor: torch.Tensor, layout_of: str) -> None:
        self.handoffs[key] = tensor.detach().clone()
        self.layout[key], self.copies[key] = self._layout(layout_of), 1

    def merged(self, ps: ParallelState) -> dict:
        """Every output at full shape (module outputs with their micro-batches joined in
        order: this DP rank's slice; cp shares put back in sequence order), from every stage
        (collective over TP, CP, DP and PP)."""
        for name, micros in self.per_micro.items():
            parts = [micros[j] for j in sorted(micros)]
            joined = torch.cat(parts, dim=1 if parts[0].dim() == 3 else 0)  # [s, b, …] / [b, …]
            self.outputs[name] = (joined, *self.layout[name])
        for key, tensor in self.handoffs.items():
            self.outputs[key] = (tensor, *self.layout[key])
        full = self.gathered(ps.tp_group, ps.dp_group, ps.group("cp"))
        merged: dict = {}
        for part in comm.all_gather_object(full, ps.pp_group):
            merged.update(part)
        return merged

    def remove(self) -> None:
        """Detach the hooks and give the stages their own forward back."""
        super().remove()
        for stage, forward in zip(self.stages, self._forwards, strict=True):
            stage.forward_one_chunk = forward


def micro_rows(spec, reference: torch.Tensor, micro: int) -> torch.Tensor:
    """The rows of the reference's whole-batch ``reference`` that micro-batch ``micro``
    holds, every DP rank's together (each rank's slice is contiguous, cut in order)."""
    per_rank = spec.batch_size // spec.dp_size
    size = per_rank // spec.microbatches
    rows = [d * per_rank + micro * size + r for d in range(spec.dp_size) for r in range(size)]
    dim = 1 if reference.dim() == 3 else 0
    return reference.index_select(dim, torch.tensor(rows))


def stage_output_rows(spec, got: dict, want: dict[str, torch.Tensor]) -> list[Row]:
    """In the reference's module order: each module's output, and after a stage's last
    module what the stage sent and the next one received, per micro-batch."""
    tol, rows = spec.tolerance, []
    handoffs = sorted((k for k in got if isinstance(k, tuple)), key=lambda k: (k[2], k[0], k[3]))
    for name, reference in want.items():
        if name in got:
            rows.append(compare("output", name, got[name], reference, tol))
        for key in (k for k in handoffs if k[4] == name):
            kind, module, stage, micro, _ = key
            label = f"{module} (stage {stage}), micro-batch {micro}"
            rows.append(compare(kind, label, got[key], micro_rows(spec, reference, micro), tol))
    missed = [k for k in got if (k[4] if isinstance(k, tuple) else k) not in want]
    return rows + [Row("output", str(k), float("inf"), float("inf"), False) for k in missed]


def pipeline_steps(
    spec,
    target: ParallelModel,
    local: dict[str, torch.Tensor],
    ps: ParallelState,
    mutate_runner: Callable[[PipelineRunner], None] | None = None,
) -> Iterator[tuple[float, dict | None, dict | None]]:
    """Per optimizer step of ``target`` on this DP rank's slice ``local``: (the mean loss
    over DP, every full gradient and every stage's outputs on the first step else None),
    before the update."""
    runner = pipeline_target(spec, target, ps)
    if mutate_runner is not None:
        mutate_runner(runner)
    # After the planted fault: what the stages really send. Not with MoE layers: their
    # reference runs micro-batch by micro-batch (_reference_objective), and under ep the
    # experts' rows differ in number between ranks; their losses and gradients are compared.
    # Nor compiled: a stage's graph spans its modules, and no module's output is its own.
    capture = None if _has_experts(target) or spec.compile else StageCapture(runner)
    stages = runner.model
    dp = TargetStep(spec, stages, ps)  # after the runner: FSDP shards its stage chunks
    chunks = {key: value.chunk(spec.microbatches) for key, value in local.items()}
    micro = [{key: value[j] for key, value in chunks.items()} for j in range(spec.microbatches)]
    for step in range(spec.steps):
        with dp.no_sync():
            loss = runner.train(micro)
        dp.finish_grads()
        stages.sum_tied_grads(dp.reduced_grad)
        grads = outputs = None
        if step == 0:
            grads = stages.full_grad_dict()  # over TP and the stages
            if capture is not None:
                outputs = capture.merged(ps)
                capture.remove()
        yield comm.mean(loss, ps.group("loss"), ps.device), grads, outputs
        dp.step()
        dp.zero_grad()
    dp.remove()


def pipeline_rows(spec, target, reference, batch, local, ps, mutate_runner) -> list[Row]:
    """Every stage's outputs, the loss of every step and every gradient of the first, the
    target pipelined (rows on global rank 0, where ``reference`` is; [] elsewhere)."""
    tol, rows = spec.tolerance, []
    # An MoE reference runs micro-batch by micro-batch (_reference_objective): its outputs
    # are not the whole batch's the stage rows are cut from; its losses and gradients are.
    experts = reference is not None and _has_experts(reference)
    capture = OutputCapture(reference) if reference is not None and not experts else None
    optimizer = reference and torch.optim.AdamW(
        reference.parameters(), lr=spec.lr, weight_decay=0.0
    )  # as the target's (dp_step)
    steps = pipeline_steps(spec, target, local, ps, mutate_runner)
    for step, (loss, grads, outputs) in enumerate(steps):
        if reference is None:
            continue
        ref_loss, loads = _reference_objective(spec, reference, batch, ps)
        if outputs is not None and capture is not None:
            rows += stage_output_rows(spec, outputs, capture.gathered(None, None))
            capture.remove()
        got = torch.tensor(loss, dtype=torch.float64)
        rows.append(compare("loss", f"loss (step {step})", got, ref_loss, tol))
        if grads is not None and spec.dp_shard != "optimizer":  # ZeRO-1 keeps them in its
            # buckets (its updates show in the later steps' losses, --steps N); reverse
            # registration order: the first failure nearest the bug
            want = reference.full_grad_dict()
            rows += [compare("grad", n, grads[n], want[n], tol) for n in reversed(grads)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        routers = [m for m in reference.modules() if isinstance(m, TopKRouter)]
        for router, load in zip(routers, loads, strict=True):  # as the runner's step end
            if router.kind == "sigmoid":
                router.update_bias(load)
    return rows


def _reference_objective(spec, reference, batch, ps) -> tuple[torch.Tensor, list]:
    """The unsplit model's loss on ``batch``, its gradient accumulated, and each router's
    load (token-slots per expert) over the batch. With MoE layers, as the pipeline's
    runtime objective: each DP slice's micro-batches run as their own forwards, each
    adding its routers' losses (a balance loss is a product of means over one forward's
    tokens, so one forward of the whole batch would not be the same); the model loss
    returned is the mean of those forwards'."""
    if not _has_experts(reference):
        loss = reference.loss(batch)
        loss.backward()
        return loss, []
    pooling = reference.cfg.moe_aux_loss_pooling
    slices = [{k: v.chunk(ps.dp_size)[r] for k, v in batch.items()} for r in range(ps.dp_size)]
    forwards = []
    for part in slices:
        chunks = {k: v.chunk(spec.microbatches) for k, v in part.items()}
        forwards += [{k: v[j] for k, v in chunks.items()} for j in range(spec.microbatches)]
    total, loads = 0.0, None
    for micro in forwards:
        loss = reference.loss(micro) / len(forwards)
        losses = moe_losses(reference)
        (loss + router_objective(losses, pooling) / len(forwards)).backward()
        total = total + loss.detach()
        slots = [one.slots_per_expert for one in losses]
        loads = slots if loads is None else [a + b for a, b in zip(loads, slots, strict=True)]
    return total, loads


def _has_experts(model) -> bool:
    return any(isinstance(m, TopKRouter) for m in model.modules())
