"""Joining the run's process group ends, always, within ``trainer.rendezvous_timeout_s``.

torch's TCP rendezvous can wait forever: a rank whose ``MASTER_PORT`` is held by another
program connects to it and waits for an answer that never comes, whatever timeout it was
given. Here the join runs under a timer that ends the process with one line naming the
address, the port and what to change; a join that fails early (rank 0 finds the port
taken, a peer's address is unreachable) becomes the same kind of line. torch's own C++
retry messages and stack traces go to the run log instead of the terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

from engine.resilience.watchdog import EXIT_STOPPED, RunStopped, append_run_log, run_log_path
from parallel_state.launcher import detect_launch

T = TypeVar("T")


def rendezvous(
    join: Callable[[], T],
    *,
    timeout_s: float,
    run_dir: str | None,
    key: str = "trainer.rendezvous_timeout_s",
) -> T:
    """``join()`` (which builds the process group), bounded by ``timeout_s`` seconds (the
    config ``key`` that set it is named in the line).

    A failure raises RunStopped with one line; a join still waiting at the deadline ends
    this process (exit status 3) after printing that line, since the thread waiting in
    torch's C++ cannot be interrupted. ``run_dir``: where the run log goes (None: none).
    """
    info = detect_launch()
    where = f"{info.master_addr}:{info.master_port}"
    timed_out = _timed_out(info.rank, where, timeout_s, key)
    log = run_log_path(run_dir) if run_dir is not None else None
    with _stderr_into(log) as terminal:
        timer = threading.Timer(timeout_s, _give_up, args=(terminal, run_dir, timed_out))
        timer.daemon = True
        timer.start()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                result = join()
        except Exception as err:  # noqa: BLE001 - becomes one line, the traceback in the log
            raise RunStopped(_failed(info.rank, where, err, timed_out)) from err
        finally:
            timer.cancel()
    for w in caught:  # the join's own warnings still reach the terminal
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return result


def _failed(rank: int, where: str, err: Exception, timed_out: str) -> str:
    text = str(err)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            f"rank {rank} cannot listen on {where}: the port is taken (another job, or an "
            "earlier run still running); set MASTER_PORT to a port no other job uses"
        )
    gist = (text.strip().splitlines() or [type(err).__name__])[0][:160]
    return f"{timed_out} ({gist})"


def _timed_out(rank: int, where: str, timeout_s: float, key: str) -> str:
    return (
        f"rank {rank}: no rendezvous at {where} within {timeout_s:g} s ({key}): check "
        "that every rank started and that MASTER_ADDR and MASTER_PORT name rank 0's host "
        "and a port no other job uses"
    )


def _give_up(terminal: int, run_dir: str | None, line: str) -> None:
    if run_dir is not None:
        append_run_log(run_dir, line)
    os.write(terminal, (line + "\n").encode())
    os._exit(EXIT_STOPPED)


@contextlib.contextmanager
def _stderr_into(path: str | None) -> Iterator[int]:
    """Send file descriptor 2 (where torch's C++ logs) to ``path``; yield a descriptor of
    the terminal's stderr. Without a (writable) log, stderr stays where it is."""
    sys.stderr.flush()
    terminal = os.dup(2)
    try:
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
    except OSError:
        log = None
    if log is not None:
        os.dup2(log, 2)
        os.close(log)
    try:
        yield terminal
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        os.close(terminal)
