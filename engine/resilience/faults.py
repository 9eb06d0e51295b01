"""Fault injection for the restart tests: a rank that dies on purpose, once."""

from __future__ import annotations

import os

from parallel_state import ParallelState


def fail_once_at(step: int, fail_at_step: int, directory: str, ps: ParallelState) -> None:
    """Rank 1 (rank 0 alone) exits with code 17 after step ``fail_at_step``
    (``trainer.fail_at_step``), the first time only: a marker file in ``directory`` (the
    run's checkpoint directory) remembers it. The trainer calls this before that step's
    checkpoint, so the restart must recompute from an older one."""
    if step != fail_at_step:
        return
    marker = os.path.join(directory, f".failed_at_step_{step}")
    if ps.rank == min(1, ps.world_size - 1) and not os.path.exists(marker):
        os.makedirs(directory, exist_ok=True)
        open(marker, "w").close()
        os._exit(17)
