"""Runs that cannot go on stop with one line and a non-zero exit, never hang.

- :class:`Watchdog`: a thread that notices when the phase a rank is in (a step's forward
  and backward, the gradient all-reduce, a checkpoint ...) has made no progress for
  ``trainer.collective_timeout_s`` seconds, which is what a frozen or vanished peer
  looks like from the ranks waiting on it, and ends the process with one line naming
  the step, the rank and the process group (tp, dp or the world) it was waiting on.
  gloo's own timeout does not fire for a stopped peer, so nothing else would.
- A collective that fails because a peer died becomes :class:`RunStopped` naming the group.
- :func:`report_failure` is what a worker does with a failure: one line on the console,
  the traceback in the run log, and the exit status a launcher can act on.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist

EXIT_STOPPED = 3  # the run stopped itself (bad steps, a lost or frozen peer)
EXIT_FAILED = 1  # anything else went wrong in a worker


class RunStopped(RuntimeError):
    """The run cannot go on; the message is the one line a user sees.

    ``agreed``: every rank raised it at the same point, so only rank 0 prints it.
    ``peer_lost``: a peer went away first; that peer, not this rank, is the cause.
    """

    def __init__(self, message: str, *, agreed: bool = False, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.agreed, self.peer_lost = agreed, peer_lost


def run_log_path(run_dir: str) -> str:
    """The run's log file (Hydra's ``<job name>.log`` in the run directory)."""
    return os.path.join(run_dir, "pretrain.log")


def append_run_log(run_dir: str, text: str) -> None:
    """Append ``text`` to the run log (append mode: ranks and the launcher share it)."""
    try:
        with open(run_log_path(run_dir), "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError:
        pass  # the log is a convenience; the console line has been printed


def report_failure(err: BaseException, run_dir: str, rank: int) -> int:
    """Print one line for ``err`` on stderr, put its traceback in the run log; return the
    exit status (EXIT_STOPPED for RunStopped, else EXIT_FAILED)."""
    log = run_log_path(run_dir)
    if isinstance(err, RunStopped):
        line, status = str(err), EXIT_STOPPED
    else:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        line, status = (
            f"rank {rank} failed: {type(err).__name__}: {first} (traceback in {log})",
            EXIT_FAILED,
        )
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    append_run_log(run_dir, f"rank {rank}: {line}\n{trace}")
    if rank == 0 or not getattr(err, "agreed", False):
        print(line, file=sys.stderr, flush=True)
    return status


# What a collective raises when the other end went away: torch's DistError family, or
# gloo's plain RuntimeError naming its transport.
_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport")


def _gist(err: BaseException) -> str:
    """The first sentence of a gloo/NCCL error, without its source-file prefix."""
    text = (str(err).strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # "[.../pair.cc:537] "
    return text.split(". ")[0][:160]


def _lost_peer(err: RuntimeError) -> bool:
    if isinstance(err, RunStopped):
        return False
    return isinstance(err, dist.DistError) or any(m in str(err) for m in _PEER_MARKERS)


class Watchdog:
    """Ends this process when, inside :meth:`active`, the phase last :meth:`mark`-ed makes
    no progress for ``timeout_s`` seconds (each mark counts as progress).

    Until two steps past the first marked one, the limit is ``startup_timeout_s`` (None:
    ``STARTUP_FACTOR`` times ``timeout_s``): ranks start (import, build, load a checkpoint)
    at different speeds, and the first collective waits for the slowest (setting it apart
    lets a short ``timeout_s`` keep a roomy start-up). ``timeout_s <= 0`` starts no thread;
    :meth:`active` still turns a peer's death into RunStopped naming the marked phase.
    """

    STARTUP_FACTOR = 5

    def __init__(
        self,
        timeout_s: float,
        *,
        rank: int,
        run_dir: str,
        startup_timeout_s: float | None = None,
    ) -> None:
        self.timeout_s, self.rank, self.run_dir = timeout_s, rank, run_dir
        self._startup = (
            (startup_timeout_s, "trainer.collective_startup_timeout_s")
            if startup_timeout_s is not None
            else (timeout_s * self.STARTUP_FACTOR, "trainer.collective_timeout_s")
        )
        self._phase: tuple[str, int, str, list[int]] | None = None
        self._first_step: int | None = None
        self._warm = False  # past start-up: the plain timeout applies
        self._since = time.monotonic()
        self._active = False
        self._stop = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="meshtron-watchdog", daemon=True).start()

    def close(self) -> None:
        """Stop watching for good (the run is over)."""
        self._stop.set()

    def mark(self, what: str, step: int, group: str, ranks: list[int]) -> None:
        """This rank now does ``what`` of step ``step``, whose collectives wait on ``group``."""
        self._phase, self._since = (what, step, group, ranks), time.monotonic()
        if self._first_step is None:
            self._first_step = step
        self._warm = self._warm or step >= self._first_step + 2

    def describe(self) -> str:
        """The marked phase in words: 'the <what> of step N, waiting on its <group> group'."""
        if self._phase is None:
            return "start-up"
        what, step, group, ranks = self._phase
        return f"the {what} of step {step}, waiting on its {group} group (ranks {ranks})"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Watch the body; a collective failing because a peer went away becomes RunStopped."""
        self._active, self._since = True, time.monotonic()
        try:
            yield
        except RuntimeError as err:
            if not _lost_peer(err):
                raise
            raise RunStopped(
                f"rank {self.rank} lost a peer in {self.describe()}: {_gist(err)}", peer_lost=True
            ) from err
        finally:
            self._active = False

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            limit, key = (
                (self.timeout_s, "trainer.collective_timeout_s") if self._warm else self._startup
            )
            if not self._active or time.monotonic() - self._since < limit:
                continue
            line = (
                f"rank {self.rank} stopped: no progress for {limit:g} s in "
                f"{self.describe()}; a peer is frozen or gone ({key})"
            )
            main = sys._current_frames().get(threading.main_thread().ident)
            frames = "".join(traceback.format_stack(main)) if main is not None else ""
            append_run_log(self.run_dir, f"rank {self.rank}: {line}\n{frames}")
            print(line, file=sys.stderr, flush=True)
            os._exit(EXIT_STOPPED)  # the main thread is blocked in C++: only an exit ends it
