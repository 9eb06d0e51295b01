"""File helpers: write-to-temp-then-rename, an advisory inter-process lock, the check that
an input is a regular file (a FIFO would block its reader for ever), and a JSON object read
with its file named in any error."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

MISSING = "does not exist"
"""What :func:`file_problem` says of a path that names nothing."""


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


def _kind_problem(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "of an unknown kind")
    return f"is not a regular file ({kind})"


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as a data file (symlinks followed), or ``None`` when it is a
    regular file: :data:`MISSING`, "is a directory", "is not a regular file (a FIFO)", ..."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return MISSING
    except OSError as err:  # a symlink loop, a file where a folder should be, a name too long
        return f"cannot be opened ({err.strerror or err})"
    return _kind_problem(mode)


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """``open(path, "rb")`` for a regular file; anything else is a ``ValueError`` naming it.

    Opened non-blocking first, so a FIFO is refused at once instead of waiting for a writer,
    and checked on the open descriptor, so what is read is what was checked.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        problem = _kind_problem(os.fstat(fd).st_mode)
        if problem is not None:
            raise ValueError(f"{path} {problem}; give a data file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


class LockHeld(OSError):
    """A live process holds the :func:`pid_lock` (its PID in ``pid``, ``None`` if unrecorded)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


@contextlib.contextmanager
def pid_lock(path: str | os.PathLike) -> Iterator[int | str | None]:
    """Hold ``path`` exclusively for the ``with`` body, with this process's PID written in it.

    Raise :class:`LockHeld` while another live process holds it. The kernel drops a ``flock``
    with its process, so a file that still records a holder but is not locked was left by a
    process that died: it is taken over, and the ``with`` gets that PID (or the unreadable
    record); otherwise ``None``. The file is removed on exit.
    """
    path = Path(path)
    while True:
        handle = open(path, "a+")  # noqa: SIM115 - closed on exit
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _recorded_pid(handle)
            handle.close()
            held = pid if isinstance(pid, int) else None
            raise LockHeld(f"{path} is held by PID {pid}", held) from None
        # The holder before us removes the file on exit: our lock on its unlinked inode would
        # lock nothing, so lock again until the locked file is the one at ``path``.
        try:
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        handle.close()
    previous = _recorded_pid(handle)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    try:
        yield previous
    finally:
        path.unlink(missing_ok=True)
        handle.close()


def _recorded_pid(handle) -> int | str | None:
    handle.seek(0)
    text = handle.read(64).strip()
    if not text:
        return None
    return int(text) if text.isdigit() else repr(text)


def remove_dead_temps(path: str | os.PathLike) -> list[Path]:
    """Remove the :func:`temp_path_beside` files of ``path`` whose writer no longer runs.

    A killed writer leaves its temp file behind; the PID in its name tells whose it was, so
    a live writer's temp is never touched. Return the removed paths.
    """
    path = Path(path)
    name = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    try:
        entries = list(os.scandir(path.parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in entries:
        match = name.fullmatch(entry.name)
        if match and entry.is_file(follow_symlinks=False) and not _running(int(match[1])):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def tokenizer_file(given: str | None, recorded: str | None, where: str) -> str:
    """The tokenizer.json a tool reads: ``given`` (its ``--tokenizer``) when set, else
    ``recorded`` (the one saved with the model or its data). ValueError, in one line, when
    the one chosen is not a readable file: a ``--tokenizer`` the user named is named back."""
    if given is not None:
        problem = file_problem(given)
        if problem is not None:
            raise ValueError(f"--tokenizer {given} {problem}; give a tokenizer.json file")
        return given
    if recorded is None or file_problem(recorded) is not None:
        raise ValueError(
            f"no tokenizer for {where}: pass --tokenizer PATH (the PREFIX.tokenizer.json "
            "saved with the training data, or a tokenizer.json)"
        )
    return recorded


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in file ``path``; a one-line ValueError naming the file for anything
    else (bad JSON or UTF-8, nesting deeper than Python's parser recurses, a list at the
    top)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError
        reason = "nested too deeply" if isinstance(err, RecursionError) else err
        raise ValueError(f"{path} is not valid JSON ({reason})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, expected an object")
    return value
