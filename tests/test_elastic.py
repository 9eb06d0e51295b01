"""Elastic resize: two torchrun agents ("nodes") on one c10d rendezvous, --nnodes 1:2.

One node is killed (agent and worker, SIGKILL): the survivor's agent restarts its worker,
which rejoins alone and resumes at dp=1 from the last checkpoint (resharded from dp=2),
the global batch kept by accumulating twice as many micro-batches. The node comes back:
the running agent sees it waiting, restarts, and training continues at dp=2 again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest

from engine.data import build_default_corpus
from tests.launch_util import env_with_repo, free_port, tiny_overrides, wait_for


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    return build_default_corpus(
        tmp_path_factory.mktemp("corpus"), vocab_size=512, max_bytes=300_000, progress=False
    )


class Node:
    """One torchrun agent with one worker, in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], cwd, env) -> None:
        self.log = cwd / f"{name}.log"
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the agent and every process below it (torchrun puts its workers in
        sessions of their own, so the agent's process group does not reach them)."""
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _torchrun(port: int, corpus, run_dir, *, host: bool) -> list[str]:
    """One node's command line; ``host``: this node's agent serves the rendezvous store."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id",
        "elastic-test",
        "--rdzv-conf",
        # is_host names the store's host (a client waits up to read_timeout, 60 s, for it),
        # so both nodes start at once instead of one after the other. A killed node leaves
        # the rendezvous when its heartbeats stop, after keep_alive_interval ×
        # keep_alive_max_attempt s: 5 × 3 = 15 s by default, which the survivor's restart
        # waited out; 1 × 3 finds it 12 s sooner (a live agent's heartbeat thread wakes
        # every second and needs one store write).
        f"last_call_timeout=1,join_timeout=60,is_host={str(host).lower()},"
        "keep_alive_interval=1,keep_alive_max_attempt=3",
        "--max-restarts",
        "5",
        "--monitor-interval",
        "0.5",
        "-m",
        "engine.pretrain",
        "tp_size=1",
        "dp_size=auto",
        *tiny_overrides(corpus, run_dir, max_steps=100_000),
        "checkpoint.every=1",
    ]


@pytest.mark.slow
def test_dp_shrinks_when_a_node_dies_and_grows_when_it_returns(corpus, tmp_path):
    port = free_port()
    host, client = (_torchrun(port, corpus, tmp_path, host=h) for h in (True, False))
    env = env_with_repo(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    logs = lambda: "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))  # noqa: E731
    a = Node("a", host, tmp_path, env)  # it hosts the rendezvous store, so it survives
    nodes = [a]
    try:
        b = Node("b", client, tmp_path, env)
        nodes.append(b)
        wait_for(lambda: re.search(r"dp=2 .*\n(.*\n)*step\s+2/", logs()), 120, "2 steps at dp=2")
        b.kill()
        wait_for(lambda: re.search(r"dp=1 .*\n(.*\n)*step\s+\d+/", logs()), 120, "a step at dp=1")
        b2 = Node("b2", client, tmp_path, env)
        nodes.append(b2)
        wait_for(
            lambda: re.search(r"dp=1 (.*\n)+.*dp=2 .*\n(.*\n)*step\s+\d+/", logs()),
            120,
            "a step at dp=2 after the node returned",
        )
    finally:
        for node in nodes:
            node.kill(signal.SIGTERM)
        for node in nodes:
            try:
                node.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
    text = logs()
    headers = re.findall(r"global batch 8 = 2 micro × (\d) dp × (\d) accum", text)
    sizes = [int(dp) for dp, _ in headers]
    # dp 2 -> 1 -> 2, each header keeping the global batch: 2 × dp × accum = 8.
    assert re.search(r"2(, 2)*, 1(, 1)*, 2", ", ".join(map(str, sizes))), (sizes, text[-4000:])
    assert all(2 * int(dp) * int(acc) == 8 for dp, acc in headers)
    assert re.search(r"resuming from step \d+ \(.*resharded from tp=1 dp=2", text), text[-4000:]
    assert re.search(r"resuming from step \d+ \(.*resharded from tp=1 dp=1", text), text[-4000:]
