"""A tensor-parallel-aware RNG tracker for dropout.

Dropout on a *replicated* activation (same values on every TP rank, e.g. after the
row-parallel all-reduce) must draw the same mask on every TP rank, or the replicas drift
apart. Dropout on a *TP-sharded* activation (e.g. attention probabilities of this rank's
heads) must draw a different mask on each rank, or the shards would share one pattern.

The default torch generator serves the replicated stream: it is seeded identically on all
TP ranks. Each named stream keeps its own generator state; ``fork(name)`` swaps that state
in for the duration of a block and saves where it got to, so the default stream is never
disturbed by sharded draws.

Each tracker has a process-wide integer ``key`` (``tracker_of(key)`` finds it again), so
that a custom op in a compiled graph, which takes no Python objects, can name the tracker
it draws from (``layers.dropout``).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

import torch

TP_SHARDED = "tp-sharded"
# Offset between the replicated seed and the sharded seeds, so no TP rank's sharded stream
# coincides with the replicated stream of the same base seed.
_SHARDED_SEED_OFFSET = 2718

_keys = itertools.count()
_trackers: weakref.WeakValueDictionary[int, RNGTracker] = weakref.WeakValueDictionary()


def tracker_of(key: int) -> RNGTracker:
    """The live tracker whose ``key`` is ``key``."""
    try:
        return _trackers[key]
    except KeyError:
        raise KeyError(f"no live RNG tracker has key {key}") from None


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG streams on one device; see the module docstring."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self.key = next(_keys)
        _trackers[self.key] = self

    def seed(self, seed: int, *, tp_rank: int) -> None:
        """Seed the replicated (default) stream with ``seed`` and the sharded one per TP rank."""
        self._states.clear()
        self.add(TP_SHARDED, seed + _SHARDED_SEED_OFFSET + tp_rank)
        torch.manual_seed(seed)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` without touching the default stream."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_state(self.device)
        torch.manual_seed(seed) if self.device.type == "cpu" else torch.cuda.manual_seed(seed)
        self._states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = TP_SHARDED) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is left as it was."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} was never seeded; call ParallelState.seed(seed) first"
            )
        saved = _get_state(self.device)
        _set_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Snapshot of every named stream and of the default one (key ``"default"``)."""
        states = {name: s.clone() for name, s in self._states.items()}
        states["default"] = _get_state(self.device)
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore a snapshot from :meth:`get_states` (recomputation, checkpoint resume)."""
        states = dict(states)
        _set_state(states.pop("default"), self.device)
        self._states = {name: s.clone() for name, s in states.items()}
