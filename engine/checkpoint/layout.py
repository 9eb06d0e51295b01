"""Which region of each full-shape tensor a rank holds, and which rank writes it.

Pure functions of the tensor specs and the mesh sizes (no process groups), so the live
saver, the loader at any layout and the offline converter all cut tensors the same way.

A *box* is a list of ``(start, stop)`` pairs, one per dim, in full-tensor coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel_state.dims import ParallelDims

Box = list[tuple[int, int]]

# Tensor kinds: model parameters, optimizer state of the same shape, per-rank RNG states.
MODEL, OPTIM, RNG = "model", "optim", "rng"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as stored: its full shape, how TP splits it, and who owns per-rank data."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    kind: str  # MODEL, OPTIM or RNG
    tp_dim: int | None = None  # dim split across TP; None: replicated
    vocab_padded: bool = False  # dim 0 is the vocabulary, padded per TP size in memory
    rank: int | None = None  # RNG only: the global rank whose stream this is
    # The most blocks TP cuts dim tp_dim into (a GQA KV projection's heads); at a larger
    # TP size each block is held whole by tp_size / tp_blocks consecutive ranks. None: any.
    tp_blocks: int | None = None
    # Dim 0 is a MoE layer's experts, cut into ep whole-expert blocks over the ``expert``
    # role. Not stored: the model's parameters say it (``state.as_held_by``), so the index
    # and files of a run at ep > 1 are those of the same run at ep 1.
    experts: bool = False

    def to_json(self) -> dict:
        """The index entry."""
        out = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": self.kind,
            "tp_dim": self.tp_dim,
            "vocab_padded": self.vocab_padded,
        }
        if self.rank is not None:
            out["rank"] = self.rank
        if self.tp_blocks is not None:
            out["tp_blocks"] = self.tp_blocks
        return out

    @classmethod
    def from_json(cls, name: str, entry: dict) -> TensorSpec:
        """Inverse of :meth:`to_json`."""
        return cls(
            name,
            tuple(entry["shape"]),
            entry["dtype"],
            entry["kind"],
            entry.get("tp_dim"),
            bool(entry.get("vocab_padded")),
            entry.get("rank"),
            entry.get("tp_blocks"),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The spec's dtype as a torch.dtype."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {self.name}: unknown dtype {self.dtype!r}")
        return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def copies_at(spec: TensorSpec, tp_size: int) -> int:
    """How many consecutive TP ranks hold each block of ``spec`` at ``tp_size`` (1 unless TP
    exceeds the spec's block count)."""
    blocks = spec.tp_blocks
    if spec.tp_dim is None or blocks is None or tp_size <= blocks:
        return 1
    if tp_size % blocks:
        raise ValueError(
            f"{spec.name}: its {blocks} blocks (KV heads) and tp_size={tp_size}: one must "
            "divide the other; choose a tp_size that does"
        )
    return tp_size // blocks


def split_rows(spec: TensorSpec, tp_size: int, padded_vocab: int) -> int:
    """Rows of the TP-split dim that each TP rank holds in memory (padding included)."""
    rows = padded_vocab if spec.vocab_padded else spec.shape[spec.tp_dim]
    pieces = tp_size // copies_at(spec, tp_size)
    if rows % pieces:
        raise ValueError(
            f"{spec.name}: dim {spec.tp_dim} of size {rows} does not split over tp_size={tp_size}"
        )
    return rows // pieces


def expert_rows(spec: TensorSpec, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """The experts (dim-0 rows) of ``spec`` that ep rank ``ep_rank`` of ``ep_size`` holds:
    whole experts, rank r the r-th block (``layers.expert_parallel.expert_range``)."""
    experts = spec.shape[0]
    if experts % ep_size:
        raise ValueError(
            f"{spec.name}: its {experts} experts do not split over ep_size={ep_size}; "
            f"choose an ep_size dividing {experts}"
        )
    per_rank = experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def local_box(
    spec: TensorSpec,
    tp_rank: int,
    tp_size: int,
    padded_vocab: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> Box | None:
    """The part of the full tensor that TP rank ``tp_rank`` (ep rank ``ep_rank`` of
    ``ep_size``, for a tensor of experts) holds; None if it holds none.

    ``padded_vocab`` is the model's padded vocabulary at ``tp_size``: a vocab-padded tensor
    is padded in memory beyond its stored rows, so the last ranks' boxes are clipped (and
    may be empty: all padding).
    """
    box = [(0, n) for n in spec.shape]
    if spec.experts and ep_size > 1:
        box[0] = expert_rows(spec, ep_rank, ep_size)
    if spec.tp_dim is None:
        return box
    block, copies = split_rows(spec, tp_size, padded_vocab), copies_at(spec, tp_size)
    start = (tp_rank // copies) * block  # consecutive holders share a block (layers.gqa)
    stop = min(start + block, spec.shape[spec.tp_dim])
    if stop <= start:
        return None
    box[spec.tp_dim] = (start, stop)
    return box


def box_numel(box: Box) -> int:
    """Elements inside ``box``."""
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True)]
    return out if all(lo < hi for lo, hi in out) else None


def written_layout(tp_size: int = 1, dp_size: int = 1) -> ParallelDims:
    """The layout a checkpoint is written at when no run hands one: a lone process's
    (1 × 1), or the sizes a conversion targets."""
    return ParallelDims(tp_size, dp_size)


def assign_writers(
    specs: list[TensorSpec], stage: ParallelDims, padded_vocab: int
) -> dict[int, dict[str, Box]]:
    """{rank in the stage: {tensor name: box}}: the slices each rank of one pipeline stage
    (``stage``, the layout of its ranks) writes, each exactly once.

    A TP-split tensor's box on TP rank t is held identically by t's checkpoint replicas
    (the mesh's ``replica`` role; and, past its block count, by those of the other TP
    ranks holding the same block), and a replicated tensor by every rank, so each piece
    goes to the least-loaded rank holding it (greedy by bytes, in name order):
    deterministic, so every rank computes the same plan alone. A tensor of experts at
    ep > 1 is held in blocks by the ep ranks (each block by the ranks sharing an ep index,
    the ``expert_grad`` role), each block written once as a TP-split box is. An RNG state
    is written by the rank it belongs to.
    """
    world = stage.world
    plan: dict[int, dict[str, Box]] = {r: {} for r in range(world)}
    load = [0] * world  # bytes planned per global rank
    for spec in sorted(specs, key=lambda s: s.name):
        if spec.kind == RNG:
            plan.setdefault(spec.rank, {})[spec.name] = [(0, n) for n in spec.shape]
            continue
        if spec.experts and stage.ep > 1:  # each ep rank (and its TP rank) its own block
            by_box: dict[tuple, list[int]] = {}
            for r in range(world):
                coords = stage.coords_of(r)
                box = local_box(
                    spec, coords["tp"], stage.tp, padded_vocab, stage.ep_rank_of(r), stage.ep
                )
                by_box.setdefault(tuple(box) if box else None, []).append(r)
            holders = [(ranks, list(box) if box else None) for box, ranks in by_box.items()]
        elif spec.tp_dim is None:
            holders = [(list(range(world)), [(0, n) for n in spec.shape])]
        else:  # the DP replicas of each TP rank, from the mesh's one rank formula
            by_box: dict[tuple, list[int]] = {}  # one entry per distinct box, all its holders
            for replicas in stage.group_ranks("replica"):
                t = stage.coords_of(replicas[0])["tp"]
                box = local_box(spec, t, stage.tp, padded_vocab)
                by_box.setdefault(tuple(box) if box else None, []).extend(replicas)
            holders = [(ranks, list(box) if box else None) for box, ranks in by_box.items()]
        for ranks, box in holders:
            if box is None:
                continue
            rank = min(ranks, key=lambda r: (load[r], r))
            load[rank] += box_numel(box) * spec.torch_dtype.itemsize
            plan[rank][spec.name] = box
    return plan


def crop_local(local: torch.Tensor, box: Box) -> torch.Tensor:
    """The stored part of a rank's in-memory ``local`` tensor (drops vocabulary padding)."""
    return local[tuple(slice(0, stop - start) for start, stop in box)]
