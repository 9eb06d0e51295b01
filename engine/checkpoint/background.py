"""Asynchronous saves (``checkpoint.async_save=true``): training goes on while a save writes.

A save is staged by every rank together on the training thread (``stage_checkpoint`` with
``copy=True``: this rank's slices copied to host memory), then written, agreed on and
committed by a thread of each rank's own, over a process group of its own (gloo), so its
agreements never interleave with training's collectives. The commit is the synchronous
save's (files fsynced into a temp directory, renamed, then ``latest`` moved), so a process
that dies mid-write leaves a temp directory that is never loaded, and a write that fails
is reported (raised) at the next save or at the end of the run: never a partial checkpoint.

One save is in flight at a time: the next save first waits for the previous one. The run
waits for the last one before it ends (``RunCheckpoints`` as a context manager).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.checkpoint.storage import CheckpointError

Write = Callable[[Callable[[str], None] | None], Path]


class BackgroundSaver:
    """Runs one staged save's ``write`` at a time on a thread; ``wait`` joins it."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.log = log
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Path | None, BaseException | None, float] | None = None
        self._step: int | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, step: int, write: Write) -> None:
        """Write the staged save of ``step`` in the background (after the previous one)."""
        self.wait()

        def run() -> None:
            start = time.perf_counter()
            try:
                self._outcome = (write(self.log), None, time.perf_counter() - start)
            except BaseException as err:  # noqa: BLE001 - raised again by wait()
                self._outcome = (None, err, time.perf_counter() - start)

        self._step, self._outcome = step, None
        # A daemon: a run that dies does not linger for its save (the temp directory it
        # leaves is never loaded; the next run's lock takeover removes it).
        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> tuple[Path, float] | None:
        """Join the save in flight: (its step directory, seconds it wrote for), None when
        none was in flight; CheckpointError if it failed."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        path, err, seconds = self._outcome or (None, RuntimeError("no outcome"), 0.0)
        if err is not None:
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(
                f"the background save of step {self._step} failed: {type(err).__name__}: {err}"
            ) from err
        return path, seconds
