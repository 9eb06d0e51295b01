"""Activation recomputation that replays the TP-aware RNG streams.

``torch.utils.checkpoint`` restores the default RNG stream before recomputing, but it
knows nothing of the tracker's named streams (the sharded dropout stream). Without them a
recomputed attention dropout would draw a different mask than the forward pass did, and
the gradients would silently belong to another network. So the tracker's states are
snapshotted at the original forward; recomputation runs from that snapshot and then puts
back whatever the streams held before it, so later draws are not perturbed.

While compiling, the snapshot cannot be traced; there the masks come from
``layers.dropout``'s op and the recomputation keeps them instead of redrawing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import parallel_state
from layers.dropout import save_dropout_masks
from parallel_state.random import RNGTracker

RECOMPUTE_MODES = ("none", "selective", "full")


def checkpointed(fn: Callable[..., Any], *args: Any, rng: RNGTracker | None) -> Any:
    """``fn(*args)`` without keeping its intermediate activations; recomputed in backward.

    ``rng`` is the tracker whose named streams ``fn`` may draw from (None: default stream
    only). Outside autograd (no grad enabled) this is a plain call.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False)
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=save_dropout_masks)
    snapshot = rng.get_states()
    calls = 0

    def replay(*inner: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the original forward: streams are already where the snapshot is
            return fn(*inner)
        before = rng.get_states()
        rng.set_states(snapshot)
        try:
            return fn(*inner)
        finally:  # also reached when checkpoint stops the recomputation early
            rng.set_states(before)

    return checkpoint(replay, *args, use_reentrant=False)


def default_rng() -> RNGTracker | None:
    """The default ParallelState's tracker, with an ImplicitStateWarning (the runtime passes
    ``rng=``); None when parallel_state is not initialized."""
    state = parallel_state.implicit("rng")
    return state.rng if state is not None else None
