"""Causal-LM samples: fixed-length windows over the concatenated token stream."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.data.indexed import IndexedDataset
from engine.data.sampling import EpochShuffle


class GPTDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens (inputs plus shifted targets) with stride ``seq_len``.

    Documents ``doc_range`` are read as one stream, end-of-document tokens included, so windows
    cross document boundaries as in GPT pre-training. ``len()`` is one epoch; larger indices
    continue into later epochs, each a fresh ``(seed, epoch)`` permutation of the windows.

    A sample is the window, a tensor ``[seq_len + 1]``. With ``document_mask=True`` it is
    ``{"input_ids", "labels", "document_ids"}``, each ``[seq_len]``: the window's inputs,
    their next tokens, and which document each input belongs to (0, 1, … from the window's
    first, read from the index's document offsets), so the model can keep attention and
    positions within documents (``layers.documents``). The tokens are the same either way.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        *,
        seed: int,
        doc_range: tuple[int, int] | None = None,
        document_mask: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.tokens = indexed.doc_range_tokens(doc_range)
        # Consecutive windows share one token: the last target of one is the first input of next.
        num_windows = (len(self.tokens) - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"documents {doc_range} hold {len(self.tokens)} tokens, "
                f"fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.shuffle = EpochShuffle(num_windows, seed)
        self.doc_starts = None  # token offset of each document in self.tokens
        if document_mask:
            first, last = (0, len(indexed)) if doc_range is None else doc_range
            offsets = np.asarray(indexed.doc_offsets[first:last], dtype=np.int64)
            self.doc_starts = offsets - offsets[0] if len(offsets) else offsets

    def __len__(self) -> int:
        return self.shuffle.num_samples

    def window(self, window_id: int) -> np.ndarray:
        """Tokens ``[window_id * seq_len, (window_id + 1) * seq_len]`` of the stream, unshuffled."""
        start = window_id * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def sample_order(self, epoch: int) -> np.ndarray:
        """Window ids in the order epoch ``epoch`` serves them."""
        return self.shuffle.order(epoch)

    def document_ids(self, window_id: int) -> np.ndarray:
        """Document of each input token of window ``window_id`` (``[seq_len]``, int64),
        numbered from 0 at the window's first token."""
        start = window_id * self.seq_len
        tokens = np.arange(start, start + self.seq_len)
        docs = np.searchsorted(self.doc_starts, tokens, side="right")
        return docs - docs[0]

    def __getitem__(self, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        _, window_id = self.shuffle(index)
        window = torch.from_numpy(self.window(window_id).astype(np.int64))
        if self.doc_starts is None:
            return window
        return {
            "input_ids": window[:-1],
            "labels": window[1:],
            "document_ids": torch.from_numpy(self.document_ids(window_id)),
        }
