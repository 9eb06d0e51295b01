"""The per-rank entry: what every launcher starts on each rank.

It sits above the trainer (it imports it; nothing in the trainer imports it back), so the
trainer, observability and the watchdog form no circle.
"""

from __future__ import annotations

import contextlib
import time

from engine.bootstrap import bootstrap_rank
from engine.config import Config, parallel_dims, resolve_compile
from engine.observe import console_streams
from engine.resilience.preemption import EXIT_PREEMPTED
from engine.resilience.watchdog import Watchdog, report_failure
from engine.trainer import Trainer
from parallel_state.launcher import detect_launch

__all__ = ["run_rank", "run_worker"]

PEER_LOST_LINGER_S = 1.0  # how long a rank that lost a peer waits before it exits


def run_rank(cfg: Config) -> dict:
    """One worker: train, and turn a failure into one console line and an exit status.

    It lives in an importable module (not the ``__main__`` of ``python -m engine.pretrain``)
    because the elastic launcher pickles it by name, and under another entry point (a
    Hydra launcher plugin, submitit) ``__main__`` is not this program.
    """
    try:
        return run_worker(cfg)
    except Exception as err:  # noqa: BLE001 - reported in one line, traceback in the run log
        status = report_failure(err, cfg.run_dir, detect_launch().rank)
        if getattr(err, "peer_lost", False):
            # The peer that went away is the cause: stay a moment, so a launcher watching
            # every rank (the elastic agent looks every 0.1 s) sees that one exit first
            # and names it, not this rank that only lost it.
            time.sleep(PEER_LOST_LINGER_S)
        raise SystemExit(status) from None


def run_worker(cfg: Config) -> dict:
    """Entry of every rank: build the mesh, train, tear down."""
    console_streams()  # a spawned rank's stdout is a pipe or a file, like its parent's
    threads: list[str] = []  # the core split, done once, by the bootstrap
    mesh = bootstrap_rank(
        lambda world: parallel_dims(cfg, world),
        device=cfg.trainer.device,
        rendezvous_timeout_s=cfg.trainer.rendezvous_timeout_s,
        run_dir=cfg.run_dir,
        say=lambda _, line: threads.append(line),
    )
    with mesh as ps:
        cfg.model.compile = resolve_compile(cfg, ps.dims, ps.device.type)  # None: "auto"
        watchdog = Watchdog(
            cfg.trainer.collective_timeout_s,
            startup_timeout_s=cfg.trainer.collective_startup_timeout_s,
            rank=ps.rank,
            run_dir=cfg.run_dir,
        )
        with contextlib.closing(watchdog) as watch, watch.active():
            summary = Trainer(cfg, ps, watch, threads=next(iter(threads), None)).fit()
    if summary.get("stopped_by") and detect_launch().launcher == "torchrun":
        # Exit now rather than return to torch's elastic agent: an agent that is itself
        # shutting down on the signal never collects the return value, and its worker
        # would wait for that until the agent kills it, 30 s later.
        raise SystemExit(EXIT_PREEMPTED)
    # Every rank reports a stop, so each launcher-started process can exit with its code.
    return summary if ps.rank == 0 else {k: v for k, v in summary.items() if k == "stopped_by"}
