"""The 2-D device mesh: tensor parallel (TP) inside a node, data parallel (DP) across nodes.

Ranks are laid out with TP varying fastest::

    grid = torch.arange(world_size).view(dp_size, tp_size)   # grid[dp_rank, tp_rank] = rank

so a TP group is a row of consecutive ranks (which launchers place on one node, over the
fast links) and a DP group is a column striding across nodes.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel_state.dims import LayoutError, ParallelDims
from parallel_state.launcher import LaunchInfo, detect_launch
from parallel_state.random import RNGTracker

__all__ = [
    "ParallelState",
    "ParallelDims",
    "LayoutError",
    "initialize",
    "get",
    "destroy",
    "LaunchInfo",
]


@dataclass(frozen=True, eq=False)
class ParallelState:
    """This rank's place in the (dp, tp) mesh, its process groups and its RNG streams."""

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    rank: int
    world_size: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device
    grid: torch.Tensor = field(repr=False)  # grid[dp_rank, tp_rank] = global rank
    rng: RNGTracker = field(repr=False)
    owns_default_group: bool = field(default=False, repr=False)

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP-rank order."""
        return self.grid[self.dp_rank].tolist()

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group, in DP-rank order."""
        return self.grid[:, self.tp_rank].tolist()

    def seed(self, seed: int) -> None:
        """Seed the replicated stream (same on all TP ranks) and this TP rank's sharded stream."""
        self.rng.seed(seed, tp_rank=self.tp_rank)


_current: ParallelState | None = None  # the default state that ``get()`` returns


def _warn_if_tp_spans_nodes(tp_size: int, local_world_size: int | None) -> None:
    if local_world_size is None or local_world_size % tp_size == 0:
        return
    warnings.warn(
        f"tp_size {tp_size} does not fit in the {local_world_size} processes of one node, so "
        "TP groups span nodes; their all-reduces cross the slower inter-node links. "
        f"Prefer a tp_size that divides {local_world_size}.",
        RuntimeWarning,
        stacklevel=3,
    )


def _pick_backend(info: LaunchInfo) -> str:
    if not torch.cuda.is_available():
        return "gloo"
    # Slurm's --gpus-per-task=1 shows each task one device while the node runs several:
    # that is one GPU per rank too. Only several ranks per visible device mean sharing.
    visible, per_node = torch.cuda.device_count(), info.local_world_size or 1
    if 1 < visible < per_node:
        warnings.warn(
            f"{per_node} ranks share {visible} visible GPUs on this node; ranks will share "
            "devices (give each rank its own GPU for speed)",
            RuntimeWarning,
            stacklevel=3,
        )
    return "nccl"


def _init_default_group(info: LaunchInfo, backend: str, timeout: datetime.timedelta) -> None:
    if info.world_size == 1:
        # A single process needs no rendezvous: a private in-memory store, no port taken.
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )


def initialize(
    tp_size: int,
    dp_size: int | str | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> ParallelState:
    """Build the (dp, tp) mesh, initializing torch.distributed from the launcher if needed.

    ``dp_size=None`` (or ``"auto"``) means world size ÷ tp_size. The sizes are checked as a
    :class:`ParallelDims` before any collective.
    The backend is NCCL when every local rank has its own CUDA device, else gloo.
    """
    global _current
    if _current is not None:
        raise RuntimeError("parallel_state is already initialized; call parallel_state.destroy()")
    info = detect_launch()
    owns = not dist.is_initialized()
    world_size = info.world_size if owns else dist.get_world_size()
    dp_size = ParallelDims.resolve(tp_size, dp_size, world_size).dp
    # A group made by someone else without a launcher (a test harness, a notebook) says
    # nothing about nodes; only a launcher's count of local processes does.
    if not (info.launcher == "none" and not owns):
        _warn_if_tp_spans_nodes(tp_size, info.local_world_size)
    if owns:
        backend = backend or _pick_backend(info)
        _init_default_group(info, backend, datetime.timedelta(seconds=timeout_s))
    backend = dist.get_backend()
    rank = dist.get_rank()
    if backend == "nccl":
        # A group made without a launcher (notebook, harness) gives no local rank: use the
        # global one, so ranks on one machine do not all pick cuda:0.
        local_rank = info.local_rank if info.launcher != "none" else rank
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    grid = torch.arange(world_size).view(dp_size, tp_size)
    tp_group = dp_group = None
    # Every rank must create every group, in the same order.
    for row in grid.tolist():
        group = dist.new_group(row)
        if rank in row:
            tp_group = group
    for col in grid.t().tolist():
        group = dist.new_group(col)
        if rank in col:
            dp_group = group

    _current = ParallelState(
        tp_size=tp_size,
        dp_size=dp_size,
        tp_rank=rank % tp_size,
        dp_rank=rank // tp_size,
        rank=rank,
        world_size=world_size,
        tp_group=tp_group,
        dp_group=dp_group,
        device=device,
        grid=grid,
        rng=RNGTracker(device),
        owns_default_group=owns,
    )
    return _current


def get() -> ParallelState:
    """The current ParallelState; raises if ``initialize`` has not been called."""
    if _current is None:
        raise RuntimeError(
            "parallel_state is not initialized: call parallel_state.initialize(tp_size, dp_size) "
            "first, or pass tp_group= explicitly"
        )
    return _current


def is_initialized() -> bool:
    """Whether ``initialize`` has been called (and not destroyed)."""
    return _current is not None


def destroy() -> None:
    """Tear down the mesh's groups, and the default group if ``initialize`` created it."""
    global _current
    if _current is None:
        return
    state, _current = _current, None
    if state.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
