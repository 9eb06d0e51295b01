"""Weighted mixing of datasets and document-range train/valid/test splits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from engine.data.weights import SPLIT_NAMES, normalized, split_fractions

# Assignment is computed lazily in blocks: a blend laid out for millions of samples costs
# only the samples actually drawn (about a microsecond each).
_BLOCK = 1 << 14


def _largest_deficit_blocks(fractions: list[float]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (dataset, index in dataset) assignment, ``_BLOCK`` samples per yield."""
    counts = [0] * len(fractions)
    drawn = 0
    while True:
        which, index = [], []
        for _ in range(_BLOCK):
            drawn += 1
            deficits = [f * drawn - c for f, c in zip(fractions, counts, strict=True)]
            k = deficits.index(max(deficits))  # ties go to the lowest k: deterministic
            which.append(k)
            index.append(counts[k])
            counts[k] += 1
        yield np.array(which, dtype=np.int64), np.array(index, dtype=np.int64)


def blend_assignment(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` samples, the dataset it comes from and its index in that dataset.

    Greedy largest deficit: sample ``n`` (1-based) goes to the dataset furthest below its share
    ``weight * n``. Every prefix then stays less than one sample ahead of its target for each
    dataset, and less than ``len(weights) - 1`` behind.
    """
    blocks = _largest_deficit_blocks(normalized(weights))
    parts = [next(blocks) for _ in range(-(-size // _BLOCK))]
    which = np.concatenate([w for w, _ in parts] or [np.empty(0, np.int64)])
    index = np.concatenate([i for _, i in parts] or [np.empty(0, np.int64)])
    return which[:size], index[:size]


class BlendedDataset(Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``, deterministically.

    Uses :func:`blend_assignment`'s order. The k-th sample taken from a dataset is its index
    ``k``; the GPT/BERT datasets continue into later epochs past their length, so a small
    dataset with a large weight just repeats.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalized(weights)
        self.size = size
        self._blocks = _largest_deficit_blocks(self.weights)
        self._assigned: list[tuple[np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        return self.size

    def source(self, index: int) -> tuple[int, int]:
        """``(dataset, index in that dataset)`` of blended sample ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for blend of {self.size}")
        block, offset = divmod(index, _BLOCK)
        while len(self._assigned) <= block:
            self._assigned.append(next(self._blocks))
        which, sample = self._assigned[block]
        return int(which[offset]), int(sample[offset])

    def __getitem__(self, index: int) -> Any:
        k, sample = self.source(index)
        return self.datasets[k][sample]


def split_documents(
    num_docs: int, split: str | Sequence[float] = "949,50,1"
) -> dict[str, tuple[int, int]]:
    """Cut documents ``0 .. num_docs - 1`` into contiguous train/valid/test ranges by weight.

    ``split`` is like Megatron's ``"949,50,1"`` (``/`` also separates); missing parts are 0.
    The ranges are ``(start, end)``, half-open, in order, and together cover every document.
    """
    fractions = split_fractions(split)
    # Rounding cumulative (not per-part) sizes keeps every boundary within half a document
    # of exact, so no part drifts by more than one document.
    cumulative = np.cumsum(fractions[:-1]) * num_docs
    bounds = [0, *(min(num_docs, round(c)) for c in cumulative), num_docs]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}
