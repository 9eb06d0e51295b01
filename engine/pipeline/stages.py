"""Cutting a built model into pipeline stages.

The model is built whole on every rank (the same RNG draws as the unsplit model, so the
weights do not depend on pp) and then cut: stage ``k`` of ``pp × virtual`` holds a
contiguous run of transformer layers, stage 0 also the embedding, the last stage the
modules the model names as its heads (``pipeline_heads``: a decoder's final norm and LM
head; an encoder's MLM transform and head, pooler and sentence-order head). The model
answers what the cut asks (``engine.models.base.ParallelModel``'s hooks): the first
stage's embedding, the rotary tables, the heads' outputs, the schedule's inputs and the
micro-batch loss; the cut runs them on each stage and names no family. Keyword inputs
(an encoder's padding mask; under context parallelism a decoder's global positions; packed
rows' document ids) are no activations: every stage gets its micro-batch's from the batch. Pipeline rank ``r`` holds stages ``r, r + pp, …`` (the loop placement
``ScheduleInterleaved1F1B`` expects), or under a V schedule (ZB-V, DualPipeV) stages ``r``
and ``2·pp − 1 − r`` (``split.stages_of_rank``). Parameters keep their full names
(``layers.7.mlp…``), so checkpoints and the verifier see the unsplit model at any pp.

Tied embeddings: the last stage keeps a copy of the word embedding for its head; after
the DP reduction the two copies' gradients are summed over the embedding group (first and
last stage, Megatron's), so both take the same step and stay equal. The copy is left out
of the gradient norm and out of checkpoints (the first stage's is stored). Under a V
schedule the first and the last stage share rank 0: there the last stage's chunk registers
the word embedding itself (one tensor, whose gradient both chunks accumulate), no copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from engine import comm
from engine.models.base import ParallelModel
from engine.pipeline.split import V_SCHEDULES, layer_split, stages_of_rank
from layers.documents import DocumentMask, document_positions, padding_mask
from layers.moe import moe_losses
from layers.param_roles import mark_copy, mark_tied_across
from layers.router import router_objective


class _RouterLossToBackward(torch.autograd.Function):
    """Forward: ``hidden`` unchanged. Backward: ``hidden``'s gradient unchanged, and
    ``scale`` as the gradient of the scalar ``router_loss``: the router losses enter the
    objective through the stage's own backward, × the factor the schedule gives each
    micro-batch's loss, without a loss of their own on the last stage."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, router_loss: torch.Tensor, scale: float):
        ctx.scale, ctx.like = scale, router_loss.detach()
        # The same storage, no copy; not a view of ``hidden`` (as returning it or a
        # view_as would make it), which the zero-bubble schedules detach in place.
        return hidden.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full_like(ctx.like, ctx.scale), None


def attach_router_loss(hidden: torch.Tensor, router_loss: torch.Tensor, scale: float):
    """``hidden``, carrying ``router_loss`` into backward with weight ``scale``
    (Megatron-Core's MoE aux-loss auto-scaler, written for one stage)."""
    return _RouterLossToBackward.apply(hidden, router_loss, scale)


class _TiedWord(nn.Module):
    """The last stage's holder of the word embedding copy (named ``embedding.word``)."""

    def __init__(self, word: nn.Module) -> None:
        super().__init__()
        self.word = word


class StageChunk(nn.Module):
    """One stage's forward: the first stage's inputs (ids ``[b, s]``, and whatever else the
    model embeds) or the hidden ``[s(/tp), b, h]`` received → hidden, and on the last stage
    → the heads' outputs (:meth:`PipelineModel.head`). ``attention_mask`` ``[b, s]`` (an
    encoder's padding), ``positions`` (a cp rank's) and ``document_ids`` ``[b, s]`` (packed
    rows: attention within each document, positions restarting at each) reach every stage
    from the batch."""

    def __init__(self, owner: PipelineModel, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        # Registered here too, so the chunk's parameters are the stage's (FSDP shards a
        # chunk's tree): the first stage's embedding, or the last stage's tied copy.
        if first or (last and owner.holds_tied_copy):
            self.embedding = owner.embedding
        elif last and owner.cfg.tie_embeddings:  # a V: the first stage is on this rank too
            self.embedding = _TiedWord(owner.embedding.word)
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in layers)
        for name in owner.head_names if last else ():
            self.add_module(name, getattr(owner, name))
        self._owner = (owner,)  # a tuple: the owner is not a submodule of its chunk

    def forward(
        self,
        *inputs: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ):
        owner = self._owner[0]
        if document_ids is not None:  # packed rows: positions within each document
            mask = DocumentMask(document_ids)
            if positions is None:  # (a cp rank's share comes with its own)
                positions = document_positions(document_ids)
        else:
            mask = padding_mask(attention_mask, ring=positions is not None)
        if not self.first:
            x = inputs[0]  # [s(/tp), b, h]
        elif positions is None:
            x = owner.embed(*inputs)
        else:  # a cp rank's share, or packed documents: the tokens at their positions
            x = owner.embed(*inputs, positions=positions)
        rotary = owner.rotary_for(x, positions)
        for layer in self.layers:
            x = layer(x, mask) if rotary is None else layer(x, mask, None, rotary)
        routers = moe_losses(self.layers) if torch.is_grad_enabled() else []
        if routers:  # each layer's own losses ("layer" pooling: they sum across stages)
            x = attach_router_loss(x, router_objective(routers), owner.router_loss_scale)
        return owner.head(x) if self.last else x


class PipelineModel(ParallelModel):
    """The stages of a built model that one pipeline rank holds, under their full names.

    ``chunks`` are the stage modules in stage order (one, or ``virtual`` interleaved ones).
    ``full_state_dict`` and ``full_grad_dict`` gather over TP and the pipeline group, so
    they return the unsplit model's tensors on every rank (collective). The model's hooks
    (``embed``, ``rotary_for``, ``head``, ``stage_inputs``, ``stage_loss``) run on this
    object: it holds what they read (``ParallelModel.pipeline_heads``).
    """

    def __init__(
        self,
        model: ParallelModel,
        *,
        pp_rank: int,
        pp_size: int,
        pp_group: dist.ProcessGroup | None,
        virtual: int = 1,
        schedule: str = "1f1b",
        layers_per_stage: list[int] | None = None,
        embedding_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not getattr(model, "pipeline_heads", ()):
            raise ValueError(
                f"pp_size>1 cuts models that name their last-stage heads (pipeline_heads), "
                f"not {type(model).__name__}"
            )
        self._hooks = type(model)  # the class whose hooks run on this stage
        self.cfg, self.tp_group, self.kernels = model.cfg, model.tp_group, model.kernels
        for name, buffer in model.named_buffers(recurse=False):  # constants (rotary frequencies)
            self.register_buffer(name, buffer, persistent=False)
        self.pp_group, self.embedding_group = pp_group, embedding_group
        self._full_names = model.full_names
        self.num_stages = pp_size * virtual
        self.split = layer_split(self.cfg.num_layers, self.num_stages, layers_per_stage)
        self.stage_ids = stages_of_rank(pp_rank, pp_size, virtual, schedule)
        self.v_shape = schedule in V_SCHEDULES  # stages r and 2·pp − 1 − r
        # the pipeline rank whose stage computes the loss
        self.last_rank = next(
            r
            for r in range(pp_size)
            if self.num_stages - 1 in stages_of_rank(r, pp_size, virtual, schedule)
        )
        self.is_first, self.is_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        self.holds_tied_copy = False  # the last stage's copy of the first stage's word embedding
        # What backward gives each micro-batch's router losses (the runner sets it per
        # step to the factor of the micro-batch loss: loss scale ÷ micro-batches).
        self.router_loss_scale = 1.0
        if self.ties_across_stages:  # ZeRO-1 gives it a bucket of its own (param_roles)
            mark_tied_across(model.embedding.word.weight)
        if self.is_first:
            self.embedding = model.embedding
        elif self.is_last and self.cfg.tie_embeddings:
            self.embedding = _TiedWord(model.embedding.word)
            self.holds_tied_copy = True
            mark_copy(model.embedding.word.weight)
        self.layers = nn.ModuleDict(
            {str(i): model.layers[i] for s in self.stage_ids for i in self.split[s]}
        )
        self.head_names = model.pipeline_heads
        for name in self.head_names if self.is_last else ():
            self.add_module(name, getattr(model, name))
        self.chunks = [  # a list: the chunks' parameters are already registered above
            StageChunk(self, self.split[s], first=s == 0, last=s == self.num_stages - 1)
            for s in self.stage_ids
        ]
        if self.cfg.compile:  # each stage's forward one graph (the model's is never run)
            for chunk in self.chunks:
                chunk.compile(backend=self.cfg.compile_backend)

    @property
    def full_names(self) -> tuple[str, ...]:
        return self._full_names

    def stored_elsewhere(self) -> tuple[str, ...]:
        return ("embedding.word.weight",) if self.holds_tied_copy else ()

    def rotary_for(
        self, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The model's rotary tables for ``hidden`` at ``positions`` (None: its layers take
        none)."""
        return self._hooks.rotary_for(self, hidden, positions)

    def embed(self, *inputs: torch.Tensor, **keywords: torch.Tensor) -> torch.Tensor:
        """The first stage's hidden ``[s(/tp), b, h]`` of the schedule's positional inputs
        (and ``positions``, a cp rank's)."""
        return self._hooks.embed(self, *inputs, **keywords)

    def context_shard(self, batch, cp_size: int, cp_rank: int):
        """The model's :meth:`~engine.models.base.ParallelModel.context_shard`: cp rank
        ``cp_rank``'s share of a micro-batch, with its tokens' global positions."""
        return self._hooks.context_shard(self, batch, cp_size, cp_rank)

    def head(self, hidden: torch.Tensor):
        """The last stage's outputs (the model's heads: vocab-sharded logits ``[s, b, V/tp]``,
        and whatever else its loss takes)."""
        return self._hooks.head(self, hidden)

    def micro_loss(self, outputs, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch: the :meth:`head` outputs against the target of
        :meth:`schedule_inputs` (the model's ``stage_loss``)."""
        return self._hooks.stage_loss(self, outputs, target)

    def schedule_inputs(self, micro_batches: list, device: torch.device) -> tuple:
        """The micro-batches stacked in order into the schedule's whole-batch inputs:
        (the first stage's positional inputs, every stage's keyword inputs, the target),
        as the model's ``stage_inputs`` says."""
        return self._hooks.stage_inputs(self, micro_batches, device)

    @property
    def ties_across_stages(self) -> bool:
        """Whether this rank holds one of two stages' copies of the tied word embedding."""
        ends = self.is_first or self.is_last
        return self.cfg.tie_embeddings and ends and not (self.is_first and self.is_last)

    @torch.no_grad()
    def sum_tied_grads(self, reduced_grad: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Sum the word embedding's DP-reduced gradient over its first- and last-stage
        copies; ``reduced_grad`` (the DP strategy's) gives this rank's part of it: the
        whole gradient, or its DP shard under FSDP and ZeRO-1, alike on both stages."""
        if self.ties_across_stages:
            comm.sum_(reduced_grad(self.embedding.word.weight), self.embedding_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather_stages(super().full_state_dict())

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return self._gather_stages(super().full_grad_dict())

    def _gather_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for part in comm.all_gather_object(mine, self.pp_group):
            for name, tensor in part.items():
                merged.setdefault(name, tensor)  # a tied copy: the first stage's
        return {name: merged[name] for name in self.full_names}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = set(self.full_names) - set(state), set(state) - set(self.full_names)
        if missing or unexpected:
            raise KeyError(
                f"state dict mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        super().load_full_state_dict({name: state[name] for name, _ in self.named_parameters()})
