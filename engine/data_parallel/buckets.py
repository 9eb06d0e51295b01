"""ZeRO-1's unit of communication: parameters laid end to end in flat buffers, cut into
dp equal slices (see ``engine.data_parallel.zero`` for the step they take part in)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from layers.mappings import flat_all_gather, flat_reduce_scatter  # one shim across torch versions
from layers.param_roles import counted_in_norm, has_sp_partial_grad
from layers.utils import group_rank, group_size


class ShardedBucket:
    """Parameters of one optimizer group and dtype laid end to end, cut into dp slices."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        dp_group,
        tp_rank: int,
        param_dtype,
        mean_over: int | None = None,
    ) -> None:
        self.params, self.dp_group = params, dp_group
        self.dtype = torch.promote_types(params[0].dtype, torch.float32)  # master and grads
        self.dp_size, dp_rank = group_size(dp_group), group_rank(dp_group)
        # The gradient is the mean over this many ranks' tokens: the slices' group (dense
        # parameters), or the whole gradient group for experts split over ep, which are
        # sliced over the expert-data-parallel ranks only (their gradient already sums
        # the tokens of the ep ranks: ``engine.data_parallel.zero``).
        self.mean_over = self.dp_size if mean_over is None else mean_over
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.shard_numel = -(-self.offsets[-1] // self.dp_size)
        padded, device = self.shard_numel * self.dp_size, params[0].device
        self.lo, self.hi = dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel
        param_dtype = param_dtype or params[0].dtype
        # Full-precision parameters are their own masters: the optimizer updates this
        # rank's slice of the parameter buffer in place (no second fp32 copy). Lower
        # precision ones get fp32 masters, taken before the cast.
        self.shared_master = param_dtype == self.dtype
        if not self.shared_master:
            master = self.slice(self.flatten([p.detach() for p in params])).clone()
        self.param_buffer = torch.zeros(padded, dtype=param_dtype, device=device)
        for p, view in self.views(self.param_buffer):
            view.copy_(p.detach())
            p.data = view  # the model now reads (and the all-gather writes) the buffer
        self.master = self.slice(self.param_buffer) if self.shared_master else master
        self.grad_buffer = torch.zeros(padded, dtype=self.dtype, device=device)
        self.grad_views = {id(p): v for p, v in self.views(self.grad_buffer)}
        self.pending: set[int] = set()
        self.reduce_work: dist.Work | None = None
        self.gather_work: dist.Work | None = None
        # Parts of this slice that count toward the gradient norm: TP-split parameters on
        # every TP rank, replicated ones (identical on all TP ranks) on TP rank 0 only.
        self.norm_ranges = self._ranges(lambda p: counted_in_norm(p, tp_rank))
        # Sequence-parallel parameters saw only this rank's tokens: summed over TP later.
        self.sp_ranges = self._ranges(has_sp_partial_grad, merge=True)
        self.reset()

    def _ranges(self, keep, merge: bool = False) -> list[tuple[int, int]]:
        """(start, end) within this rank's slice of the parameters ``keep`` selects; with
        ``merge`` adjacent ones joined (fewer, longer copies)."""
        bounds = zip(self.params, self.offsets, self.offsets[1:], strict=False)
        ranges: list[tuple[int, int]] = []
        for p, start, end in bounds:
            lo, hi = max(start, self.lo) - self.lo, min(end, self.hi) - self.lo
            if not keep(p) or lo >= hi:
                continue
            if merge and ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        return ranges

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}

    def zero_unwritten(self, fresh: set[int]) -> None:
        """Zero the gradient of parameters that got none since ``zero_grad`` (their part
        of the buffer still holds the last step's values)."""
        for p in self.params:
            if id(p) in fresh:
                self.grad_views[id(p)].zero_()
                fresh.discard(id(p))

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """Concatenation of ``tensors`` (None: zeros) in the master dtype, padded to dp slices."""
        flat = torch.zeros(
            self.shard_numel * self.dp_size, dtype=self.dtype, device=self.params[0].device
        )
        for t, (_, view) in zip(tensors, self.views(flat), strict=True):
            if t is not None:
                view.copy_(t)
        return flat

    def slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a flat buffer."""
        return flat[self.lo : self.hi]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's slice into a new full flat buffer (blocking)."""
        if self.dp_size == 1:
            return part
        full = part.new_empty(self.shard_numel * self.dp_size)
        flat_all_gather(full, part.contiguous(), group=self.dp_group)
        return full

    def views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its part of ``flat`` in the parameter's shape) pairs."""
        for p, start in zip(self.params, self.offsets[:-1], strict=True):
            yield p, flat[start : start + p.numel()].view(p.shape)

    def launch_reduce(self) -> dist.Work | None:
        """Average the gradient buffer over DP into this rank's slice, in place (async)."""
        if self.mean_over > 1:
            self.grad_buffer.div_(self.mean_over)
        if self.dp_size == 1:
            return None
        self.reduce_work = flat_reduce_scatter(
            self.slice(self.grad_buffer), self.grad_buffer, group=self.dp_group, async_op=True
        )
        return self.reduce_work

    def launch_gather(self) -> dist.Work | None:
        """Put the updated master slice into the parameters and all-gather them (async)."""
        if not self.shared_master:
            self.slice(self.param_buffer).copy_(self.master)
        if self.dp_size == 1:
            return None
        self.gather_work = flat_all_gather(
            self.param_buffer, self.slice(self.param_buffer), group=self.dp_group, async_op=True
        )
        return self.gather_work

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None


def cut_buckets(params: list[nn.Parameter], capacity: float) -> list[list[nn.Parameter]]:
    """Split one optimizer group into buckets: one dtype each, about ``capacity`` bytes."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed([p for p in params if p.requires_grad]):
        if not buckets or size >= capacity or p.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize
    return buckets


class BucketLauncher:
    """What GradSync and ZeRO-1 share: their groups and bucket settings, ``no_sync`` for
    gradient-accumulation micro-batches and launching complete buckets strictly in order.
    Subclasses call ``_init_settings``, set ``_syncing = True`` and ``_next_launch = 0`` and
    define ``_launch_ready``."""

    _syncing: bool
    _next_launch: int

    def _init_settings(
        self,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        bucket_size_mb: float,
        overlap: bool,
    ) -> None:
        """The settings both keep: the groups, the DP size, ``overlap`` (False: no bucket
        launches before the call that finishes the gradients, after backward), and
        ``comm_timer``, which when set is told of each collective (``launched(work)``)."""
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_size = group_size(dp_group)
        self.overlap = overlap
        self.comm_timer = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient-accumulation micro-batches)."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def _launch_in_order(self, buckets: list, launch, force: bool = False) -> None:
        """Launch ``buckets`` from ``_next_launch`` on, strictly in order, while each is
        complete (its ``pending`` set empty; every one with ``force``), calling
        ``launch(bucket)``. One order on every rank keeps the ranks' collective sequences
        identical, whatever order their backward passes finish buckets in."""
        while self._next_launch < len(buckets) and (
            force or not buckets[self._next_launch].pending
        ):
            launch(buckets[self._next_launch])
            self._next_launch += 1
