"""Shared pytest setup."""

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Where a run started in the repository would write: Hydra's run directories, the default
# checkpoint root, and the run log. Tests must write to temporary directories only.
_RUN_OUTPUTS = ("outputs", "multirun", "checkpoints", "pretrain.log")

# Triton decides at import whether to interpret. Without a GPU, kernels can only run under
# its interpreter, so set it before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _own_logging():
    """A test that runs a Hydra entry point in this process leaves Hydra's job logging on
    the root logger: a file handler in that test's temporary directory, deleted after it.
    Any later test whose code logs (uvicorn, in the server's tests) would then fail on the
    missing file. Each test gets the root logger's handlers and level back as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)
    yield


def _run_outputs(root: Path) -> set[str]:
    found = set()
    for name in _RUN_OUTPUTS:
        path = root / name
        if path.is_dir():
            found |= {f"{name}/{entry}" for entry in os.listdir(path)}
        elif path.exists():
            found.add(name)
    return found


def _compiler_dirs() -> tuple[str, ...]:
    """The packages whose subprocesses are a compiler's toolchain: inductor's C++ builds,
    their loader checks and ``g++ --version`` probes, and Triton's, all started with the
    caller's working directory but writing only into their own cache folders."""
    dirs = [os.path.join(os.path.dirname(torch.__file__), "_inductor")]
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.origin:
        dirs.append(os.path.dirname(triton.origin))
    return tuple(d + os.sep for d in dirs)


COMPILER_DIRS = _compiler_dirs()


def started_by_compiler(frame=None) -> bool:
    """Whether the subprocess being started (from ``frame``, default the caller's) comes from
    torch's or Triton's compiler rather than from a test's own command."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(COMPILER_DIRS):
            return True
        frame = frame.f_back
    return False


class RepositoryGuard:
    """What a test's own commands left among a run's outputs in ``root``.

    Only a command started in ``root`` (a run's relative ``outputs/`` and ``checkpoints/``
    land in its working directory) can put them there, and only while it runs: the guard
    notes the outputs when such a command starts and again when it has ended, and blames
    the test for what appeared in between. Folders that appear at any other time, or while
    the test runs commands elsewhere only, belong to someone else (a user running the
    README's commands in the same checkout, a training run beside the suite).
    """

    # Programs a test runs to look at the machine (network namespaces, processes, the
    # repository's own history): they write no run outputs wherever they start.
    QUERIES = frozenset({"ip", "ps", "git", "tc", "ss"})

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[int, set[str]] = {}  # a command's token: the outputs at its start
        self.appeared: set[str] = set()  # outputs that appeared while a command of ours ran
        self._tokens = 0

    def command_started(self, cwd: str | os.PathLike | None, args: object = None) -> int | None:
        """A subprocess ``args`` starts in ``cwd`` (None: this process's working directory).
        Returns a token for ``command_ended`` if it can write run outputs into ``root``."""
        argv = [args] if isinstance(args, (str, os.PathLike)) else list(args or [])
        if argv and not isinstance(args, str) and Path(str(argv[0])).name in self.QUERIES:
            return None
        if Path(cwd if cwd is not None else os.getcwd()).resolve() != self.root:
            return None
        self._tokens += 1
        self.running[self._tokens] = _run_outputs(self.root)
        return self._tokens

    def command_ended(self, token: int | None) -> None:
        """The command of ``token`` has exited: what appeared since its start is the test's."""
        before = self.running.pop(token, None) if token is not None else None
        if before is not None:
            self.appeared |= _run_outputs(self.root) - before

    def blamed(self) -> list[str]:
        """Run outputs in ``root`` that the test's commands may have written (a command
        still running is charged with everything new since its start)."""
        now = _run_outputs(self.root)
        still = set().union(*(now - before for before in self.running.values()))
        return sorted((self.appeared & now) | still)


@pytest.fixture(autouse=True)
def _no_writes_into_the_repository(monkeypatch):
    """Fail a test whose commands ran in the repository and left a run's outputs there
    (Hydra run dirs, checkpoints): tests must write to temporary directories only
    (RepositoryGuard says which folders are the test's)."""
    guard = RepositoryGuard(ROOT)
    popen_init, popen_wait = subprocess.Popen.__init__, subprocess.Popen.wait

    def tracking_init(self, args, *rest, **kwargs):
        self._guard_token = (
            None if started_by_compiler() else guard.command_started(kwargs.get("cwd"), args)
        )
        try:
            popen_init(self, args, *rest, **kwargs)
        except BaseException:  # it never started (no such program, bad arguments)
            guard.command_ended(self._guard_token)
            raise

    def tracking_wait(self, *args, **kwargs):
        code = popen_wait(self, *args, **kwargs)  # raises TimeoutExpired while it runs
        guard.command_ended(getattr(self, "_guard_token", None))
        self._guard_token = None
        return code

    monkeypatch.setattr(subprocess.Popen, "__init__", tracking_init)
    monkeypatch.setattr(subprocess.Popen, "wait", tracking_wait)
    yield
    new = guard.blamed()
    assert not new, f"the test wrote into the repository: {new} (use tmp_path)"
