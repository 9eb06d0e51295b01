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
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        *,
        seed: int,
        doc_range: tuple[int, int] | None = None,
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

    def __len__(self) -> int:
        return self.shuffle.num_samples

    def window(self, window_id: int) -> np.ndarray:
        """Tokens ``[window_id * seq_len, (window_id + 1) * seq_len]`` of the stream, unshuffled."""
        start = window_id * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def sample_order(self, epoch: int) -> np.ndarray:
        """Window ids in the order epoch ``epoch`` serves them."""
        return self.shuffle.order(epoch)

    def __getitem__(self, index: int) -> torch.Tensor:
        _, window_id = self.shuffle(index)
        return torch.from_numpy(self.window(window_id).astype(np.int64))
