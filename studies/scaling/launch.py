"""Start one point of a study: torchrun per node, on the emulated cluster or on this host;
or, for the link sweep, its ranks directly with torchrun's rank variables."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
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


def direct_commands(
    module_argv: list[str], *, nodes: int, procs: int, node: int, master: tuple[str, int]
) -> list[tuple[list[str], dict[str, str]]]:
    """Node ``node``'s ranks started with torchrun's rank variables and no agent: for a
    module that only joins ``env://`` (the link sweep), this saves an agent process per node
    and its rendezvous. ``master``: where rank 0 hosts the store (``store_address``)."""
    ranks = {"WORLD_SIZE": str(nodes * procs), "LOCAL_WORLD_SIZE": str(procs)}
    ranks |= {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "GROUP_RANK": str(node)}
    return [
        (
            [sys.executable, *module_argv],
            ranks | {"RANK": str(node * procs + local), "LOCAL_RANK": str(local)},
        )
        for local in range(procs)
    ]


def store_address(cluster: EmulatedCluster | None, nodes: int) -> tuple[str, int]:
    """Rank 0's store: node 0's address in an emulated cluster (its own namespace, so the
    fixed port is free), else a free port on this host's loopback."""
    if cluster is not None:
        return (cluster.address(0) if nodes > 1 else "127.0.0.1"), RDZV_PORT
    return "127.0.0.1", _free_port()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    direct: bool = False,
) -> int:
    """Run ``python -m ...`` (``module_argv``) on ``nodes`` × ``procs`` ranks; its exit status.

    Every node's output goes to ``log_path``. When one node fails or the time runs out, the
    others are stopped; an exception (Ctrl-C) stops them all before it propagates.
    ``direct``: start the ranks without torchrun (see ``direct_commands``).
    """
    run_id = uuid.uuid4().hex[:8]
    master = store_address(cluster, nodes) if direct else None
    procs_list: list[subprocess.Popen] = []
    with open(log_path, "ab") as log:
        try:
            for node in range(nodes):
                if master is not None:
                    commands = direct_commands(
                        module_argv, nodes=nodes, procs=procs, node=node, master=master
                    )
                else:
                    argv = torchrun_argv(
                        module_argv,
                        nodes=nodes,
                        procs=procs,
                        node=node,
                        cluster=cluster,
                        run_id=run_id,
                        self_launching=self_launching,
                    )
                    commands = [(argv, {})]
                for argv, ranks in commands:
                    argv = argv if cluster is None else cluster.command(node, argv)
                    procs_list.append(_start(argv, log, _env(threads_per_rank) | ranks))
            return _wait_all(procs_list, timeout_s)
        finally:
            _stop(procs_list)


def _start(argv: list[str], log, env: dict[str, str]) -> subprocess.Popen:
    """One node's command (or rank's), in its own session so that it can be stopped whole."""
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


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
