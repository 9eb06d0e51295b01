"""BERT samples: ``[CLS] A [SEP] B [SEP]`` with sentence-order prediction and dynamic MLM."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.data.indexed import IndexedDataset
from engine.data.sampling import SAMPLE_STREAM, EpochShuffle

IGNORE_INDEX = -100
"""Label of positions the MLM loss skips (torch cross-entropy's default ``ignore_index``)."""


class BertDataset(Dataset):
    """Sentence-order-prediction + masked-LM samples over consecutive token spans.

    The token stream of ``doc_range`` is cut into spans of ``seq_len - 3`` tokens (room for
    ``[CLS]`` and two ``[SEP]``). With probability ``short_seq_prob`` a span is shortened, so
    padding is exercised as in BERT. A span splits at a random point into A, B; with
    probability 0.5 they are swapped (``sop_label`` 1). Then each non-special position is
    chosen with probability ``mask_prob``; of those 80% become ``[MASK]``, 10% a random
    non-special id, 10% stay. All randomness comes from ``(seed, epoch, span)``, so an index
    always yields the same sample while each epoch masks afresh.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        *,
        seed: int,
        doc_range: tuple[int, int] | None = None,
        cls_id: int,
        sep_id: int,
        mask_id: int,
        pad_id: int,
        vocab_size: int,
        mask_prob: float = 0.15,
        short_seq_prob: float = 0.1,
    ) -> None:
        self.span_len = seq_len - 3
        if self.span_len < 2:
            raise ValueError(f"seq_len {seq_len} too short: need 2 content tokens + 3 specials")
        self.seq_len = seq_len
        self.seed = seed
        self.cls_id, self.sep_id, self.mask_id, self.pad_id = cls_id, sep_id, mask_id, pad_id
        self.mask_prob = mask_prob
        self.short_seq_prob = short_seq_prob
        self.tokens = indexed.doc_range_tokens(doc_range)
        specials = {cls_id, sep_id, mask_id, pad_id, indexed.eod_id} - {None}
        self.special_ids = np.array(sorted(specials))
        # Random replacements must not forge structure, so they come from ordinary ids only.
        self.random_ids = np.setdiff1d(np.arange(vocab_size), self.special_ids)
        if len(self.tokens) < self.span_len:
            raise ValueError(
                f"documents {doc_range} hold {len(self.tokens)} tokens, "
                f"fewer than one span of seq_len - 3 = {self.span_len}"
            )
        self.shuffle = EpochShuffle(len(self.tokens) // self.span_len, seed)

    def __len__(self) -> int:
        return self.shuffle.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        epoch, span_id = self.shuffle(index)
        rng = np.random.default_rng([self.seed, epoch, span_id, SAMPLE_STREAM])
        start = span_id * self.span_len
        span = self.tokens[start : start + self.span_len].astype(np.int64)
        if rng.random() < self.short_seq_prob:
            span = span[: rng.integers(2, self.span_len + 1)]
        split = int(rng.integers(1, len(span)))
        first, second = span[:split], span[split:]
        sop_label = int(rng.random() < 0.5)
        if sop_label:
            first, second = second, first

        n_a, n_b = len(first), len(second)
        end_a, end = 2 + n_a, 3 + n_a + n_b  # one past the first [SEP]; one past the last
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[0], input_ids[1 : end_a - 1], input_ids[end_a - 1] = (
            self.cls_id,
            first,
            self.sep_id,
        )
        input_ids[end_a : end - 1], input_ids[end - 1] = second, self.sep_id
        token_type_ids = np.zeros(self.seq_len, dtype=np.int64)
        token_type_ids[end_a:end] = 1
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[:end] = 1

        input_ids, mlm_labels = self._mask(input_ids, rng)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "mlm_labels": torch.from_numpy(mlm_labels),
            "sop_label": torch.tensor(sop_label, dtype=torch.long),
        }

    def _mask(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """BERT's 80/10/10 masking of ``ids``; returns (masked ids, labels)."""
        candidates = ~np.isin(ids, self.special_ids)
        chosen = candidates & (rng.random(len(ids)) < self.mask_prob)
        labels = np.where(chosen, ids, IGNORE_INDEX)
        action = rng.random(len(ids))
        masked = ids.copy()
        masked[chosen & (action < 0.8)] = self.mask_id
        randomized = chosen & (action >= 0.8) & (action < 0.9)
        masked[randomized] = rng.choice(self.random_ids, size=int(randomized.sum()))
        return masked, labels
