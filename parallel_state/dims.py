"""The parallel layout as one validated value: tp × dp ranks, sequence parallelism, ZeRO-1.

A :class:`ParallelDims` is built once (from the config, a command line, or the launcher's
world size), checked as it is built, and then handed to whatever needs the layout: config
validation, the launcher, the verifier and :func:`parallel_state.initialize`. The rules
that tie other numbers to the layout (a batch split over DP, a sequence split over TP
under sequence parallelism, a width split over TP) are its methods, so each is written
once. Every error is one line that names the bad value and how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AUTO", "MESH_AXES", "LayoutError", "ParallelDims"]

AUTO = "auto"  # dp_size=auto: world size ÷ tp_size
# The mesh's named axes, outermost first: the last varies fastest over global ranks, so
# its groups are runs of consecutive ranks (one node). A new axis (pp, a sharded dp) is
# one more name here and one more size field on ParallelDims.
MESH_AXES = ("dp", "tp")


class LayoutError(ValueError):
    """A layout that cannot run; the message is one line naming the value and the fix."""


def _check_size(name: str, value: object, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{name} must be an integer >= 1, got {value!r}; {fix}")


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks share each layer (``tp``) and how many replicas train (``dp``).

    The rank grid is ``torch.arange(world).view(dp, tp)``: TP varies fastest, so a TP group
    is a row of consecutive ranks. ``sequence_parallel`` shards activations along the
    sequence inside TP regions; ``zero1`` shards the optimizer state across DP.
    """

    tp: int
    dp: int
    sequence_parallel: bool = False
    zero1: bool = False

    def __post_init__(self) -> None:
        _check_size("tp_size", self.tp, "set tp_size to the ranks sharing each layer (1: none)")
        _check_size("dp_size", self.dp, "set dp_size to the model replicas, or dp_size=auto")
        for name in ("sequence_parallel", "zero1"):
            if not isinstance(getattr(self, name), bool):
                raise LayoutError(f"{name}={getattr(self, name)!r} must be true or false")

    @property
    def world(self) -> int:
        """Ranks in the job: the product of the axis sizes."""
        return math.prod(self.sizes.values())

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` in :data:`MESH_AXES` order (outermost first)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def dp_sharding(self) -> str:
        """How DP replicas hold the optimizer state: ``"zero1"`` (sharded) or ``"none"``."""
        return "zero1" if self.zero1 else "none"

    def rank_of(self, **coords: int) -> int:
        """The global rank at ``coords`` (one per axis): the one rank formula of the mesh,
        ``rank = dp_rank · tp + tp_rank`` for (dp, tp), mixed radix in general."""
        rank = 0
        for axis, size in self.sizes.items():
            rank = rank * size + coords[axis]
        return rank

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of global ``rank``; the inverse of :meth:`rank_of`."""
        coords = {}
        for axis, size in reversed(self.sizes.items()):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in MESH_AXES}

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the global ranks that differ only in that axis's
        index, each group in that index's order; groups ordered by the lowest rank."""
        groups: dict[int, list[int]] = {}
        for rank in range(self.world):
            coords = self.coords_of(rank)
            coords[axis] = 0
            groups.setdefault(self.rank_of(**coords), []).append(rank)
        return list(groups.values())

    @classmethod
    def resolve(
        cls,
        tp: int,
        dp: int | str | None = AUTO,
        world: int | None = None,
        *,
        sequence_parallel: bool = False,
        zero1: bool = False,
    ) -> ParallelDims:
        """The layout for ``tp`` and ``dp`` on ``world`` ranks (None: not launched yet).

        ``dp`` may be an integer, an integer spelled as a string (a command line), or
        ``"auto"``/None: world ÷ tp, or 1 when there is no world yet (this process will
        start tp ranks itself). With a ``world``, tp × dp must equal it.
        """
        _check_size("tp_size", tp, "set tp_size to the ranks sharing each layer (1: none)")
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
            elif world % tp:
                raise LayoutError(
                    f"world size {world} is not divisible by tp_size {tp}; launch a multiple "
                    f"of {tp} processes or choose a tp_size dividing {world}"
                )
            else:
                dp = world // tp
        dims = cls(tp, dp, sequence_parallel=sequence_parallel, zero1=zero1)
        if world is not None and dims.world != world:
            raise LayoutError(
                f"tp_size × dp_size = {tp} × {dp} = {dims.world} does not equal the world size "
                f"{world}; launch {dims.world} processes or change the sizes (dp_size=auto "
                "follows the world size)"
            )
        return dims

    def check_tp_divides(self, key: str, value: int) -> None:
        """Raise unless ``value`` (a width split over TP, named ``key``) divides by tp."""
        if value % self.tp:
            raise LayoutError(f"{key}={value} is not divisible by tp_size={self.tp}")

    def check_seq_len(self, seq_len: int, *, key: str = "data.seq_len") -> None:
        """Under sequence parallelism each TP rank holds seq_len ÷ tp positions."""
        if self.sequence_parallel and seq_len % self.tp:
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
