"""Running ``tools/verify_equivalence.py --hf-dir`` as a user would, for the tests of the
transformers families that check the verifier end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.multiproc import subprocess_env

REPO = Path(__file__).resolve().parents[1]
PREFIX = "max abs logit error: "


def verify_error(hf_dir: str | Path, *flags: str, timeout: float) -> float:
    """The verifier run on ``hf_dir`` with ``flags`` in a fresh process (never one of a
    test's ranks): it must exit 0, and its last line's error is returned."""
    env = subprocess_env(REPO)
    env.pop("RANK", None)
    argv = [sys.executable, str(REPO / "tools/verify_equivalence.py"), "--hf-dir", str(hf_dir)]
    done = subprocess.run(
        [*argv, *flags],
        cwd=Path(hf_dir).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(PREFIX), last
    return float(last.removeprefix(PREFIX))
