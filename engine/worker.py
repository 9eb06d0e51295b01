"""The per-rank entry: what every launcher starts on each rank.

It sits above the trainer (it imports it; nothing in the trainer imports it back), so the
trainer, observability and the watchdog form no circle.
"""

from __future__ import annotations

from engine.config import Config
from engine.resilience.watchdog import report_failure
from engine.trainer import run_worker
from parallel_state.launcher import detect_launch

__all__ = ["run_rank"]


def run_rank(cfg: Config) -> dict:
    """One worker: train, and turn a failure into one console line and an exit status.

    It lives in an importable module (not the ``__main__`` of ``python -m engine.pretrain``)
    because the elastic launcher pickles it by name, and under another entry point (a
    Hydra launcher plugin, submitit) ``__main__`` is not this program.
    """
    try:
        return run_worker(cfg)
    except Exception as err:  # noqa: BLE001 - reported in one line, traceback in the run log
        raise SystemExit(report_failure(err, cfg.run_dir, detect_launch().rank)) from None
