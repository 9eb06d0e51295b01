"""Read the rank layout that a launcher (torchrun, Slurm srun, Open MPI mpirun) left in the environment."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher described it."""

    launcher: str  # "torchrun", "slurm", "mpi" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # processes on this node, when the launcher says
    master_addr: str
    master_port: int


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gpu[003-010,012],login1`` -> ``gpu003``."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, _, ranges = first.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port of a Slurm job without MASTER_PORT (as the sbatch template)."""
    return 20000 + job_id % 20000


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE looks like "4(x2)" or "4,3"; only a leading count matters here.
    raw = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    match = re.match(r"(\d+)", raw or "")
    return int(match.group(1)) if match else None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Describe the launch from ``env`` (default ``os.environ``); a bare process is rank 0 of 1."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    if not 0 <= port <= 65535:
        raise ValueError(f"environment variable MASTER_PORT={port} is not a TCP port (0 .. 65535)")
    if "RANK" in env and "WORLD_SIZE" in env:
        local_ws = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
        return LaunchInfo(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_ws,
            env.get("MASTER_ADDR", "127.0.0.1"),
            port,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
            # Jobs sharing a node (a sweep's points) need different ports; the job id is
            # known to all ranks of a job and differs between jobs.
            port = slurm_master_port(_int(env, "SLURM_JOB_ID"))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        return LaunchInfo(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            _slurm_tasks_per_node(env),
            env.get("MASTER_ADDR") or first_slurm_host(nodelist),
            port,
        )
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_ws = (
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else None
        )
        addr = env.get("MASTER_ADDR")
        if addr is None:
            if local_ws != world:
                raise ValueError(
                    "mpirun across several nodes needs MASTER_ADDR set to the host of rank 0 "
                    "(e.g. mpirun -x MASTER_ADDR=node01 ...)"
                )
            addr = "127.0.0.1"
        return LaunchInfo(
            "mpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            world,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0,
            local_ws,
            addr,
            port,
        )
    return LaunchInfo("none", 0, 1, 0, 1, "127.0.0.1", port)


def launch_env_problem(env: Mapping[str, str] | None = None) -> str | None:
    """A launcher's variable (MASTER_PORT, RANK, SLURM_NTASKS, ...) that is no number or no
    port, or an OMP_NUM_THREADS OpenMP ignores, as one line for an entry to print before
    any rank starts (else None)."""
    env = os.environ if env is None else env
    try:
        detect_launch(env)
    except ValueError as err:
        return f"{err}: set it to what the launcher means, or unset it"
    threads = env.get("OMP_NUM_THREADS")
    # OpenMP's form: a count >= 1, or a comma list of them (one per nesting level).
    if threads is not None and not re.fullmatch(r"\s*[1-9]\d*(,[1-9]\d*)*\s*", threads):
        return (
            f"environment variable OMP_NUM_THREADS={threads!r} is not a thread count "
            "(a whole number >= 1), and OpenMP would ignore it: set it to the threads each "
            "rank runs, or unset it (each CPU rank then gets its share of the cores)"
        )
    return None
