"""How ``engine.launching`` starts a self-launched run's ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter: the first launch may fork from a new forkserver; once one runs
# (started with the environment of that moment), a later launch spawns.
_PROBE = """
import multiprocessing as mp
from engine.launching import _start_method
first = _start_method()
worker = mp.get_context("forkserver").Process(target=print)
worker.start()
worker.join()
print(first, _start_method())
"""


def test_the_first_launch_forks_from_a_forkserver_and_a_later_one_spawns():
    """A forkserver keeps the environment it started with, so only a process that runs
    none yet may use it; a second launch (a sweep, a test calling main) spawns."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["forkserver", "spawn"], out.stdout
