"""The parallel layout as one validated value: pp × dp × cp × tp ranks, sequence parallelism
and how the data-parallel axis shards the training state.

A :class:`ParallelDims` is built once (from the config, a command line, or the launcher's
world size), checked as it is built, and then handed to whatever needs the layout: config
validation, the launcher, the verifier and :func:`parallel_state.initialize`. The rules
that tie other numbers to the layout (a batch split over DP, a sequence split over TP
under sequence parallelism, a width split over TP) are its methods, so each is written
once. Every error is one line that names the bad value and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = [
    "AUTO",
    "DP_SHARD_MODES",
    "EXPERT_ROLES",
    "HYBRID_ROLES",
    "MESH_AXES",
    "ROLES",
    "LayoutError",
    "ParallelDims",
    "resolve_dp_shard",
]

AUTO = "auto"  # dp_size=auto: world size ÷ tp_size
# The mesh's named axes, outermost first: the last varies fastest over global ranks, so
# its groups are runs of consecutive ranks (one node). TP is innermost because it talks
# every layer (inside a node, over the fastest links); DP next, its one gradient reduction
# per step crossing nodes; PP outermost, because a stage boundary moves only one
# activation per micro-batch, the least traffic, so it may take the slowest links.
# CP (context parallelism) sits between DP and TP, as in Megatron-Core (tp-cp-dp-pp):
# its ring passes every layer's keys and values, forward and backward, hidden only behind
# that layer's attention, while DP's one reduction per step overlaps the whole backward;
# so CP takes the fastest links left after TP (a node's other GPUs when tp × cp fits).
# A new axis is one more name here and one more size field on ParallelDims.
MESH_AXES = ("pp", "dp", "cp", "tp")
# The roles ranks play together, and the mesh axes each spans. Code asks the mesh for a
# role ("where are gradients reduced?"), not for an axis: a new axis changes which ranks
# answer, not the question (a context-parallel axis joins "grad" and "loss"; an expert
# axis gives expert parameters a "grad" group of their own).
# The cp ranks of one sequence hold the same weights and read the same samples (each
# takes its share of every sequence): they reduce gradients and average the loss with
# the DP replicas, but do not split the batch.
ROLES: dict[str, tuple[str, ...]] = {
    "grad": ("dp", "cp"),  # where data-parallel gradients are reduced (and DP state sharded)
    "batch": ("dp",),  # where the global batch is split: each index reads its own samples
    "loss": ("dp", "cp"),  # where per-rank metrics (loss, evaluation) are averaged
    "replica": ("dp", "cp"),  # ranks holding identical checkpoint shards (one of them writes)
}
# Expert parallelism is carved from the ranks of the "grad" role, not a mesh axis: inside
# each gradient group, ep neighbouring dp indices (dp_rank // ep alike, the ep index
# dp_rank % ep varying fastest) split the experts among themselves, so the ep all-to-alls
# stay on the closer dp links, and TP ranks hold whole experts (TP splits the dense
# layers). "expert": the ep ranks one token's experts are spread over (the dispatch
# all-to-all); "expert_grad": the ranks of a gradient group with the same ep index, which
# hold the same experts and reduce their gradients (dp ÷ ep of them).
EXPERT_ROLES = ("expert", "expert_grad")
# Hybrid sharding (HSDP, ``parallel.dp_replicate=R``) is carved from the "grad" role too:
# its dp · cp ranks, in rank order, form R replicas of dp · cp ÷ R neighbouring ranks each.
# "fsdp_shard": the ranks of one replica, over which FSDP shards parameters, gradients and
# Adam's state (neighbours, so the gathers and reduce-scatters of every layer stay on the
# closer links); "fsdp_replicate": the ranks holding the same shard in every replica
# (R of them), which all-reduce that shard's gradient once per reduce-scatter. At R 1 the
# shard group is the grad group and the replicate groups are single ranks.
HYBRID_ROLES = ("fsdp_shard", "fsdp_replicate")
FSDP_MODES = ("gradients", "full")  # the dp_shard modes FSDP2 runs (and HSDP needs)
# What the DP axis shards: nothing (replicas all-reduce gradients), Adam's state (ZeRO-1),
# also the gradients (ZeRO-2), or also the parameters between uses (ZeRO-3, FSDP2).
DP_SHARD_MODES = ("none", "optimizer", "gradients", "full")


class LayoutError(ValueError):
    """A layout that cannot run; the message is one line naming the value and the fix."""


def check_width_split(key: str, value: int, tp_size: int) -> None:
    """Raise unless ``value`` (a width split over TP, named ``key``) divides by ``tp_size``
    (a model config checks its heads and MLP columns with it, no layout needed)."""
    if value % tp_size:
        raise LayoutError(f"{key}={value} is not divisible by tp_size={tp_size}")


def resolve_dp_shard(dp_shard: str, zero1: bool) -> str:
    """The DP sharding mode of ``parallel.dp_shard`` with ``optim.distributed`` (``zero1``),
    the older spelling of ``dp_shard="optimizer"``: the one place that spelling is read."""
    if not zero1:
        return dp_shard
    if dp_shard not in ("none", "optimizer"):
        raise LayoutError(
            f"optim.distributed=true (ZeRO-1) contradicts parallel.dp_shard={dp_shard}; "
            "set one of them"
        )
    return "optimizer"


_CP_FIX = "set cp_size to the ranks splitting each sequence (1: none)"


def _product(tp: int, pp: int, cp: int) -> str:
    """``tp_size × pp_size`` (and ``× cp_size``) of the sizes past one, for messages."""
    names = ["tp_size", *(["pp_size"] if pp > 1 else []), *(["cp_size"] if cp > 1 else [])]
    return " × ".join(names)


def _check_size(name: str, value: object, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{name} must be an integer >= 1, got {value!r}; {fix}")


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks share each layer (``tp``), how many replicas train (``dp``), how
    many pipeline stages the layers are cut into (``pp``) and how many ranks split each
    sequence (``cp``, context parallelism: ring attention).

    The rank grid is ``torch.arange(world).view(pp, dp, cp, tp)``: TP varies fastest, so a
    TP group is a row of consecutive ranks, and a CP group strides by tp. ``sequence_parallel`` shards activations along
    the sequence inside TP regions; ``dp_shard`` (one of :data:`DP_SHARD_MODES`) says
    what the DP axis shards; ``ep`` how many dp ranks split each MoE layer's experts
    (:data:`EXPERT_ROLES`).
    """

    tp: int
    dp: int
    pp: int = 1
    sequence_parallel: bool = False
    dp_shard: str = "none"
    cp: int = 1
    ep: int = 1  # expert-parallel size, carved from dp (EXPERT_ROLES)
    dp_replicate: int = 1  # HSDP replicas of the FSDP shards, carved from dp (HYBRID_ROLES)

    def __post_init__(self) -> None:
        _check_size("tp_size", self.tp, "set tp_size to the ranks sharing each layer (1: none)")
        _check_size("dp_size", self.dp, "set dp_size to the model replicas, or dp_size=auto")
        _check_size("pp_size", self.pp, "set pp_size to the pipeline stages (1: none)")
        _check_size("cp_size", self.cp, _CP_FIX)
        if not isinstance(self.sequence_parallel, bool):
            raise LayoutError(f"sequence_parallel={self.sequence_parallel!r} must be true or false")
        if self.dp_shard not in DP_SHARD_MODES:
            raise LayoutError(
                f"parallel.dp_shard={self.dp_shard!r} is not one of {', '.join(DP_SHARD_MODES)}"
            )
        self._check_dp_replicate()
        self._check_ep()

    def _check_dp_replicate(self) -> None:
        """R must divide dp (each replica is dp ÷ R shards) and, past 1, hybrid sharding
        is FSDP's: it needs dp_shard gradients or full."""
        fix = "set parallel.dp_replicate to the HSDP replicas (1: none)"
        _check_size("parallel.dp_replicate", self.dp_replicate, fix)
        if self.dp % self.dp_replicate:
            raise LayoutError(
                f"parallel.dp_replicate={self.dp_replicate} does not divide dp_size={self.dp} "
                f"(each replica is dp_size ÷ dp_replicate shards); choose a dp_replicate "
                f"dividing {self.dp}"
            )
        if self.dp_replicate > 1 and self.dp_shard not in FSDP_MODES:
            raise LayoutError(
                f"parallel.dp_replicate={self.dp_replicate} replicates FSDP's shards, and "
                f"parallel.dp_shard={self.dp_shard} is not FSDP; set parallel.dp_shard=full "
                "(or gradients), or parallel.dp_replicate=1"
            )

    def _check_ep(self) -> None:
        """ep must divide dp (it is carved from it), and hybrid sharding does not yet
        replicate experts (every dp_shard mode shards them over ``expert_grad``)."""
        _check_size("ep_size", self.ep, "set ep_size to the ranks splitting the experts (1: none)")
        if self.dp % self.ep:
            raise LayoutError(
                f"ep_size={self.ep} does not divide dp_size={self.dp} (expert parallelism is "
                f"carved from the data-parallel ranks); choose an ep_size dividing {self.dp}"
            )
        if self.ep > 1 and self.dp_replicate > 1:
            raise LayoutError(
                f"ep_size={self.ep} runs with one FSDP replica, not "
                f"parallel.dp_replicate={self.dp_replicate} (hybrid sharding does not yet "
                "replicate experts); set parallel.dp_replicate=1 or ep_size=1"
            )

    @property
    def zero1(self) -> bool:
        """Whether the optimizer state, and only it, is sharded over DP (ZeRO-1)."""
        return self.dp_shard == "optimizer"

    @property
    def world(self) -> int:
        """Ranks in the job: the product of the axis sizes."""
        return math.prod(self.sizes.values())

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` in :data:`MESH_AXES` order (outermost first)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def rank_of(self, **coords: int) -> int:
        """The global rank at ``coords`` (one per axis; an axis of size 1 may be left out):
        the one rank formula of the mesh,
        ``rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank``: mixed radix
        over the axes."""
        rank = 0
        for axis, size in self.sizes.items():
            if axis not in coords and size > 1:
                raise TypeError(f"rank_of() needs the {axis} index ({axis} size {size})")
            rank = rank * size + coords.get(axis, 0)
        return rank

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of global ``rank``; the inverse of :meth:`rank_of`."""
        coords = {}
        for axis, size in reversed(self.sizes.items()):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in MESH_AXES}

    def stage(self) -> ParallelDims:
        """The layout of one pipeline stage's ranks: this one without the pp axis."""
        return dataclasses.replace(self, pp=1)

    def rank_in_stage(self, rank: int) -> int:
        """``rank``'s index among the ranks of its pipeline stage (``(dp_rank · cp +
        cp_rank) · tp + tp_rank``); with pp outermost a stage's ranks are consecutive."""
        coords = self.coords_of(rank)
        return self.stage().rank_of(**{a: i for a, i in coords.items() if a != "pp"})

    def rank_grid(self) -> list:
        """``grid[pp_rank][dp_rank][cp_rank][tp_rank]``: the global rank at every mesh
        position, nested in :data:`MESH_AXES` order."""

        def nest(axes: tuple[str, ...], coords: dict[str, int]):
            if not axes:
                return self.rank_of(**coords)
            return [nest(axes[1:], {**coords, axes[0]: i}) for i in range(self.sizes[axes[0]])]

        return nest(MESH_AXES, {})

    def axes_of(self, name: str | tuple[str, ...]) -> tuple[str, ...]:
        """The mesh axes a role (:data:`ROLES`), an axis name or a tuple of axes spans, in
        :data:`MESH_AXES` order; a one-line KeyError for an unknown name."""
        axes = ROLES.get(name, (name,)) if isinstance(name, str) else tuple(name)
        unknown = [axis for axis in axes if axis not in MESH_AXES]
        if unknown:
            raise KeyError(
                f"{unknown[0]!r} is neither a mesh axis {MESH_AXES} nor a role {tuple(ROLES)}"
            )
        return tuple(axis for axis in MESH_AXES if axis in axes)

    def live_axes(self, *names: str) -> list[str]:
        """The mesh axes the roles or axes ``names`` span that have more than one rank, in
        the order the names give them (the first spanned axis when none has): how a group
        is named to a user, so the gradient role at cp 1 reads "dp", not "dp and cp". A
        role carved from the grad ranks (:data:`EXPERT_ROLES`, :data:`HYBRID_ROLES`) is no
        axis: it is named itself, after the axes, when its groups have more than one rank
        (the ep all-to-alls of ``("grad", "expert")`` at dp 2, ep 2 read "dp and expert")."""
        carved = [n for n in names if n in EXPERT_ROLES or n in HYBRID_ROLES]
        axes = list(
            dict.fromkeys(a for name in names if name not in carved for a in self.axes_of(name))
        )
        live = [a for a in axes if self.sizes[a] > 1]
        live += [n for n in dict.fromkeys(carved) if self.size_of(n) > 1]
        return live or axes[:1] or carved[:1]

    def size_of(self, name: str | tuple[str, ...]) -> int:
        """How many ranks a group of ``name`` (a role, an axis or axes) holds."""
        if name in EXPERT_ROLES:
            return self.ep if name == "expert" else self.size_of("grad") // self.ep
        if name in HYBRID_ROLES:
            shards = self.size_of("grad") // self.dp_replicate
            return shards if name == "fsdp_shard" else self.dp_replicate
        return math.prod(self.sizes[axis] for axis in self.axes_of(name))

    def group_ranks(self, name: str | tuple[str, ...]) -> list[list[int]]:
        """Every group of ``name`` (an axis, a tuple of axes, or a role): the global ranks
        that differ only in those axes' indices, each group in rank order (for one axis:
        that axis's index order); groups ordered by their lowest rank."""
        if name in EXPERT_ROLES:
            return self._expert_groups(name)
        if name in HYBRID_ROLES:
            return self._hybrid_groups(name)
        axes = self.axes_of(name)
        groups: dict[int, list[int]] = {}
        for rank in range(self.world):
            coords = self.coords_of(rank)
            for axis in axes:
                coords[axis] = 0
            groups.setdefault(self.rank_of(**coords), []).append(rank)
        return list(groups.values())

    def ep_rank_of(self, rank: int) -> int:
        """The ep index of global ``rank`` (:data:`EXPERT_ROLES`): dp_rank % ep, the block
        of experts it holds."""
        return self.coords_of(rank)["dp"] % self.ep

    def _expert_groups(self, name: str) -> list[list[int]]:
        """The groups of an expert role (:data:`EXPERT_ROLES`), ordered as ``group_ranks``'s:
        "expert" joins the ranks that differ only in the ep index dp_rank % ep (the rest of
        dp_rank, dp_rank // ep, alike); "expert_grad" the ranks of one "grad" group that
        share the ep index."""
        grad_axes = self.axes_of("grad")
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            coords = self.coords_of(rank)
            ep_rank, block = coords["dp"] % self.ep, coords["dp"] // self.ep
            if name == "expert":
                key = (*(coords[axis] for axis in MESH_AXES if axis != "dp"), block)
            else:
                key = (*(coords[axis] for axis in MESH_AXES if axis not in grad_axes), ep_rank)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def _hybrid_groups(self, name: str) -> list[list[int]]:
        """The groups of a hybrid role (:data:`HYBRID_ROLES`), ordered as ``group_ranks``'s:
        each "grad" group's ranks (in rank order) cut into R runs of dp · cp ÷ R
        ("fsdp_shard"), or taken every (dp · cp ÷ R)-th ("fsdp_replicate")."""
        shards = self.size_of("fsdp_shard")
        groups = []
        for ranks in self.group_ranks("grad"):
            if name == "fsdp_shard":
                groups += [ranks[i : i + shards] for i in range(0, len(ranks), shards)]
            else:
                groups += [ranks[i::shards] for i in range(shards)]
        return sorted(groups)

    @classmethod
    def resolve(
        cls,
        tp: int,
        dp: int | str | None = AUTO,
        world: int | None = None,
        *,
        pp: int = 1,
        cp: int = 1,
        sequence_parallel: bool = False,
        dp_shard: str = "none",
        zero1: bool = False,
        ep: int = 1,
        dp_replicate: int = 1,
    ) -> ParallelDims:
        """The layout for ``tp``, ``dp``, ``cp`` and ``pp`` on ``world`` ranks (None: not
        launched yet).

        ``dp`` may be an integer, an integer spelled as a string (a command line), or
        ``"auto"``/None: world ÷ (tp · cp · pp), or 1 when there is no world yet (this
        process will start tp · cp · pp ranks itself). With a ``world``, pp × dp × cp × tp
        must equal it. ``zero1=True`` is the older spelling of ``dp_shard="optimizer"``;
        ``ep`` splits the experts over that many of the dp ranks (:data:`EXPERT_ROLES`);
        ``dp_replicate`` replicates FSDP's shards over that many groups of the dp ranks
        (:data:`HYBRID_ROLES`).
        """
        _check_size("tp_size", tp, "set tp_size to the ranks sharing each layer (1: none)")
        _check_size("pp_size", pp, "set pp_size to the pipeline stages (1: none)")
        _check_size("cp_size", cp, _CP_FIX)
        dp_shard = resolve_dp_shard(dp_shard, zero1)
        model = tp * pp * cp  # ranks holding one model replica
        if isinstance(dp, str) and dp != AUTO:
            try:
                dp = int(dp)
            except ValueError:
                raise LayoutError(
                    f"dp_size={dp!r} must be an integer or 'auto'; set dp_size=N or dp_size=auto "
                    "(world size ÷ tp_size)"
                ) from None
        if dp is None or dp == AUTO:
            if world is None:
                dp = 1
            elif world % model:
                sizes, which = (
                    (f"tp_size {tp}", "a tp_size")
                    if model == tp
                    else (f"{_product(tp, pp, cp)} = {model}", "sizes whose product is")
                )
                raise LayoutError(
                    f"world size {world} is not divisible by {sizes}; launch a multiple "
                    f"of {model} processes or choose {which} dividing {world}"
                )
            else:
                dp = world // model
        dims = cls(
            tp,
            dp,
            pp,
            sequence_parallel=sequence_parallel,
            dp_shard=dp_shard,
            cp=cp,
            ep=ep,
            dp_replicate=dp_replicate,
        )
        if world is not None and dims.world != world:
            product = f"tp_size × dp_size = {tp} × {dp}"
            if pp > 1 or cp > 1:
                shown = [(n, v) for n, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp))]
                shown = [(n, v) for n, v in shown if v > 1 or n in ("dp", "tp")]
                names = " × ".join(f"{n}_size" for n, _ in shown)
                product = f"{names} = {' × '.join(str(v) for _, v in shown)}"
            raise LayoutError(
                f"{product} = {dims.world} does not equal the world size "
                f"{world}; launch {dims.world} processes or change the sizes (dp_size=auto "
                "follows the world size)"
            )
        return dims

    def check_tp_divides(self, key: str, value: int) -> None:
        """Raise unless ``value`` (a width split over TP, named ``key``) divides by tp."""
        check_width_split(key, value, self.tp)

    def check_seq_len(self, seq_len: int, *, key: str = "data.seq_len") -> None:
        """Context parallelism cuts each sequence into 2 · cp equal chunks (the
        load-balanced causal layout); under sequence parallelism each TP rank then holds
        seq_len ÷ (cp · tp) positions."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise LayoutError(
                f"{key}={seq_len} is not divisible by 2 × cp_size = {2 * self.cp} (context "
                f"parallelism cuts each sequence into 2·cp equal chunks); choose a multiple "
                f"of {2 * self.cp} or another cp_size"
            )
        if self.sequence_parallel and seq_len % (self.tp * self.cp):
            if self.cp > 1:
                raise LayoutError(
                    f"{key}={seq_len} is not divisible by cp_size × tp_size = "
                    f"{self.cp * self.tp} (sequence parallelism splits each cp rank's "
                    f"share over tp); choose a multiple of {self.cp * self.tp}"
                )
            raise LayoutError(
                f"{key}={seq_len} is not divisible by tp_size={self.tp} (needed by "
                f"sequence parallelism); choose a multiple of {self.tp} or turn sequence "
                "parallelism off"
            )

    def check_batch(self, global_batch: int, micro_batch: int | None = None) -> None:
        """Global batch = micro batch × dp × accumulation steps; raise if it does not split.

        Without ``micro_batch`` the whole batch is one step of one micro-batch per DP rank
        (as the verifier runs it), so it only has to divide by dp.
        """
        if micro_batch is None:
            if global_batch % self.dp:
                raise LayoutError(
                    f"batch {global_batch} is not divisible by dp_size {self.dp}; choose a "
                    f"multiple of {self.dp} or a dp_size dividing {global_batch}"
                )
            return
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            raise LayoutError(
                f"trainer.global_batch={global_batch} is not a multiple of trainer.micro_batch "
                f"× dp_size = {micro_batch} × {self.dp} = {per_step} (global batch = micro batch "
                f"× dp × accumulation steps); set trainer.global_batch to a multiple of {per_step}"
            )
