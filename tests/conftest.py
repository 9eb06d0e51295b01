"""Shared pytest setup."""

import importlib.util
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

    Only commands started in ``root`` (a run's relative ``outputs/`` and ``checkpoints/``
    land in its working directory) can put them there; folders that appear while a test ran
    only commands elsewhere belong to someone else, e.g. a user running the README's
    commands in the same checkout, and are not blamed on the test.
    """

    def __init__(self, root: Path) -> None:
        self.root, self.before, self.ran_in_root = root, _run_outputs(root), False

    # Programs a test runs to look at the machine (network namespaces, processes, the
    # repository's own history): they write no run outputs wherever they start.
    QUERIES = frozenset({"ip", "ps", "git", "tc", "ss"})

    def command_started(self, cwd: str | os.PathLike | None, args: object = None) -> None:
        """A subprocess ``args`` started in ``cwd`` (None: this process's working directory)."""
        argv = [args] if isinstance(args, (str, os.PathLike)) else list(args or [])
        if argv and not isinstance(args, str) and Path(str(argv[0])).name in self.QUERIES:
            return
        here = Path(cwd if cwd is not None else os.getcwd()).resolve() == self.root
        self.ran_in_root = self.ran_in_root or here

    def blamed(self) -> list[str]:
        """New run outputs in ``root`` that the test's commands may have written."""
        return sorted(_run_outputs(self.root) - self.before) if self.ran_in_root else []


@pytest.fixture(autouse=True)
def _no_writes_into_the_repository(monkeypatch):
    """Fail a test whose commands ran in the repository and left a run's outputs there
    (Hydra run dirs, checkpoints): tests must write to temporary directories only
    (RepositoryGuard says which folders are the test's)."""
    guard = RepositoryGuard(ROOT)
    popen_init = subprocess.Popen.__init__

    def tracking_init(self, args, *rest, **kwargs):
        if not started_by_compiler():
            guard.command_started(kwargs.get("cwd"), args)
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", tracking_init)
    yield
    new = guard.blamed()
    assert not new, f"the test wrote into the repository: {new} (use tmp_path)"
