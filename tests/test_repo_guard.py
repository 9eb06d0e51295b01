"""The repository guard of tests/conftest.py blames a test only for what its commands wrote."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import RepositoryGuard


def test_folders_made_beside_a_test_are_not_its_own(tmp_path):
    """A user's run in the checkout makes outputs/ and checkpoints/ while a test runs only
    commands elsewhere: not blamed. The same folders after a command run in the checkout
    are: that command may have written them."""
    (tmp_path / "outputs").mkdir()
    guard = RepositoryGuard(tmp_path)
    (tmp_path / "outputs" / "2026-11-23").mkdir()  # a README command beside the suite
    (tmp_path / "checkpoints" / "gpt_tiny_stdlib").mkdir(parents=True)
    guard.command_started(tmp_path / "elsewhere")
    assert guard.blamed() == []
    guard.command_started(tmp_path, ["ip", "netns", "list"])  # a query in the checkout
    assert guard.blamed() == []
    guard.command_started(tmp_path, [sys.executable, "-m", "engine.pretrain"])
    assert guard.blamed() == ["checkpoints/gpt_tiny_stdlib", "outputs/2026-11-23"]


def test_every_subprocess_of_a_test_is_seen():
    """During a test, subprocess.Popen (which subprocess.run and the launch helpers use)
    reports each command's working directory to the test's guard."""
    assert subprocess.Popen.__init__.__name__ == "tracking_init"
    assert subprocess.run([sys.executable, "-c", "pass"], check=True).returncode == 0
