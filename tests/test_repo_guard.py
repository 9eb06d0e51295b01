"""The repository guard of tests/conftest.py blames a test only for what its commands wrote."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import RepositoryGuard, started_by_compiler


def test_folders_made_beside_a_test_are_not_its_own(tmp_path):
    """A user's run in the checkout makes outputs/ and checkpoints/ while a test runs: not
    blamed, unless they appear while a command of the test runs in the checkout (that
    command may have written them). A query run there blames nothing."""
    (tmp_path / "outputs").mkdir()
    guard = RepositoryGuard(tmp_path)
    (tmp_path / "outputs" / "2026-11-23").mkdir()  # a README command beside the suite
    assert guard.command_started(tmp_path / "elsewhere") is None
    assert guard.command_started(tmp_path, ["ip", "netns", "list"]) is None  # a query
    quick = guard.command_started(tmp_path, [sys.executable, "-m", "tools.checkpoint"])
    guard.command_ended(quick)  # ran and exited with nothing made
    (tmp_path / "checkpoints" / "beside1").mkdir(parents=True)  # the run beside, again
    assert guard.blamed() == []

    ours = guard.command_started(tmp_path, [sys.executable, "-m", "engine.pretrain"])
    (tmp_path / "checkpoints" / "gpt_tiny_stdlib").mkdir()  # while ours runs
    (tmp_path / "outputs" / "2026-11-24").mkdir()
    guard.command_ended(ours)
    (tmp_path / "checkpoints" / "beside2").mkdir()  # after it ended
    assert guard.blamed() == ["checkpoints/gpt_tiny_stdlib", "outputs/2026-11-24"]

    (tmp_path / "outputs" / "2026-11-24").rmdir()  # the test cleaned up after itself
    assert guard.blamed() == ["checkpoints/gpt_tiny_stdlib"]
    running = guard.command_started(tmp_path, ["torchrun"])
    (tmp_path / "pretrain.log").write_text("")  # a command not waited for: charged to the end
    assert guard.blamed() == ["checkpoints/gpt_tiny_stdlib", "pretrain.log"]
    guard.command_ended(running)


def test_every_subprocess_of_a_test_is_seen():
    """During a test, subprocess.Popen (which subprocess.run and the launch helpers use)
    reports each command's working directory to the test's guard, and its end."""
    assert subprocess.Popen.__init__.__name__ == "tracking_init"
    assert subprocess.Popen.wait.__name__ == "tracking_wait"
    assert subprocess.run([sys.executable, "-c", "pass"], check=True).returncode == 0


@pytest.mark.slow
def test_the_compilers_own_commands_are_not_the_tests(tmp_path, monkeypatch):
    """torch.compile's C++ builds start g++ and a loader check in this process's working
    directory (the checkout, under pytest). Counted as the test's commands, they made every
    compile test take the blame for a run beside the suite (test_compile, under load)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # a real build
    monkeypatch.setattr(inductor_config, "compile_threads", 1)  # built in this process
    seen = []
    tracking = subprocess.Popen.__init__  # the guard's, from the autouse fixture

    def recording(self, args, *rest, **kwargs):
        seen.append((args if isinstance(args, str) else list(args), started_by_compiler()))
        tracking(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording)
    torch._dynamo.reset()
    x = torch.randn(16, dtype=torch.float32, device="cpu")
    compiled = torch.compile(lambda t: (t.sin() + 0.25).relu(), backend="inductor")
    torch.testing.assert_close(compiled(x), (x.sin() + 0.25).relu(), rtol=1e-6, atol=1e-6)
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # the test's own command
    assert seen[-1] == ([sys.executable, "-c", "pass"], False)
    builds = seen[:-1]
    assert builds, "inductor built nothing: the cache was not fresh"
    assert all(by_compiler for _, by_compiler in builds), builds
