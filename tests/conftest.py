"""Shared pytest setup."""

import os
import subprocess
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


def _run_outputs() -> set[str]:
    found = set()
    for name in _RUN_OUTPUTS:
        path = ROOT / name
        if path.is_dir():
            found |= {f"{name}/{entry}" for entry in os.listdir(path)}
        elif path.exists():
            found.add(name)
    return found


@pytest.fixture(autouse=True)
def _no_writes_into_the_repository(monkeypatch):
    """Fail a test whose commands ran in the repository and left a run's outputs there
    (Hydra run dirs, checkpoints): tests must write to temporary directories only.

    Only what the test's own commands could have written is blamed: the check applies when
    the test started a subprocess whose working directory is the repository root (where a
    run's relative ``outputs/`` and ``checkpoints/`` land). A user running the README's
    commands in the same checkout while the suite runs creates the same folders; a test
    whose commands ran in tmp dirs is not blamed for them.
    """
    ran_here = []
    popen_init = subprocess.Popen.__init__

    def tracking_init(self, args, *rest, **kwargs):
        cwd = kwargs.get("cwd")
        ran_here.append(Path(cwd if cwd is not None else os.getcwd()).resolve() == ROOT)
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", tracking_init)
    before = _run_outputs()
    yield
    if any(ran_here):
        new = _run_outputs() - before
        assert not new, f"the test wrote into the repository: {sorted(new)} (use tmp_path)"
