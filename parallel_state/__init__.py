"""The device mesh: tensor parallel (TP) inside a node, context parallel (CP) next, data
parallel (DP) across nodes, pipeline stages (PP) outermost.

Ranks are laid out with TP varying fastest::

    grid = torch.arange(world_size).view(pp_size, dp_size, cp_size, tp_size)  # [p, d, c, t]

so a TP group is a row of consecutive ranks (which launchers place on one node, over the
fast links), a CP group strides by tp, a DP group strides across nodes, and a pipeline
group strides widest (a stage boundary moves one activation per micro-batch, the least
traffic of them all).
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel_state.dims import (
    EXPERT_ROLES,
    HYBRID_ROLES,
    MESH_AXES,
    ROLES,
    LayoutError,
    ParallelDims,
)
from parallel_state.launcher import LaunchInfo, detect_launch
from parallel_state.random import RNGTracker

__all__ = [
    "ParallelState",
    "ParallelDims",
    "MESH_AXES",
    "ROLES",
    "EXPERT_ROLES",
    "HYBRID_ROLES",
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
    """This rank's place in the mesh of ``dims``: its index along each axis, its process
    groups keyed by axis and by role, its device and its RNG streams.

    Code asks by role what it means (:data:`ROLES`): ``ps.group("grad")`` where gradients
    are reduced, ``ps.rank_in("batch")``/``ps.size("batch")`` which part of the data this
    rank reads, ``ps.group("loss")`` where metrics are averaged, ``ps.ranks("replica")``
    who holds the same checkpoint shard, ``ps.group("embedding")`` the first and last
    pipeline stage (tied embeddings; None elsewhere), ``ps.group("expert")`` the ranks
    splitting the experts (the MoE all-to-all) and ``ps.group("expert_grad")`` those holding
    the same experts (their gradients' reduction; :data:`EXPERT_ROLES`), ``ps.group(
    "fsdp_shard")`` the ranks FSDP shards over and ``ps.group("fsdp_replicate")`` those
    holding the same shard in the other HSDP replicas (:data:`HYBRID_ROLES`). An axis name
    (``"tp"``) answers too.
    """

    dims: ParallelDims
    rank: int
    coords: dict[str, int]  # this rank's index along each mesh axis
    groups: dict[str, dist.ProcessGroup | None] = field(repr=False)  # by axis and by role
    device: torch.device
    grid: torch.Tensor = field(repr=False)  # grid[pp_rank, dp_rank, cp_rank, tp_rank] = rank
    rng: RNGTracker = field(repr=False)
    owns_default_group: bool = field(default=False, repr=False)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of role or axis ``name`` that holds this rank."""
        if name not in self.groups:
            raise KeyError(
                f"{name!r} is neither a mesh axis {MESH_AXES} nor a role "
                f"{(*ROLES, *EXPERT_ROLES, *HYBRID_ROLES, 'embedding')}"
            )
        return self.groups[name]

    def size(self, name: str) -> int:
        """How many ranks a group of role or axis ``name`` holds."""
        return self.dims.size_of(name)

    def rank_in(self, name: str) -> int:
        """This rank's index in its group of role or axis ``name`` (outer axes vary slowest)."""
        if name in EXPERT_ROLES or name in HYBRID_ROLES:
            return self.ranks(name).index(self.rank)
        index = 0
        for axis in self.dims.axes_of(name):
            index = index * self.dims.sizes[axis] + self.coords[axis]
        return index

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group of role or axis ``name``, in rank order
        (``"embedding"``: its pipeline's first and last stage, [] off those stages)."""
        if name == "embedding":
            ends = sorted({self.ranks("pp")[0], self.ranks("pp")[-1]})
            return ends if self.dims.pp > 1 and self.rank in ends else []
        return next(g for g in self.dims.group_ranks(name) if self.rank in g)

    @property
    def world_size(self) -> int:
        return self.dims.world

    # The axes' sizes, indices and groups by their short names (tests, the layers' API).
    tp_size = property(lambda self: self.dims.tp)
    dp_size = property(lambda self: self.dims.dp)
    pp_size = property(lambda self: self.dims.pp)
    cp_size = property(lambda self: self.dims.cp)
    tp_rank = property(lambda self: self.coords["tp"])
    dp_rank = property(lambda self: self.coords["dp"])
    pp_rank = property(lambda self: self.coords["pp"])
    cp_rank = property(lambda self: self.coords["cp"])
    tp_group = property(lambda self: self.groups["tp"])
    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    cp_group = property(lambda self: self.groups["cp"])
    embedding_group = property(lambda self: self.groups["embedding"])
    tp_ranks = property(lambda self: self.ranks("tp"))
    dp_ranks = property(lambda self: self.ranks("dp"))
    pp_ranks = property(lambda self: self.ranks("pp"))

    def seed(self, seed: int) -> None:
        """Seed the replicated stream (same on all TP ranks) and this TP rank's sharded stream."""
        self.rng.seed(seed, tp_rank=self.tp_rank)

    def __enter__(self) -> ParallelState:
        """``with bootstrap_rank(...) as ps:``: the mesh is torn down when the block ends,
        however it ends."""
        return self

    def __exit__(self, *exc) -> None:
        if _current is self:
            destroy()


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
    """Build the mesh of ``dims`` (the run's :class:`ParallelDims`, built once from its
    config), initializing torch.distributed from the launcher if needed.

    The short form for notebooks and tests, ``initialize(tp_size, dp_size)`` (or
    ``tp_size=``; ``dp_size`` None or ``"auto"``: world size ÷ tp_size), builds that
    ParallelDims for the world size and goes the same way. The backend is NCCL when every
    local rank has its own CUDA device, else gloo.
    """
    if (dims is None) == (tp_size is None):
        raise TypeError("initialize() takes a ParallelDims or a tp size, exactly one of them")
    if _current is not None:
        raise RuntimeError("parallel_state is already initialized; call parallel_state.destroy()")
    info = detect_launch()
    owns = not dist.is_initialized()
    world_size = info.world_size if owns else dist.get_world_size()
    if not isinstance(dims, ParallelDims):
        dims = ParallelDims.resolve(tp_size if dims is None else dims, dp_size, world_size)
    elif dims.world != world_size:
        sizes = " × ".join(str(n) for n in dims.sizes.values())
        raise LayoutError(
            f"the layout {' × '.join(MESH_AXES)} = {sizes} = {dims.world} does "
            f"not equal the world size {world_size}; launch {dims.world} processes"
        )
    return _build_state(dims, info, owns, backend, timeout_s)


def _build_state(
    dims: ParallelDims, info: LaunchInfo, owns: bool, backend: str | None, timeout_s: float
) -> ParallelState:
    global _current
    # A group made by someone else without a launcher (a test harness, a notebook) says
    # nothing about nodes; only a launcher's count of local processes does.
    if not (info.launcher == "none" and not owns):
        _warn_if_tp_spans_nodes(dims.tp, info.local_world_size)
    if owns:
        backend = backend or backend_for("auto", info.local_world_size, warn=info.rank == 0)
        _init_default_group(info, backend, datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    if dist.get_backend() == "nccl":
        # A group made without a launcher (notebook, harness) gives no local rank: use the
        # global one, so ranks on one machine do not all pick cuda:0.
        local_rank = info.local_rank if info.launcher != "none" else rank
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _current = ParallelState(
        dims=dims,
        rank=rank,
        coords=dims.coords_of(rank),
        groups=_new_groups(dims, rank),
        device=device,
        grid=torch.tensor(dims.rank_grid()),
        rng=RNGTracker(device),
        owns_default_group=owns,
    )
    return _current


def _new_groups(dims: ParallelDims, rank: int) -> dict[str, dist.ProcessGroup | None]:
    """This rank's group of every axis and role (and the embedding group). Every rank
    creates every group, in the same order: the axes innermost first, then the roles that
    span several axes, then the expert roles, then the hybrid-sharding roles, then the
    pipeline's first-and-last-stage pairs."""
    groups: dict[str, dist.ProcessGroup | None] = {}
    # Keyed by the partition of the ranks, so a role whose extra axes have size 1 (grad
    # over dp x cp at cp 1), or an expert role at ep 1, is the very group it equals.
    made: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}
    for name in (*reversed(MESH_AXES), *ROLES, *EXPERT_ROLES, *HYBRID_ROLES):
        partition = tuple(tuple(ranks) for ranks in dims.group_ranks(name))
        if partition not in made:
            for ranks in partition:
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    made[partition] = group
        groups[name] = made[partition]
    groups["embedding"] = None
    if dims.pp > 1:
        for ranks in dims.group_ranks("pp"):
            group = dist.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                groups["embedding"] = group
    return groups


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
