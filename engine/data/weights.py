"""Blend weights and the train/valid/test split as numbers: parsed, checked and normalized.

A leaf (no numpy, no torch, nothing of engine.config): the config's validation checks
``data.weights`` and ``data.split`` with the same functions the data pipeline cuts and
blends with, so each rule is written once and the config does not import the datasets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SPLIT_NAMES = ("train", "valid", "test")


def normalized(weights: Sequence[float]) -> list[float]:
    """``weights`` divided by their sum; ValueError unless finite, >= 0, with a positive sum."""
    weights = [float(w) for w in weights]
    # Written so that NaN (which fails every comparison) is rejected too.
    if not weights or not all(0 <= w < math.inf for w in weights) or not sum(weights) > 0:
        raise ValueError(f"weights must be finite, >= 0, with a positive sum, got {weights}")
    total = sum(weights)
    return [w / total for w in weights]


def split_fractions(split: str | Sequence[float]) -> list[float]:
    """The train, valid and test fractions of ``split`` (Megatron's ``"949,50,1"``; ``/``
    also separates; missing parts are 0), summing to 1. ValueError, one line, if bad."""
    parts = split.replace("/", ",").split(",") if isinstance(split, str) else split
    if len(parts) > len(SPLIT_NAMES):
        raise ValueError(f"split {split!r} has more than {len(SPLIT_NAMES)} parts")
    try:
        fractions = normalized([float(p) for p in parts])
    except ValueError as e:
        raise ValueError(f"bad split {split!r}: {e}") from None
    return fractions + [0.0] * (len(SPLIT_NAMES) - len(fractions))
