"""Start one point of a study: torchrun per node, on the emulated cluster or on this host."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from studies.scaling.emulated_cluster import EmulatedCluster

RDZV_PORT = 29500  # inside node 0's own namespace, so no other job competes for it


def torchrun_argv(
    module_argv: list[str],
    *,
    nodes: int,
    procs: int,
    node: int,
    cluster: EmulatedCluster | None,
    run_id: str,
    self_launching: bool = False,
) -> list[str]:
    """``torchrun`` for node ``node``: standalone on one node, c10d on node 0 otherwise.

    A ``self_launching`` module on one node (engine.pretrain starts its own workers) runs
    directly, which saves the launcher's start-up.
    """
    if nodes == 1 and self_launching:
        return [sys.executable, *module_argv]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs)]
    if cluster is None or nodes == 1:
        return [*argv, "--standalone", *module_argv]
    argv += [
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{cluster.address(0)}:{RDZV_PORT}",
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"is_host={'true' if node == 0 else 'false'}",
        "--local-addr",
        cluster.address(node),
    ]
    return [*argv, *module_argv]


def _env(threads_per_rank: int) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # One rank is one "device" of a fixed size: the same intra-op threads at every point,
    # or a 1-rank baseline would use every core and understate the speedup on a CPU.
    env["OMP_NUM_THREADS"] = str(threads_per_rank)
    return env


def run_on_nodes(
    module_argv: list[str],
    *,
    nodes: int,
    procs: int,
    cluster: EmulatedCluster | None,
    log_path: Path,
    timeout_s: float,
    threads_per_rank: int = 1,
    self_launching: bool = False,
) -> int:
    """Run ``python -m ...`` (``module_argv``) on ``nodes`` × ``procs`` ranks; its exit status.

    Every node's output goes to ``log_path``. When one node fails or the time runs out, the
    others are stopped; an exception (Ctrl-C) stops them all before it propagates.
    """
    run_id = uuid.uuid4().hex[:8]
    procs_list: list[subprocess.Popen] = []
    with open(log_path, "ab") as log:
        try:
            for node in range(nodes):
                argv = torchrun_argv(
                    module_argv,
                    nodes=nodes,
                    procs=procs,
                    node=node,
                    cluster=cluster,
                    run_id=run_id,
                    self_launching=self_launching,
                )
                if cluster is not None:
                    argv = cluster.command(node, argv)
                procs_list.append(
                    subprocess.Popen(
                        argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=_env(threads_per_rank),
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            return _wait_all(procs_list, timeout_s)
        finally:
            _stop(procs_list)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)
    return 124


def _stop(procs: list[subprocess.Popen]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + 5
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
