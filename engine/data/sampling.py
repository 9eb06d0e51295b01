"""Deterministic, epoch-wise shuffling of a finite sample set into an endless stream."""

from __future__ import annotations

import numpy as np

# Distinguishes the permutation stream from per-sample streams seeded from the same numbers.
_PERMUTATION_STREAM = 0
SAMPLE_STREAM = 1


class EpochShuffle:
    """Maps a global sample index to a sample of one epoch, epoch after epoch.

    Index ``i`` lies in epoch ``i // num_samples``; each epoch visits every sample once, in an
    order drawn from ``(seed, epoch)`` alone, so any index can be served without history.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"need at least one sample per epoch, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """Sample ids in the order epoch ``epoch`` visits them (a permutation)."""
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, _PERMUTATION_STREAM])
            self._cached = (epoch, rng.permutation(self.num_samples))
        return self._cached[1]

    def __call__(self, index: int) -> tuple[int, int]:
        """``(epoch, sample id)`` of global sample ``index``."""
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        epoch, position = divmod(index, self.num_samples)
        return epoch, int(self.order(epoch)[position])
