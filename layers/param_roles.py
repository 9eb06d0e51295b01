"""What a parameter is to the mesh, declared in one place.

The layers set a parameter's roles here when they make it; the data-parallel strategies,
the gradient norm, checkpoints and HF interop read them here, so none of them needs to
know which layer made the parameter. The roles:

* **TP split dim**: the tensor dim split across TP, or None when every TP rank holds the
  whole tensor.
* **replicas**: how many consecutive TP ranks hold each dim-0 block of a split parameter
  (1: an ordinary split; more when there are fewer KV heads than TP ranks, ``layers.gqa``).
* **block count**: the most dim-0 blocks a split parameter is cut into at any TP size (its
  KV heads); past it each block is replicated. Unlike the replicas it does not depend on
  the layout, so checkpoints cut and place such a parameter for any TP size with it.
* **sequence-parallel partial gradient**: a replicated parameter whose gradient on each
  TP rank covers only that rank's sequence block (norms, the row-parallel bias under
  sequence parallelism) or only its heads (the per-head QK norms, at any TP size);
  ``layers.tp_grads`` sums it over TP after backward.
* **padded vocabulary**: dim 0 is the vocabulary, padded per TP size in memory and cut
  back to the true vocabulary in full state dicts.
* **copy of another rank's**: a pipeline's tied word embedding on the last stage, whose
  gradient the first stage's original already counts in the norm.
* **expert**: dim 0 is a MoE layer's experts, cut over the ``expert`` role's ep ranks
  (each holds ``E / ep`` whole experts; ``expert_split`` says ep, ``expert_rank`` which
  block this rank holds, so checkpoints place it in the full tensor). Its gradient already
  sums the tokens of every ep rank (the all-to-all's backward brings them), so the DP
  strategies reduce it over the ``expert_grad`` group, the ranks holding the same experts,
  not over the dense gradient group; the gradient norm sums it over the ep ranks.

A tied LM head holds no parameter of its own (it reads the word embedding's), so tying
needs no role. Each role is an attribute on the parameter, named only in this module.
"""

from __future__ import annotations

import torch

_TP_DIM = "tp_split_dim"
_REPLICAS = "tp_replicas"
_BLOCKS = "tp_blocks_at_most"
_SP_PARTIAL_GRAD = "sequence_parallel_grad"
_VOCAB_PADDED = "vocab_padded"
_COPY = "copy_of_another_rank"
_TIED_ACROSS = "tied_across_ranks"
_EXPERT_SPLIT = "expert_parallel_split"
_EXPERT_RANK = "expert_parallel_rank"


def mark_tp_dim(param: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Declare the dim ``param`` is split along across TP (None: replicated); returns it."""
    setattr(param, _TP_DIM, dim)
    return param


def tp_dim(param: torch.Tensor) -> int | None:
    """The dim ``param`` is split along across TP; None when replicated (or undeclared)."""
    return getattr(param, _TP_DIM, None)


def mark_replicas(param: torch.Tensor, copies: int) -> None:
    """Declare that each dim-0 block of ``param`` is held by ``copies`` consecutive TP ranks."""
    setattr(param, _REPLICAS, copies)


def replicas(param: torch.Tensor) -> int:
    """How many TP ranks hold each of ``param``'s blocks (1: an ordinary split)."""
    return getattr(param, _REPLICAS, 1)


def mark_tp_blocks(param: torch.Tensor, blocks: int) -> None:
    """Declare that ``param``'s dim 0 is cut into at most ``blocks`` blocks over TP (each
    held by ``tp_size / blocks`` ranks when TP is larger)."""
    setattr(param, _BLOCKS, blocks)


def tp_blocks(param: torch.Tensor) -> int | None:
    """The most dim-0 blocks ``param`` is cut into over TP; None: no limit."""
    return getattr(param, _BLOCKS, None)


def mark_sp_partial_grad(param: torch.Tensor, partial: bool = True) -> None:
    """Declare whether ``param``'s gradient is a per-rank partial sum under sequence
    parallelism (summed over TP after backward)."""
    setattr(param, _SP_PARTIAL_GRAD, partial)


def has_sp_partial_grad(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient must be summed over TP after backward."""
    return getattr(param, _SP_PARTIAL_GRAD, False)


def mark_vocab_padded(param: torch.Tensor) -> None:
    """Declare that ``param``'s dim 0 is the vocabulary, padded per TP size."""
    setattr(param, _VOCAB_PADDED, True)


def is_vocab_padded(param: torch.Tensor) -> bool:
    """Whether ``param``'s dim 0 is the padded vocabulary."""
    return getattr(param, _VOCAB_PADDED, False)


def mark_copy(param: torch.Tensor) -> None:
    """Declare ``param`` a copy of a parameter another rank holds and counts (a pipeline's
    tied embedding on the last stage)."""
    setattr(param, _COPY, True)


def mark_tied_across(param: torch.Tensor) -> None:
    """Declare ``param`` one of several ranks' copies of one tensor whose gradients are
    summed after the DP reduction (a pipeline's tied word embedding, on its first and its
    last stage): ZeRO-1 keeps it in a bucket of its own, so every holder's shard of it
    covers the same elements and the shards sum as the whole gradients would."""
    setattr(param, _TIED_ACROSS, True)


def tied_across(param: torch.Tensor) -> bool:
    """Whether ``param`` was declared by :func:`mark_tied_across`."""
    return getattr(param, _TIED_ACROSS, False)


def counted_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this TP rank's copy of ``param`` counts toward the gradient norm: split
    parameters on every rank, replicated blocks on the first rank holding each, fully
    replicated parameters on TP rank 0; never a copy of another rank's (``mark_copy``)."""
    if getattr(param, _COPY, False):
        return False
    if tp_dim(param) is None:
        return tp_rank == 0
    return tp_rank % replicas(param) == 0


def mark_expert(param: torch.Tensor, ep_size: int = 1, ep_rank: int = 0) -> None:
    """Declare ``param``'s dim 0 a MoE layer's experts, cut into ``ep_size`` blocks over the
    ``expert`` role (1: this rank holds every expert), of which this rank holds block
    ``ep_rank``."""
    setattr(param, _EXPERT_SPLIT, ep_size)
    setattr(param, _EXPERT_RANK, ep_rank)


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` holds experts (its gradient reduces over ``expert_grad``)."""
    return hasattr(param, _EXPERT_SPLIT)


def expert_split(param: torch.Tensor) -> int:
    """Over how many ep ranks ``param``'s experts are cut (1: none, or not an expert)."""
    return getattr(param, _EXPERT_SPLIT, 1)


def expert_rank(param: torch.Tensor) -> int:
    """Which of the ``expert_split(param)`` dim-0 blocks this rank holds (0: not split)."""
    return getattr(param, _EXPERT_RANK, 0)
