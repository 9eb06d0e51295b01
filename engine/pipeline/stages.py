"""Cutting a built decoder into pipeline stages.

The model is built whole on every rank (the same RNG draws as the unsplit model, so the
weights do not depend on pp) and then cut: stage ``k`` of ``pp × virtual`` holds a
contiguous run of transformer layers, stage 0 also the embedding, the last stage the
final norm, the LM head and the loss. Pipeline rank ``r`` holds stages ``r, r + pp, …``
(the loop placement ``ScheduleInterleaved1F1B`` expects). Parameters keep their full names
(``layers.7.mlp…``), so checkpoints and the verifier see the unsplit model at any pp.

Tied embeddings (GPT-2): the last stage keeps a copy of the word embedding for its LM head;
after the DP reduction the two copies' gradients are summed over the embedding group
(first and last stage, Megatron's), so both take the same step and stay equal. The copy
is left out of the gradient norm and out of checkpoints (the first stage's is stored).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine import comm
from engine.models.base import ParallelModel
from engine.models.gpt import GPTModel, vocab_parallel_losses
from engine.pipeline.split import layer_split
from layers.param_roles import mark_copy
from layers.rotary import rotary_tables
from parallel_state.groups import group_size


class _TiedWord(nn.Module):
    """The last stage's holder of the word embedding copy (named ``embedding.word``)."""

    def __init__(self, word: nn.Module) -> None:
        super().__init__()
        self.word = word


class StageChunk(nn.Module):
    """One stage's forward: ids ``[b, s]`` → hidden (first stage), hidden ``[s(/tp), b, h]``
    → hidden, and on the last stage → vocab-sharded logits ``[s, b, V/tp]``."""

    def __init__(self, owner: PipelineModel, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embedding = owner.embedding if first else None
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in layers)
        self.final_norm = owner.final_norm if last else None
        self.lm_head = owner.lm_head if last else None
        self._owner = (owner,)  # a tuple: the owner is not a submodule of its chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self._owner[0]
        if self.first:
            x = self.embedding(x)  # [s(/tp), b, h]
        rotary = owner.rotary_for(x)
        for layer in self.layers:
            x = layer(x) if rotary is None else layer(x, None, None, rotary)
        if self.last:
            word = owner.embedding.word.weight if owner.cfg.tie_embeddings else None
            x = self.lm_head(self.final_norm(x), word)
        return x


class PipelineModel(ParallelModel):
    """The stages of a built decoder that one pipeline rank holds, under their full names.

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
        if not isinstance(model, GPTModel):
            raise ValueError(
                f"pp_size>1 is built for the decoders (gpt, llama), not {model.cfg.arch}"
            )
        self.cfg, self.tp_group = model.cfg, model.tp_group
        self.pp_group, self.embedding_group = pp_group, embedding_group
        self._full_names = model.full_names
        self.num_stages = pp_size * virtual
        split = layer_split(self.cfg.num_layers, self.num_stages, layers_per_stage)
        self.stage_ids = [pp_rank + v * pp_size for v in range(virtual)]
        self.is_first, self.is_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        self.kernels, self.rotary = model.kernels, model.rotary
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
            {str(i): model.layers[i] for s in self.stage_ids for i in split[s]}
        )
        if self.is_last:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head
        self.chunks = [  # a list: the chunks' parameters are already registered above
            StageChunk(self, split[s], first=s == 0, last=s == self.num_stages - 1)
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

    def micro_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch: logits ``[s, b, V/tp]``, labels ``[b, s]``."""
        return vocab_parallel_losses(self, logits, labels).mean()

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
        comm.sum_(word.grad, self.embedding_group)

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
