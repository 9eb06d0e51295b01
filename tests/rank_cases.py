"""Several multi-rank test bodies in one launch of the ranks.

Starting the ranks costs more than most small bodies: each rank forks, joins a gloo group
and imports ``torch._dynamo`` on its first optimizer (about 1.3 CPU seconds a rank). Tests
that need the same number of ranks can share one launch through a module-scoped fixture:
``run_cases`` runs every body in turn on each rank, keeping each one's result or
traceback apart, and ``case_result`` gives a test its own body's result, or fails it with
that body's traceback, so one broken body fails its own test, not its neighbours'.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from tests.multiproc import RankFailure


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
