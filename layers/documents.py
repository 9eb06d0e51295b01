"""Packed documents: several documents in one row, each seeing only itself.

A row of ``s`` tokens carries ``document_ids`` ``[b, s]``: equal ids on the tokens of one
document, consecutive in the row (a packed window cut from the token stream). Two things
follow from them, both here:

- **positions** restart at 0 at each document start (``document_positions``), for RoPE
  and the learned position table;
- **attention** is block-diagonal causal: a query sees the keys of its own document at or
  before it (``DocumentMask``), the mask each attention core realises its own way.

``DocumentMask`` goes where a dense mask would (the layers' ``mask`` slot), so the layers
and the pipeline of calls between them carry it unchanged; the core that consumes it
decides: the local core builds the dense ``[b, 1, s, s]`` pattern for torch's SDPA
(correctness first), the ring (cp > 1) passes the ids on and skips the blocks between
documents. On a GPU the local core would rather hand ``cu_seqlens`` (the document starts)
to a varlen kernel (FlashAttention's ``flash_attn_varlen_func``) or a block mask to
FlexAttention, which skip the masked blocks instead of computing and discarding them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``[b, s]`` (int64): each token's offset from its document's first token
    in the row (a row that starts inside a document counts from the row's start)."""
    b, s = document_ids.shape
    index = torch.arange(s, device=document_ids.device).expand(b, -1)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


@dataclass(frozen=True)
class DocumentMask:
    """The attention pattern of packed rows: ``ids`` ``[b, s]`` are the document ids of
    the whole sequence (under cp every rank holds the full rows' ids: b·s integers)."""

    ids: torch.Tensor

    def dense(self, *, causal: bool) -> torch.Tensor:
        """Boolean ``[b, 1, s, s]``: True where a query may attend to a key (same document
        and, when ``causal``, not later). Every query sees itself: no row is empty."""
        same = self.ids[:, None, :, None] == self.ids[:, None, None, :]
        if not causal:
            return same
        s = self.ids.shape[1]
        return same & torch.ones(s, s, dtype=torch.bool, device=self.ids.device).tril()


@dataclass(frozen=True)
class PaddingMask:
    """Padded rows (BERT) under context parallelism: ``keys`` ``[b, s]`` (bool, True on the
    real tokens) of the whole sequence, held whole by every cp rank as ``DocumentMask``'s
    ids are. No query sees a padding key; the ring skips key blocks of padding alone."""

    keys: torch.Tensor

    def dense(self, *, causal: bool) -> torch.Tensor:
        """Boolean ``[b, 1, 1, s]`` (``[b, 1, s, s]`` when ``causal``): True where a query
        may attend to a key."""
        keys = self.keys.bool()[:, None, None, :]
        if not causal:
            return keys
        s = self.keys.shape[1]
        return keys & torch.ones(s, s, dtype=torch.bool, device=keys.device).tril()


def padding_mask(attention_mask: torch.Tensor | None, *, ring: bool):
    """The mask an encoder's layers take for ``attention_mask`` ``[b, s]`` (1 on the real
    tokens): the dense ``[b, 1, 1, s]`` one, or under context parallelism (``ring``: a cp
    rank's share, the mask the whole rows') a :class:`PaddingMask`; None for None."""
    if attention_mask is None:
        return None
    return PaddingMask(attention_mask.bool()) if ring else attention_mask[:, None, None, :].bool()
