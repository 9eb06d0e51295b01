"""Cutting a built model (GPT, Llama family, BERT) into pipeline stages.

The model is built whole on every rank (the same RNG draws as the unsplit model, so the
weights do not depend on pp) and then cut: stage ``k`` of ``pp × virtual`` holds a
contiguous run of transformer layers, stage 0 also the embedding, the last stage the
heads and the loss (a decoder's final norm and LM head; BERT's MLM transform and head,
pooler and sentence-order head). BERT's padding mask is no activation: every stage gets
its micro-batch's mask from the batch (a keyword argument of the schedule). Pipeline rank
``r`` holds stages ``r, r + pp, …`` (the loop placement ``ScheduleInterleaved1F1B``
expects). Parameters keep their full names (``layers.7.mlp…``), so checkpoints and the
verifier see the unsplit model at any pp.

Tied embeddings (GPT-2, BERT): the last stage keeps a copy of the word embedding for its
head; after the DP reduction the two copies' gradients are summed over the embedding
group (first and last stage, Megatron's), so both take the same step and stay equal. The
copy is left out of the gradient norm and out of checkpoints (the first stage's is stored).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine import comm
from engine.models.base import ParallelModel, to_device
from engine.models.bert import BertModel, bert_losses
from engine.models.gpt import GPTModel, vocab_parallel_losses
from engine.pipeline.split import layer_split
from layers.param_roles import mark_copy
from layers.rotary import rotary_tables
from layers.utils import local_part
from parallel_state.groups import group_size

HEADS = ("final_norm", "lm_head")  # a decoder's last-stage modules
BERT_HEADS = ("mlm_transform", "lm_head", "pooler", "sop_head")


class _TiedWord(nn.Module):
    """The last stage's holder of the word embedding copy (named ``embedding.word``)."""

    def __init__(self, word: nn.Module) -> None:
        super().__init__()
        self.word = word


class StageChunk(nn.Module):
    """One stage's forward: the first stage's inputs (ids ``[b, s]``; BERT: and token types)
    or the hidden ``[s(/tp), b, h]`` received → hidden, and on the last stage → the heads'
    outputs (:meth:`PipelineModel.head`). ``attention_mask`` ``[b, s]`` (BERT's padding)
    reaches every stage from the batch."""

    def __init__(self, owner: PipelineModel, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        # Registered here too, so the chunk's parameters are the stage's (FSDP shards a
        # chunk's tree): the first stage's embedding, or the last stage's tied copy.
        if first or (last and owner.holds_tied_copy):
            self.embedding = owner.embedding
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in layers)
        for name in owner.head_names if last else ():
            self.add_module(name, getattr(owner, name))
        self._owner = (owner,)  # a tuple: the owner is not a submodule of its chunk

    def forward(self, *inputs: torch.Tensor, attention_mask: torch.Tensor | None = None):
        owner = self._owner[0]
        x = owner.embed(*inputs) if self.first else inputs[0]  # [s(/tp), b, h]
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        rotary = owner.rotary_for(x)
        for layer in self.layers:
            x = layer(x, mask) if rotary is None else layer(x, mask, None, rotary)
        return owner.head(x) if self.last else x


class PipelineModel(ParallelModel):
    """The stages of a built model that one pipeline rank holds, under their full names.

    ``chunks`` are the stage modules in stage order (one, or ``virtual`` interleaved ones).
    ``full_state_dict`` and ``full_grad_dict`` gather over TP and the pipeline group, so
    they return the unsplit model's tensors on every rank (collective).
    """

    def __init__(
        self,
        model: ParallelModel,
        *,
        pp_rank: int,
        pp_size: int,
        pp_group: dist.ProcessGroup | None,
        virtual: int = 1,
        layers_per_stage: list[int] | None = None,
        embedding_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, (GPTModel, BertModel)):
            raise ValueError(
                f"pp_size>1 cuts gpt, llama and bert models, not {type(model).__name__}"
            )
        self.cfg, self.tp_group, self.bert = model.cfg, model.tp_group, isinstance(model, BertModel)
        self.pp_group, self.embedding_group = pp_group, embedding_group
        self._full_names = model.full_names
        self.num_stages = pp_size * virtual
        self.split = layer_split(self.cfg.num_layers, self.num_stages, layers_per_stage)
        self.stage_ids = [pp_rank + v * pp_size for v in range(virtual)]
        self.is_first, self.is_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        self.kernels, self.rotary = model.kernels, getattr(model, "rotary", False)
        if self.rotary:
            self.register_buffer("inv_freq", model.inv_freq, persistent=False)
        self.holds_tied_copy = False  # the last stage's copy of the first stage's word embedding
        if self.is_first:
            self.embedding = model.embedding
        elif self.is_last and self.cfg.tie_embeddings:
            self.embedding = _TiedWord(model.embedding.word)
            self.holds_tied_copy = True
            mark_copy(model.embedding.word.weight)
        self.layers = nn.ModuleDict(
            {str(i): model.layers[i] for s in self.stage_ids for i in self.split[s]}
        )
        self.head_names = BERT_HEADS if self.bert else HEADS
        for name in self.head_names if self.is_last else ():
            self.add_module(name, getattr(model, name))
        self.chunks = [  # a list: the chunks' parameters are already registered above
            StageChunk(self, self.split[s], first=s == 0, last=s == self.num_stages - 1)
            for s in self.stage_ids
        ]

    @property
    def full_names(self) -> tuple[str, ...]:
        return self._full_names

    def stored_elsewhere(self) -> tuple[str, ...]:
        return ("embedding.word.weight",) if self.holds_tied_copy else ()

    def rotary_for(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) for positions 0 … s−1 of ``hidden`` (a sequence shard under SP)."""
        if not self.rotary:
            return None
        seq = hidden.shape[0] * (group_size(self.tp_group) if self.cfg.sequence_parallel else 1)
        positions = torch.arange(seq, device=hidden.device).expand(hidden.shape[1], -1)
        return rotary_tables(self.inv_freq, positions, hidden.dtype)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None):
        """The first stage's hidden ``[s(/tp), b, h]`` of ids ``[b, s]`` (BERT: and types)."""
        if self.bert:
            return self.embedding(input_ids, token_type_ids)
        return self.embedding(input_ids)

    def head(self, hidden: torch.Tensor):
        """The last stage's outputs: vocab-sharded logits ``[s, b, V/tp]``; BERT's are the
        MLM logits and the sentence-order logits ``[b, 2]``."""
        word = self.embedding.word.weight if self.cfg.tie_embeddings else None
        if self.bert:
            mlm = self.lm_head(self.mlm_transform(hidden), word)
            return mlm, self.sop_head(self.pooler(hidden))
        return self.lm_head(self.final_norm(hidden), word)

    def micro_loss(self, outputs, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch: the :meth:`head` outputs against the target of
        :meth:`schedule_inputs` (labels ``[b, s]``; BERT: MLM labels and the SOP label)."""
        if self.bert:
            mlm, sop = outputs
            return bert_losses(self, mlm, sop, target[:, :-1], target[:, -1])["loss"]
        return vocab_parallel_losses(self, outputs, target).mean()

    def schedule_inputs(self, micro_batches: list, device: torch.device) -> tuple:
        """The micro-batches stacked in order into the schedule's whole-batch inputs:
        (the first stage's positional inputs, every stage's keyword inputs, the target).

        Decoders take token windows ``[b, s+1]`` or ``{"input_ids", "labels"}``; BERT its
        dataset's dicts: its target is the MLM labels with the SOP label as a last column
        (the schedule splits one target tensor), its padding mask goes to every stage.
        """
        stacked: dict[str, list[torch.Tensor]] = {}
        for micro in micro_batches:
            micro = to_device(micro, device)
            if isinstance(micro, torch.Tensor):  # position i predicts i+1
                micro = {"input_ids": micro[:, :-1], "labels": micro[:, 1:]}
            for key, value in micro.items():
                stacked.setdefault(key, []).append(value)
        batch = {key: torch.cat(values) for key, values in stacked.items()}
        if not self.bert:
            return (batch["input_ids"],), {}, batch["labels"]
        target = torch.cat([batch["mlm_labels"], batch["sop_label"][:, None]], dim=1)
        inputs = (batch["input_ids"], batch["token_type_ids"])
        return inputs, {"attention_mask": batch["attention_mask"]}, target

    @torch.no_grad()
    def sum_tied_grads(self) -> None:
        """Sum the word embedding's gradient over its first- and last-stage copies."""
        if not self.cfg.tie_embeddings or not (self.is_first or self.is_last):
            return
        if self.is_first and self.is_last:  # both ends on this rank (pp=1): one tensor
            return
        word = self.embedding.word.weight
        if word.grad is None:
            word.grad = torch.zeros_like(word)
        # Under FSDP both copies are DP-sharded alike: each rank sums its own shard.
        comm.sum_(local_part(word.grad), self.embedding_group)

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
