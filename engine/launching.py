"""Start local worker processes the way ``torchrun`` would, for entry points run without one.

``python -m engine.pretrain`` and ``python -m apps.classify`` call :func:`launch_workers`
when no launcher (torchrun, srun, mpirun) started them. One node uses a standalone c10d
rendezvous on a free localhost port; several nodes use torchrun's static rendezvous: each
node runs the same command with its own ``node_rank``, and node 0's ``master_addr:port``
hosts the store.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

# "pid:start ticks" of the process whose launch_workers started this rank (Linux).
LAUNCHER_VAR = "MESHTRON_LAUNCHER"


def launch_workers(
    fn: Callable[..., Any],
    *args: Any,
    nproc_per_node: int,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    max_restarts: int = 0,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc_per_node`` processes here; return results by global rank.

    Workers get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), so
    ``parallel_state.initialize`` finds them as it would under torchrun.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if num_nodes == 1:
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=str(uuid.uuid4()))
    else:  # every node must name the same run and endpoint: nothing random here
        rdzv = dict(
            rdzv_backend="static",
            rdzv_endpoint=f"{master_addr}:{master_port}",
            run_id="meshtron",
            rdzv_configs={"rank": node_rank},
        )
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        # How often the agent looks at its workers: a finished run returns within this
        # (0.5 s before, about 0.25 s of every launch spent waiting on average).
        monitor_interval=0.1,
        start_method=_start_method(),
        **rdzv,
    )
    if max_restarts:
        # The agent otherwise shares one TCPStore across restarts, where the restarted
        # workers' gloo rendezvous reads the dead workers' stale addresses; a store per
        # attempt (hosted by the new rank 0) starts each attempt clean.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Every rank watches this process (watch_launcher): should it die without a word
    # (SIGKILL), the ranks end instead of training on, orphaned.
    os.environ[LAUNCHER_VAR] = f"{os.getpid()}:{_start_ticks(os.getpid())}"
    if config.start_method == "forkserver":
        import multiprocessing

        # torch._dynamo: every rank's first torch.optim step imports it (about 1 s).
        multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", fn.__module__])
    return elastic_launch(config, fn)(*args)


def _start_method() -> str:
    """How the workers start: ``forkserver`` when this process has not started one yet,
    else ``spawn``.

    A forkserver imports torch and the worker's module once and forks each rank from
    that, where spawn imports them again in every rank (seconds of CPU each; a tiny run
    spends most of its time there). A forkserver keeps the environment it started with,
    so a second launch from the same process (a Hydra sweep, a test calling ``main``)
    spawns, and its ranks see the environment as it is now. Where the platform has no
    forkserver, spawn.
    """
    import multiprocessing
    from multiprocessing import forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    running = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", 0)
    return "forkserver" if running is None else "spawn"


def share_cores(ps, *, max_threads: int | None = None) -> str | None:
    """Give each CPU rank its share of the cores this process may use, as torchrun does,
    unless OMP_NUM_THREADS says otherwise: oversubscribed intra-op threads spin against
    each other and can slow a step down several-fold. ``max_threads`` caps the share (a
    model whose ops are too small to gain from intra-op threads). Returns the line that
    says what was chosen (``None`` on a GPU rank). ``ps``: the rank's ParallelState."""
    import torch

    from parallel_state.launcher import detect_launch

    if ps.device.type != "cpu":
        return None
    if "OMP_NUM_THREADS" in os.environ:
        return f"threads: {torch.get_num_threads()} per rank (OMP_NUM_THREADS)"
    info = detect_launch()
    # No launcher (a test harness, a notebook): assume every rank shares this machine.
    local = ps.world_size if info.launcher == "none" else info.local_world_size or 1
    cores = usable_cores()
    share = max(1, cores // local)
    torch.set_num_threads(min(share, max_threads) if max_threads else share)
    capped = f", capped at {max_threads}" if max_threads and max_threads < share else ""
    return (
        f"threads: {torch.get_num_threads()} per rank ({cores} usable cores / {local} "
        f"rank{'s' if local > 1 else ''} on this node{capped}; OMP_NUM_THREADS=N overrides)"
    )


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a
    container's CPU limit), both of which ``os.cpu_count()`` ignores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, int(quota)) if quota else cores)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup allows (cgroup v2 ``cpu.max``, v1 ``cfs_quota_us``);
    ``None`` when unlimited or unknown."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


# Variables every rank of one job shares, and that differ between jobs, by launcher.
_JOB_IDS = {
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_ID"),
    "mpi": ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"),
    "torchrun": ("TORCHELASTIC_RUN_ID",),
}


def shared_run_dir(env: dict[str, str] | None = None) -> str | None:
    """The Hydra run directory every rank of a job started by an outside launcher (srun,
    mpirun, torchrun) uses, or ``None`` for a single process.

    Hydra's default, ``outputs/DATE/TIME``, is each process's own clock: ranks that start
    in different seconds leave one folder each, all but rank 0's holding an empty log.
    This one is named after the job instead: its launcher's job id, or, when the launcher
    gives none (torchrun without a rendezvous id), the launcher process that started this
    node's ranks (their parent, with its start time)."""
    from parallel_state.launcher import detect_launch

    env = os.environ if env is None else env
    info = detect_launch(env)
    if info.launcher == "none" or info.world_size <= 1:
        return None
    names = _JOB_IDS.get(info.launcher, ())
    parts = [env[n] for n in names if env.get(n) and env[n] != "none"]
    if info.launcher == "slurm":
        parts = parts[:2]  # the job and its step
    elif parts:
        parts = parts[:1]
    if not parts:
        parts = [f"ppid{os.getppid()}", _start_ticks(os.getppid())]
    name = "-".join(p for p in parts if p)
    return (
        f"outputs/{info.launcher}-{''.join(c if c.isalnum() or c in '.-_' else '_' for c in name)}"
    )


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, Linux), or "" when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def watch_launcher(rank: int, poll_s: float = 1.0) -> None:
    """In a rank :func:`launch_workers` started, end this process with one line once the
    process that started it is gone: killed by SIGKILL (by a user, or the out-of-memory
    killer), it can tell no rank to stop, and they would train on, orphaned. A rank that
    another launcher started (torchrun, srun, mpirun), or without /proc, watches nothing."""
    value = os.environ.get(LAUNCHER_VAR, "")
    pid, _, ticks = value.partition(":")
    if not (pid.isdigit() and ticks):
        return

    def watch() -> None:
        from engine.resilience.watchdog import EXIT_STOPPED

        while _start_ticks(int(pid)) == ticks:
            time.sleep(poll_s)
        print(
            f"rank {rank} stopped: the process that started it (pid {pid}) is gone",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_STOPPED)

    threading.Thread(target=watch, name="meshtron-launcher-watch", daemon=True).start()
