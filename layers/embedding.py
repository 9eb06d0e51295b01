"""Vocabulary-parallel embedding: each TP rank holds a contiguous block of the vocabulary."""

from __future__ import annotations

from typing import Unpack

import torch
import torch.nn.functional as F
from torch import nn

from layers.linear import ShardOptions, init_tp_shard, load_master_weight
from layers.mappings import reduce_from_tp, reduce_scatter_to_sequence
from layers.param_roles import mark_tp_dim
from layers.utils import comm_timer_of, divide, shard


class VocabParallelEmbedding(nn.Module):
    """Embedding whose ``weight`` is the ``tp_rank``-th vocabulary block ``[V/tp, D]``.

    Ids outside this rank's block look up nothing (their rows are zeroed), and the partial
    results are summed across TP, all-reduced, or under sequence parallelism
    reduce-scattered along ``sequence_dim``. Keyword options: ``layers.linear.ShardOptions``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        **options: Unpack[ShardOptions],
    ) -> None:
        super().__init__()
        factory = init_tp_shard(self, options)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = divide(
            num_embeddings,
            self.tp_size,
            "VocabParallelEmbedding vocabulary size (pad it with layers.pad_vocab_size)",
        )
        self.vocab_start, self.vocab_end = self.tp_rank * local, (self.tp_rank + 1) * local
        self.weight = mark_tp_dim(nn.Parameter(torch.empty(local, embedding_dim, **factory)), 0)
        load_master_weight(self, (num_embeddings, embedding_dim), options, factory["dtype"])

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        """Overwrite this rank's vocabulary block from the full ``[V, D]`` table."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"full embedding must have shape {(self.num_embeddings, self.embedding_dim)}, "
                f"got {tuple(weight.shape)}"
            )
        self.weight.copy_(shard(weight, 0, self.tp_rank, self.tp_size))

    @classmethod
    def from_full(cls, weight: torch.Tensor, **kwargs) -> VocabParallelEmbedding:
        """Build the embedding from a full ``[V, D]`` table."""
        kwargs.setdefault("init_method", lambda t: t.copy_(weight))
        return cls(weight.shape[0], weight.shape[1], **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        timer = comm_timer_of(self)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(
                out, self.tp_group, dim=self.sequence_dim, comm_timer=timer
            )
        return reduce_from_tp(out, self.tp_group, comm_timer=timer)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}, "
            f"vocab block=[{self.vocab_start}, {self.vocab_end})"
        )
