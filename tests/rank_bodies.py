"""Several test bodies on one set of ranks: ``run_ranks(in_turn, world, calls)``.

Starting a rank and importing the engine in it costs a few CPU seconds, often more than a
tiny model's check; tests of one world size can share a launch (through a module-scoped
fixture) and each assert on its own body's result. ``in_turn`` returns the results in
order (a body that raises fails the launch); ``run_cases`` keeps each named body's result
or traceback apart, and ``case_result`` fails only the test whose body raised."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from tests.multiproc import RankFailure


def in_turn(calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """``fn(*args)`` for each ``(fn, args)`` in turn on this rank, the mesh torn down after
    each (every body builds its own); the results in the order of ``calls``."""
    import parallel_state

    out = []
    for fn, args in calls:
        out.append(fn(*args))
        parallel_state.destroy()
    return out


def run_cases(cases: dict[str, tuple[Callable[..., Any], tuple]]) -> dict[str, tuple[str, Any]]:
    """On each rank: ``{name: ("ok", fn(*args))}``, or ``("error", traceback)`` where the
    body raised. The mesh a body left behind is torn down before the next one starts."""
    import parallel_state

    out = {}
    for name, (fn, args) in cases.items():
        try:
            out[name] = ("ok", fn(*args))
        except Exception:  # noqa: BLE001 - reported by the test that reads this body
            out[name] = ("error", traceback.format_exc())
        finally:
            parallel_state.destroy()
    return out


def case_result(per_rank: list[dict[str, tuple[str, Any]]], name: str) -> list[Any]:
    """The results of body ``name`` by rank; RankFailure with its traceback if it raised."""
    for rank, results in enumerate(per_rank):
        status, value = results[name]
        if status == "error":
            raise RankFailure(f"{name}: rank {rank} of {len(per_rank)} failed:\n{value}")
    return [results[name][1] for results in per_rank]
