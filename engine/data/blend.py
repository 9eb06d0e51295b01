"""Weighted mixing of datasets and document-range train/valid/test splits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

SPLIT_NAMES = ("train", "valid", "test")


def _normalized(weights: Sequence[float]) -> list[float]:
    weights = [float(w) for w in weights]
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    return [w / total for w in weights]


def blend_assignment(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` samples, the dataset it comes from and its index in that dataset.

    Greedy largest deficit: sample ``i`` goes to the dataset furthest below its share
    ``weight * (i + 1)``. Every prefix then stays within one sample of its target for each
    dataset it over-serves, and within ``len(weights) - 1`` for one it under-serves.
    """
    fractions = _normalized(weights)
    counts = [0] * len(fractions)
    dataset_index = np.empty(size, dtype=np.int64)
    sample_index = np.empty(size, dtype=np.int64)
    order = range(len(fractions))
    for i in range(size):
        k = max(order, key=lambda k: fractions[k] * (i + 1) - counts[k])
        dataset_index[i], sample_index[i] = k, counts[k]
        counts[k] += 1
    return dataset_index, sample_index


class BlendedDataset(Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``, deterministically.

    The k-th sample taken from a dataset is its index ``k``; the GPT/BERT datasets continue
    into later epochs past their length, so a small dataset with a large weight just repeats.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = _normalized(weights)
        self.dataset_index, self.sample_index = blend_assignment(self.weights, size)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for blend of {len(self)}")
        k = self.dataset_index[index]
        return self.datasets[k][int(self.sample_index[index])]


def split_documents(
    num_docs: int, split: str | Sequence[float] = "949,50,1"
) -> dict[str, tuple[int, int]]:
    """Cut documents ``0 .. num_docs - 1`` into contiguous train/valid/test ranges by weight.

    ``split`` is like Megatron's ``"949,50,1"`` (``/`` also separates); missing parts are 0.
    The ranges are ``(start, end)``, half-open, in order, and together cover every document.
    """
    parts = split.replace("/", ",").split(",") if isinstance(split, str) else split
    if len(parts) > len(SPLIT_NAMES):
        raise ValueError(f"split {split!r} has more than {len(SPLIT_NAMES)} parts")
    try:
        fractions = _normalized([float(p) for p in parts])
    except ValueError as e:
        raise ValueError(f"bad split {split!r}: {e}") from None
    fractions += [0.0] * (len(SPLIT_NAMES) - len(fractions))
    # Rounding cumulative (not per-part) sizes keeps every boundary within half a document
    # of exact, so no part drifts by more than one document.
    cumulative = np.cumsum(fractions[:-1]) * num_docs
    bounds = [0, *(min(num_docs, round(c)) for c in cumulative), num_docs]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}
