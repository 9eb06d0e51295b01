"""Stop cleanly when the scheduler or the user asks: SIGTERM, SIGUSR1 and Ctrl-C.

Slurm (``--signal=USR1@90``, ``scancel --signal=USR1``, preemption), Kubernetes (pod
eviction sends SIGTERM) and torchrun's agent all signal every rank, but not at the same
instant: one rank may see the signal a step before another. A rank therefore only
records the request in its handler; at each step boundary every rank all-reduces a one-
element flag (MAX) so that all of them stop after the same step, save one consistent
checkpoint and exit with ``EXIT_PREEMPTED``. A second Ctrl-C (a second or more after the
first) raises KeyboardInterrupt at once: checkpoints are assembled in a temporary directory and renamed when complete, so
stopping mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from engine import comm

# EX_TEMPFAIL of sysexits.h: "try again later". The sbatch template requeues on it.
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_WINDOW_S = 1.0  # a second SIGINT sooner than this is the same Ctrl-C, relayed


class StopRequests:
    """Catch stop signals for the life of a training loop and agree on the stop step.

    Use as a context manager around the loop; ``should_stop()`` at every step boundary
    is a collective (all ranks call it).
    """

    def __init__(
        self, device: torch.device, group: dist.ProcessGroup | None = None, *, announce: bool
    ) -> None:
        self.device, self.group, self.announce = device, group, announce
        self.signum: int | None = None  # the first stop signal this rank received
        self._previous: dict[int, object] = {}
        self._first_at = 0.0

    def __enter__(self) -> StopRequests:
        # Handlers can only be installed from the main thread (a notebook thread or a test
        # harness thread just runs without them).
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            # A launcher that passes the terminal's Ctrl-C on to its workers (torch's
            # elastic agent does) delivers one press twice within milliseconds; only a
            # press a moment later means "stop now".
            if now - self._first_at > REPEAT_WINDOW_S:
                raise KeyboardInterrupt
            return
        self._first_at = now
        if self.signum is None:
            self.signum = signum
            if self.announce:
                # os.write, not print: the handler may interrupt a print in progress.
                again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
                name = signal.Signals(signum).name
                os.write(2, f"\n{name}: stopping after this step{again}\n".encode())

    @property
    def name(self) -> str:
        """The received signal's name (``SIGUSR1``), or ``a peer rank's signal``."""
        return signal.Signals(self.signum).name if self.signum else "a peer rank's signal"

    def should_stop(self) -> bool:
        """True on every rank once any rank has received a stop signal (a collective)."""
        group = self.group if self.group is not None else comm.world()
        return comm.any_rank(self.signum is not None, group, self.device)
