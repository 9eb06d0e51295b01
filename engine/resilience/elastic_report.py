"""What the console shows when torch's elastic agent restarts or gives up on local workers.

The agent reports through Python logging: a worker's failure (with a traceback), the
restart, the stop of the others. While :func:`reporting` is active those records go,
verbatim, to the run log only, and the console gets one line of ours per event::

    rank 1 died (exit code 17); restart 1/3 from step 20
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.checkpoint.storage import CheckpointError, read_latest, step_dirs
from engine.resilience.watchdog import append_run_log

# The agent's loggers (torch.distributed.elastic.*), the launcher API's, and the process
# spawner's ("Terminating process ... via signal SIGTERM").
_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_AGENT = "torch.distributed.elastic.agent.server.api"  # logs the restart, at INFO


def describe_exit(code: int | None) -> str:
    """'exit code 17', or 'killed by SIGKILL' for a negative (signal) status."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def resume_step(root: str | Path) -> int:
    """The step a restart resumes from: the one ``latest`` names, else the newest step
    directory, else 0."""
    root = Path(root)
    try:
        latest = read_latest(root)
    except CheckpointError:
        latest = None
    return latest if latest is not None else max(step_dirs(root), default=0)


class _Reporter(logging.Handler):
    def __init__(self, run_dir: str, resume_from: Callable[[], int]) -> None:
        super().__init__(logging.INFO)
        self.run_dir, self.resume_from = run_dir, resume_from
        self.failure: tuple[int, int | None] | None = None  # (rank, exit code) seen last
        self.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        append_run_log(self.run_dir, self.format(record))
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        # "failed (exitcode: %s) local_rank: %s ...": one node, so local rank = rank.
        if msg.startswith("failed (exitcode") and len(args) >= 2:
            self.failure = (int(args[1]), None if args[0] is None else int(args[0]))
        elif "attempts left" in msg and len(args) >= 4:
            remaining, total = int(args[2]), int(args[3])
            print(
                f"{self.who()}; restart {total - remaining + 1}/{total} from step "
                f"{self.resume_from()}",
                file=sys.stderr,
                flush=True,
            )

    def who(self) -> str:
        """'rank N died (exit code C)' for the failure seen last."""
        if self.failure is None:
            return "a worker died"
        rank, code = self.failure
        return f"rank {rank} died ({describe_exit(code)})"


@contextlib.contextmanager
def reporting(run_dir: str, resume_from: Callable[[], int]) -> Iterator[_Reporter]:
    """Route the elastic agent's log records to the run log and print our lines instead."""
    # Importing the launcher (re)sets its loggers' levels: import it first, so the levels
    # set below hold while the agent runs (else the restart record is never emitted).
    import torch.distributed.launcher.api  # noqa: F401

    handler = _Reporter(run_dir, resume_from)
    saved = []
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, logger.level))
        logger.propagate = False
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    agent = logging.getLogger(_AGENT)
    agent_level = agent.level
    agent.setLevel(logging.INFO)  # torch sets WARNING; the restart is an INFO record
    try:
        yield handler
    finally:
        agent.setLevel(agent_level)
        for logger, propagate, level in saved:
            logger.removeHandler(handler)
            logger.propagate, logger.level = propagate, level
