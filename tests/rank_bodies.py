"""Several test bodies on one set of ranks: ``run_ranks(in_turn, world, calls)``.

Starting a rank and importing the engine in it costs a few CPU seconds, often more than a
tiny model's check; tests of one world size can share a launch (through a module-scoped
fixture) and each assert on its own body's result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def in_turn(calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """``fn(*args)`` for each ``(fn, args)`` in turn on this rank, the mesh torn down after
    each (every body builds its own); the results in the order of ``calls``."""
    import parallel_state

    out = []
    for fn, args in calls:
        out.append(fn(*args))
        parallel_state.destroy()
    return out
