"""The device mesh: tensor parallel (TP) inside a node, data parallel (DP) across nodes,
pipeline stages (PP) outermost.

Ranks are laid out with TP varying fastest::

    grid = torch.arange(world_size).view(pp_size, dp_size, tp_size)  # grid[p, d, t] = rank

so a TP group is a row of consecutive ranks (which launchers place on one node, over the
fast links), a DP group strides across nodes, and a pipeline group strides widest (a stage
boundary moves one activation per micro-batch, the least traffic of the three).
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel_state.dims import MESH_AXES, LayoutError, ParallelDims
from parallel_state.launcher import LaunchInfo, detect_launch
from parallel_state.random import RNGTracker

__all__ = [
    "ParallelState",
    "ParallelDims",
    "MESH_AXES",
    "LayoutError",
    "initialize",
    "backend_for",
    "DEVICES",
    "get",
    "implicit",
    "ImplicitStateWarning",
    "destroy",
    "LaunchInfo",
]


@dataclass(frozen=True, eq=False)
class ParallelState:
    """This rank's place in the (pp, dp, tp) mesh, its process groups and its RNG streams."""

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    rank: int
    world_size: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device
    grid: torch.Tensor = field(repr=False)  # grid[pp_rank, dp_rank, tp_rank] = global rank
    rng: RNGTracker = field(repr=False)
    owns_default_group: bool = field(default=False, repr=False)
    dims: ParallelDims | None = field(default=None, repr=False)  # the layout it was built from
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # The first and last pipeline stage of this rank's (dp, tp) column (tied embeddings'
    # gradient sum); None off those stages or without a pipeline.
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def groups(self) -> dict[str, dist.ProcessGroup]:
        """This rank's process group along each mesh axis, keyed by axis name."""
        return {axis: getattr(self, f"{axis}_group") for axis in MESH_AXES}

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP-rank order."""
        return self.grid[self.pp_rank, self.dp_rank].tolist()

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group, in DP-rank order."""
        return self.grid[self.pp_rank, :, self.tp_rank].tolist()

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline group, in stage order."""
        return self.grid[:, self.dp_rank, self.tp_rank].tolist()

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


DEVICES = ("auto", "cuda", "cpu")


def _own_gpu_per_rank(visible: int, per_node: int) -> bool:
    # Slurm's --gpus-per-task shows each task its own device(s) while the node runs
    # several tasks: every rank has a GPU of its own although it sees fewer than per_node.
    per_task = os.environ.get("SLURM_GPUS_PER_TASK", "")
    return visible >= per_node or (visible >= 1 and per_task.isdigit() and int(per_task) >= 1)


def backend_for(device: str, local_ranks: int | None, *, warn: bool = True) -> str:
    """The process-group backend for a run's ``device`` choice, with ``local_ranks``
    processes on this node (None: the launcher did not say; taken as one).

    ``"cpu"``: gloo. ``"cuda"``: NCCL, which needs a GPU per rank (NCCL refuses two ranks
    on one device), else a one-line ValueError. ``"auto"``: NCCL when every local rank can
    have a GPU of its own, else gloo on the CPU, with a warning when GPUs were there but
    too few (``warn=False``: only the launching process need say it).
    """
    if device not in DEVICES:
        raise ValueError(f"trainer.device={device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "gloo"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_node = max(1, local_ranks or 1)
    if _own_gpu_per_rank(visible, per_node):
        return "nccl" if visible else "gloo"
    if device == "cuda":
        raise ValueError(
            f"trainer.device=cuda needs a GPU per rank, but {per_node} ranks on this node see "
            f"{visible} CUDA device(s); launch at most {visible} ranks per node, or pass "
            "trainer.device=cpu (or auto)"
            if visible
            else "trainer.device=cuda, but no CUDA device is visible; pass trainer.device=cpu (or auto)"
        )
    if visible and warn:
        warnings.warn(
            f"{per_node} ranks on this node share {visible} GPU(s) and NCCL gives each rank "
            "a GPU of its own, so this run uses the CPU over gloo; launch at most "
            f"{visible} ranks per node for the GPU (trainer.device=cpu silences this)",
            RuntimeWarning,
            stacklevel=2,
        )
    return "gloo"


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
    dims: ParallelDims | int | None = None,
    dp_size: int | str | None = None,
    *,
    tp_size: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> ParallelState:
    """Build the mesh of ``dims``, initializing torch.distributed from the launcher if needed.

    ``dims`` is the run's :class:`ParallelDims` (built once, from the config), or, as the
    short form, a tp size (positional, or ``tp_size=``) with ``dp_size`` beside it (None or
    ``"auto"``: world size ÷ tp_size), checked as a ParallelDims before any collective. The
    backend is NCCL when every local rank has its own CUDA device, else gloo.
    """
    global _current
    if (dims is None) == (tp_size is None):
        raise TypeError("initialize() takes a ParallelDims or a tp size, exactly one of them")
    dims = tp_size if dims is None else dims
    if _current is not None:
        raise RuntimeError("parallel_state is already initialized; call parallel_state.destroy()")
    info = detect_launch()
    owns = not dist.is_initialized()
    world_size = info.world_size if owns else dist.get_world_size()
    if isinstance(dims, ParallelDims):
        flags = {"sequence_parallel": dims.sequence_parallel, "dp_shard": dims.dp_shard}
        dims = ParallelDims.resolve(dims.tp, dims.dp, world_size, pp=dims.pp, **flags)
    else:
        dims = ParallelDims.resolve(dims, dp_size, world_size)
    tp_size, dp_size = dims.tp, dims.dp
    # A group made by someone else without a launcher (a test harness, a notebook) says
    # nothing about nodes; only a launcher's count of local processes does.
    if not (info.launcher == "none" and not owns):
        _warn_if_tp_spans_nodes(tp_size, info.local_world_size)
    if owns:
        backend = backend or backend_for("auto", info.local_world_size, warn=info.rank == 0)
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

    grid = torch.tensor(dims.rank_grid())
    groups = {}
    # Every rank must create every group, in the same order: the innermost axis first.
    for axis in reversed(MESH_AXES):
        for ranks in dims.group_ranks(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[axis] = group
    coords = dims.coords_of(rank)
    embedding_group = None
    if dims.pp > 1:  # after the axes' groups, in the same order on every rank
        for ranks in dims.group_ranks("pp"):
            group = dist.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                embedding_group = group

    _current = ParallelState(
        tp_size=tp_size,
        dp_size=dp_size,
        tp_rank=coords["tp"],
        dp_rank=coords["dp"],
        rank=rank,
        world_size=world_size,
        tp_group=groups["tp"],
        dp_group=groups["dp"],
        device=device,
        grid=grid,
        rng=RNGTracker(device),
        owns_default_group=owns,
        dims=dims,
        pp_size=dims.pp,
        pp_rank=coords["pp"],
        pp_group=groups["pp"],
        embedding_group=embedding_group,
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


class ImplicitStateWarning(UserWarning):
    """Code reached the default ParallelState instead of being handed its group or RNG."""


def implicit(what: str) -> ParallelState | None:
    """The default state, for code that was not handed ``what`` (None when there is none).

    The runtime passes its state explicitly (``build_model(cfg, state)``, ``tp_group=``);
    this fallback keeps a notebook's or a test's short form working, and warns (as
    Megatron-Core does) so that a missing argument in the runtime does not go unseen.
    """
    if _current is None:
        return None
    warnings.warn(
        f"{what} was not passed, so the default ParallelState's is used; pass it "
        "explicitly (build_model(cfg, state), tp_group=, rng=)",
        ImplicitStateWarning,
        stacklevel=3,
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
