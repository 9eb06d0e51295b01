"""Data-parallel gradient averaging with bucketed all-reduces that overlap the backward pass.

Parameters are first grouped into buckets in *reverse* registration order, which
approximates the order in which backward produces their gradients. The first synchronized
backward records the real order (rank 0's, broadcast so every rank agrees), and the
buckets are rebuilt from it, so unused or out-of-order parameters stop stalling overlap. A post-accumulate-grad hook marks
each parameter ready; when a bucket is complete (and every earlier bucket has been
launched, so all ranks issue collectives in the same order) its gradients are flattened
into one buffer, pre-divided by the DP size and all-reduced asynchronously while
backward continues with earlier layers. ``finish()`` waits and copies the averages back.

With sequence parallelism some replicated parameters (norm weights, row-parallel biases)
see only this rank's sequence shard, so their gradients are partial across TP: they are
marked in ``layers.param_roles`` and summed over the TP group in ``finish()``.

Expert parameters (``layers.param_roles.is_expert``) travel in buckets of their own,
all-reduced over the ``expert_grad`` group (the ranks holding the same experts) and
pre-divided by the same DP size as the dense ones: an expert's gradient already sums the
tokens of its ep ranks (the all-to-all's backward brought them), so the sum over the
expert-data-parallel group covers every rank's tokens once, and ÷ dp makes it the mean.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engine.data_parallel.buckets import BucketLauncher
from layers.param_roles import expert_split, has_sp_partial_grad, is_expert
from layers.tp_grads import sum_partial_grads_


class _Bucket:
    """Parameters whose gradients travel together in one all-reduce."""

    def __init__(self, params: list[nn.Parameter], reduce_dtype: torch.dtype | None, group) -> None:
        self.params, self.group = params, group  # the grad group, or expert_grad's
        self.numel = sum(p.numel() for p in params)
        self.dtype = reduce_dtype or params[0].dtype
        self.pending: set[int] = set()
        self.work: dist.Work | None = None
        self.buffer: torch.Tensor | None = None

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}
        self.work, self.buffer = None, None

    def launch(self, dp_size: int) -> dist.Work:
        grads = [
            torch.zeros_like(p, dtype=self.dtype) if p.grad is None else p.grad.to(self.dtype)
            for p in self.params
        ]
        self.buffer = torch.cat([g.reshape(-1) for g in grads]).div_(dp_size)
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)
        return self.work

    def unpack(self) -> None:
        self.work.wait()
        offset = 0
        for p in self.params:
            avg = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = avg.to(p.dtype).clone()
            else:
                p.grad.copy_(avg)


class GradSync(BucketLauncher):
    """Average gradients over the DP group, overlapping communication with backward.

    Usage per optimizer step::

        for i, micro in enumerate(micro_batches):
            with grad_sync.no_sync() if i < len(micro_batches) - 1 else nullcontext():
                loss(micro).backward()
        grad_sync.finish()
        optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        grad_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None = None,
        expert_grad_group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        overlap: bool = True,
    ) -> None:
        self._init_settings(  # the grad role's group; overlap False: buckets wait for finish()
            dp_group=grad_group, tp_group=tp_group, bucket_size_mb=bucket_size_mb, overlap=overlap
        )
        params = [p for p in dict.fromkeys(params) if p.requires_grad]  # unique, in order
        if expert_grad_group is None and any(expert_split(p) > 1 for p in params):
            raise ValueError(
                "experts split over ep ranks reduce over the expert_grad group: pass "
                "expert_grad_group=ps.group('expert_grad')"
            )
        self.expert_grad_group = grad_group if expert_grad_group is None else expert_grad_group
        self.params = params
        self.sp_params = [p for p in params if has_sp_partial_grad(p)]
        self._capacity, self._reduce_dtype = bucket_size_mb * 2**20, reduce_dtype
        self._set_buckets(list(reversed(params)))
        self._ready_order: list[int] | None = []  # None once the buckets were rebuilt
        self._syncing = True
        self._hooks = []
        if self.dp_size > 1:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _set_buckets(self, ordered: list[nn.Parameter]) -> None:
        """Cut ``ordered`` (expected order of gradient readiness) into buckets."""
        buckets, current, size = [], [], 0
        for p in ordered:
            # One dtype and one group per bucket, so the flat buffer needs no mixed casting.
            if current and (
                size >= self._capacity
                or p.dtype != current[0].dtype
                or is_expert(p) != is_expert(current[0])
            ):
                buckets.append(self._bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * (torch.finfo(self._reduce_dtype or p.dtype).bits // 8)
        if current:
            buckets.append(self._bucket(current))
        self.buckets = buckets
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        self._next_launch = 0
        for b in buckets:
            b.reset()

    def _bucket(self, params: list[nn.Parameter]) -> _Bucket:
        group = self.expert_grad_group if is_expert(params[0]) else self.dp_group
        return _Bucket(params, self._reduce_dtype, group)

    def _rebuild_from_observed_order(self) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        seen = [index[pid] for pid in self._ready_order]
        seen += [i for i in range(len(self.params)) if i not in set(seen)]  # never ready: last
        order = [seen]
        dist.broadcast_object_list(order, group_src=0, group=self.dp_group)
        self._set_buckets([self.params[i] for i in order[0]])
        self._ready_order = None

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._syncing:
            return
        if self._ready_order is not None:
            self._ready_order.append(id(param))
        bucket = self._bucket_of[id(param)]
        bucket.pending.discard(id(param))
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        def launch(bucket) -> None:
            work = bucket.launch(self.dp_size)
            if self.comm_timer is not None:
                self.comm_timer.launched(work)

        self._launch_in_order(self.buckets, launch, force)

    def finish(self) -> None:
        """Wait for every bucket (launching any whose params got no gradient) and unpack."""
        if self.dp_size > 1:
            self._launch_ready(force=True)
            for bucket in self.buckets:
                bucket.unpack()
                bucket.reset()
            self._next_launch = 0
            if self._ready_order:
                self._rebuild_from_observed_order()
        # After the DP average: both are sums, so the order does not change the result, but
        # the buckets' buffers were snapshotted at launch and would overwrite an earlier sum.
        self._sync_sequence_parallel_grads()

    def _sync_sequence_parallel_grads(self) -> None:
        sum_partial_grads_([p.grad for p in self.sp_params if p.grad is not None], self.tp_group)

    def remove(self) -> None:
        """Detach the backward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
