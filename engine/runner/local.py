"""The local step runner: the whole model on this rank, its micro-batches run one after
another, each backward accumulating into the same gradients (pp_size=1).

Under context parallelism (cp_size > 1) the batch that reaches the model is this rank's
share of every sequence (``model.context_shard``: the load-balanced chunks, labels cut
alike, global positions). The data is split over dp only, so the cp ranks of a replica
read the same samples. The loss is normalised over the whole sequence: each cp rank holds
s/cp tokens of every row and takes the mean over them, i.e. its sum × cp / (b · s); the
gradient group (dp × cp) averages the gradients and the loss group the losses, so the
step sees Σ over cp ranks / (b · s), the unsplit model's mean.

A model with MoE layers trains on its loss plus every router's auxiliary and z-losses
(``layers.moe.moe_losses``: each router's weighted losses of this micro-batch's tokens on
this rank, combined by ``layers.router.router_objective`` as ``model.moe_aux_loss_pooling``
says: per layer, or pooled over the model's layers as transformers' ``aux_loss``), divided by the micro-batch count with it: the objective is the mean over the
step's micro-batches and (by the DP average) its ranks of (model loss + router losses),
the same at every ep size, since each rank routes its own tokens at every ep size. Under
context parallelism a router's load-balancing statistics are summed over the cp group
(``layers.router.load_balancing_loss``), so its loss is the whole sequences', as unsplit. The
step's reported loss stays the model's (comparable with evaluation and dense runs); the
router losses' step mean is ``router_loss``. Each micro-batch's router statistics also go
to ``moe_window`` (``engine.moe_observe``: the console's moe line; None for a dense model),
whose step end moves a sigmoid router's expert bias by the global batch's load."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from engine import comm
from engine.data.loader import DataIterator
from engine.data_parallel import DataParallel
from engine.models.base import to_device
from engine.moe_observe import MoEWindow
from layers.moe import MoEMLP, moe_losses
from layers.router import router_objective
from parallel_state import ParallelState

Autocast = Callable[[], contextlib.AbstractContextManager]


def model_inputs(model: nn.Module, ps: ParallelState) -> Callable:
    """What a micro-batch becomes on its way into ``model.loss``: moved to the rank's
    device and, under context parallelism, cut to this cp rank's share."""
    cp_size, cp_rank = ps.size("cp"), ps.rank_in("cp")
    if cp_size == 1:
        return lambda batch: to_device(batch, ps.device)
    return lambda batch: model.context_shard(to_device(batch, ps.device), cp_size, cp_rank)


@torch.no_grad()
def fixed_set_loss(
    model: nn.Module,
    valid: DataIterator,
    ps: ParallelState,
    batches: int,
    autocast: Autocast,
    on_forward: Callable[[], None] | None = None,
) -> float:
    """Mean loss over micro-batches ``0 .. batches - 1`` of ``valid`` (a one-micro-batch-per-
    step iterator): micro-batch j runs on batch rank j mod the batch group's size and the
    mean is over micro-batches, so the result does not depend on how the data is split.
    Every rank gets it.

    Every batch rank runs the same number of forward passes, ⌈batches / size⌉: a rank past
    the last micro-batch runs one again and drops its loss, because under FSDP each forward
    gathers parameters over the gradient group and all its ranks must take part.
    ``on_forward`` (a progress bar's) is called after each of this rank's forwards."""
    model.eval()
    total, size, inputs = 0.0, ps.size("batch"), model_inputs(model, ps)
    for j in range(ps.rank_in("batch"), -(-batches // size) * size, size):
        valid.consumed_samples = (j % batches) * valid.global_batch
        for micro in valid.next_step():  # one micro-batch
            with autocast():
                loss = model.loss(inputs(micro)).float().item()
            total += loss if j < batches else 0.0
        if on_forward is not None:
            on_forward()
    model.train()
    return comm.mean(total, ps.group("loss"), ps.device) * size / batches


class LocalRunner:
    """Runs a step's micro-batches through the whole ``model`` in turn: gradients accumulate
    locally and the DP reduction is launched with the last backward. Nothing to add to the
    gradient norm, no hook after the reduction, and it can sample."""

    sample_refusal: str | None = None

    def __init__(self, model: nn.Module, ps: ParallelState, autocast: Autocast) -> None:
        self.model, self.ps, self.autocast = model, ps, autocast
        self.inputs = model_inputs(model, ps)
        if ps.size("cp") > 1:  # its attention is a ring over the cp group: no KV cache
            self.sample_refusal = "no sample: generation runs at cp_size=1"
        self.has_experts = any(isinstance(m, MoEMLP) for m in model.modules())
        self.router_loss = torch.zeros((), device=ps.device)  # the last step's, detached
        self.moe_window = MoEWindow(model, ps.device) if self.has_experts else None
        self.aux_pooling = model.cfg.moe_aux_loss_pooling if self.has_experts else "layer"

    def _loss(self, batch) -> torch.Tensor:
        return self.model.loss(self.inputs(batch))

    def _router_loss(self) -> torch.Tensor | None:
        """The weighted router losses of the last forward's MoE layers (None: none)."""
        if not self.has_experts:
            return None
        losses = moe_losses(self.model)
        self.moe_window.add(losses)
        return router_objective(losses, self.aux_pooling)

    def forward_backward(
        self, micro_batches: list, dp: DataParallel, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of each micro-batch, its loss (plus its router losses) divided
        by their count (and multiplied by ``loss_scale`` for backward: × 1.0 is exact); the
        mean model loss, detached."""
        total = torch.zeros((), device=self.ps.device)
        router_total = torch.zeros((), device=self.ps.device)
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else dp.no_sync():
                with self.autocast():
                    loss = self._loss(micro) / len(micro_batches)
                    router = self._router_loss()
                    router = None if router is None else router / len(micro_batches)
                objective = loss if router is None else loss + router
                (objective * loss_scale).backward()
            total += loss.detach().float()
            if router is not None:
                router_total += router.detach().float()
        self.router_loss = router_total
        if self.moe_window is not None:  # and the sigmoid routers' biases move
            self.moe_window.end_step(self.ps.group("loss"))
        return total

    def fixed_set_loss(self, valid: DataIterator, batches: int) -> float:
        """:func:`fixed_set_loss` of this runner's model."""
        return fixed_set_loss(self.model, valid, self.ps, batches, self.autocast)

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The DP strategy's norm already covers the whole model."""
        return norm

    def post_reduction(self, dp) -> list:
        """Nothing to do between the DP reduction and the norm."""
        return []

    def timings(self) -> dict[str, float]:
        return {}

    def waits_on(self) -> tuple[str, str]:
        return "forward/backward", "model"

    def console_note(self) -> str:
        """`` cp=N (ring attention)`` and `` ep=N`` where sequences or experts are split."""
        cp, ep = self.ps.size("cp"), self.ps.size("expert")
        return (f" cp={cp} (ring attention)" if cp > 1 else "") + (f" ep={ep}" if ep > 1 else "")
