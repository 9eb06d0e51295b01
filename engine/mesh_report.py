"""What the launcher built: the mesh's process groups and where their ranks run."""

from __future__ import annotations

import socket

import torch.distributed as dist

from engine import comm
from parallel_state import HYBRID_ROLES, MESH_AXES, ParallelState
from parallel_state.launcher import detect_launch


def describe_mesh(ps: ParallelState) -> str:
    """One line naming every group of each mesh axis (pipeline and context-parallel ones
    when there are several; under HSDP the shard and replicate groups too) and the ranks
    on each host (a collective).

    The groups are read back from torch.distributed (the ranks each process group really
    holds), not recomputed from the grid, so the line shows what the launch produced.
    """
    info = detect_launch()
    shown = [a for a in reversed(MESH_AXES) if a not in ("pp", "cp") or ps.size(a) > 1]
    shown += [role for role in HYBRID_ROLES if ps.size("fsdp_replicate") > 1]
    mine = {
        "rank": dist.get_rank(),
        "launcher_rank": info.rank if info.launcher != "none" else None,
        "host": socket.gethostname(),
        **{axis: dist.get_process_group_ranks(ps.group(axis)) for axis in shown},
    }
    everyone: list[dict] = comm.all_gather_object(mine, comm.world(ps))
    hosts: dict[str, list[int]] = {}
    for r in everyone:
        hosts.setdefault(r["host"], []).append(r["rank"])
    groups = [
        f"{axis} groups {_brief([list(g) for g in sorted({tuple(r[axis]) for r in everyone})])}"
        for axis in shown
    ]
    line = f"mesh: {'  '.join(groups)}  hosts {_brief_hosts(hosts)}"
    moved = [r["rank"] for r in everyone if r["launcher_rank"] not in (None, r["rank"])]
    if moved:
        line += f"  (ranks {moved} differ from the launcher's numbering)"
    if ps.dims.sequence_parallel and ps.size("tp") == 1:  # accepted, as in a sweep over tp
        line += "  (sequence_parallel: nothing to split at tp=1)"
    return line


def _brief(groups: list[list[int]], limit: int = 8) -> str:
    """All groups of a small job; the first and last few of a large one."""
    if len(groups) <= limit:
        return str(groups)
    return f"{str(groups[:3])[:-1]}, … {groups[-1]}] ({len(groups)} groups)"


def _brief_hosts(hosts: dict[str, list[int]], limit: int = 8) -> str:
    if len(hosts) <= limit:
        return str(hosts)
    first = dict(list(hosts.items())[:3])
    return f"{str(first)[:-1]}, … }} ({len(hosts)} hosts)"
