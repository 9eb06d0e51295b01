"""Crash-safe file helpers: write-to-temp-then-rename and an advisory inter-process lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def temp_path_beside(path: str | os.PathLike) -> Path:
    """Create an empty temp file next to ``path`` and return its name.

    Same directory, so the final ``os.replace`` is an atomic rename on one filesystem; the
    leading dot and ``.tmp`` suffix keep a leftover from a killed run from looking like output.
    """
    path = Path(path)
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            # Plain open (not mkstemp) so the final file gets the usual umask permissions.
            open(tmp, "xb").close()
            return tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path to write; on success it replaces ``path``, on error it is deleted."""
    tmp = temp_path_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent) for the ``with`` body.

    The kernel drops the lock when the process dies, so a killed holder never wedges others.
    """
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
