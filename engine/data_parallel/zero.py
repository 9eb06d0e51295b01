"""ZeRO-1: optimizer state and master weights sharded across the data-parallel group.

Parameters are cut into buckets (one optimizer group and dtype each, in reverse order of
registration, which approximates the order backward produces their gradients). A bucket
holds two flat buffers, each padded to a multiple of dp:

- ``param_buffer``: the model's parameters are views into it (bf16 when training in bf16);
- ``grad_buffer``: gradients accumulate here in fp32 (fp64 for fp64 parameters).

DP rank r owns the slice ``[lo, hi)`` of both, and keeps the Adam moments of that slice
only, and its fp32 master copy when the parameters are bf16 (fp32 parameters are their own
masters: the optimizer updates the owned slice of ``param_buffer`` in place). One step:

1. backward: a post-accumulate-grad hook adds each gradient into ``grad_buffer`` and frees
   it; when a bucket is complete (and every earlier bucket launched, so all ranks issue
   collectives in one order) the buffer is divided by dp and **reduce-scattered** in
   place, asynchronously, while backward continues with earlier layers;
2. ``finish_grads``: wait; the master slice's ``.grad`` is a view of the owned slice;
3. ``step``: AdamW updates the master slices, each is cast into its slice of
   ``param_buffer``, and the buffer is **all-gathered** in place, asynchronously; with
   ``overlap_param_gather(model)`` the forward pre-hook of each module waits only for the
   buckets of its own parameters, so later buckets arrive during the next forward.

Experts split over ep ranks (``layers.param_roles.expert_split``) are bucketed apart and
sliced over the ``expert_grad`` group (the dp ÷ ep ranks holding the same experts), so
their Adam state is 1/(dp ÷ ep) per rank; their reduce-scatter runs over that group and
is divided by the whole dp, as ``GradSync``'s all-reduce of them is (the gradient already
sums the tokens of the ep ranks, brought by the all-to-all's backward).

Bytes held per parameter (``engine.formulas.state_bytes_per_param``): bf16 parameters 2
(parameters) + 4 (gradient buffer) + 12/dp (fp32 master, exp_avg, exp_avg_sq) = 6 + 12/dp;
fp32 parameters 4 + 4 + 8/dp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.data_parallel.buckets import BucketLauncher, ShardedBucket, cut_buckets
from engine.data_parallel.grads import square_sum
from engine.data_parallel.offload import HostMasters
from layers.param_roles import expert_split, tied_across
from layers.tp_grads import sum_partial_grads_
from layers.utils import group_rank, group_size

MASTER_KEY = "master"  # exported state key of fp32 masters of lower-precision parameters


class ZeroOptimizer(BucketLauncher):
    """AdamW whose state and master weights are sharded across ``dp_group`` (ZeRO-1).

    Built from a plain, never-stepped torch AdamW, which supplies the parameters, their
    grouping and hyperparameters; it owns the DP gradient reduction of those parameters
    (do not also all-reduce them). ``param_dtype=torch.bfloat16`` stores the model's
    parameters in bf16 (the fp32 masters are taken before the cast). Per step::

        for each micro-batch: backward (under ``no_sync()`` but the last)
        zero.finish_grads()                 # master_params[i].grad: the averaged slice
        norm = zero.grad_norm()             # global, over DP and TP
        clip_grads_(zero.master_params, max_norm, norm)
        zero.step(); zero.zero_grad()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        param_dtype: torch.dtype | None = None,
        overlap: bool = True,
        registration_order: list[nn.Parameter] | None = None,
        expert_grad_group: dist.ProcessGroup | None = None,
        offload: bool = False,
    ) -> None:
        if not isinstance(optimizer, torch.optim.AdamW) or optimizer.state:
            raise ValueError(
                "ZeroOptimizer wraps a fresh torch.optim.AdamW (optim.impl torch/auto)"
            )
        every = [p for g in optimizer.param_groups for p in g["params"]]
        if expert_grad_group is None and any(expert_split(p) > 1 for p in every):
            raise ValueError(
                "experts split over ep ranks shard over the expert_grad group: pass "
                "expert_grad_group=ps.group('expert_grad')"
            )
        self._init_settings(  # overlap False: reduce-scatters wait for finish_grads()
            dp_group=dp_group, tp_group=tp_group, bucket_size_mb=bucket_size_mb, overlap=overlap
        )
        groups = self._cut_buckets(optimizer, expert_grad_group, param_dtype, bucket_size_mb)
        # offload (engine/data_parallel/offload.py): AdamW steps host copies of the masters.
        self.host = HostMasters(self.buckets) if offload else None
        self._stepped = self.host.masters if self.host else [b.master for b in self.buckets]
        for group, master in zip(groups, self._stepped, strict=True):
            group["params"] = [master]
        # A bucket is complete when its first-registered parameter's gradient is: launch
        # in reverse order of that (``registration_order``: the model's parameters).
        every = registration_order or every
        index = {id(p): i for i, p in enumerate(every)}
        self._launch_order = sorted(
            self.buckets, key=lambda b: -min(index.get(id(p), 0) for p in b.params)
        )
        self.inner = torch.optim.AdamW(groups)
        self.params = [p for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch, self._syncing, self._hooks = 0, True, []
        # Parameters whose first gradient since zero_grad is still to come: it is copied
        # into the buffer rather than added, so zero_grad never has to clear the buffers.
        self._fresh = {id(p) for p in self.params}
        self._gather_in_forward = False  # set by overlap_param_gather
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _cut_buckets(
        self,
        optimizer: torch.optim.Optimizer,
        expert_grad_group: dist.ProcessGroup | None,
        param_dtype: torch.dtype | None,
        bucket_size_mb: float,
    ) -> list[dict[str, Any]]:
        """Fill ``self.buckets``: each param group's parameters cut into buckets, experts
        split over ep apart (sharded over ``expert_grad_group``); return the inner
        optimizer's groups, one a bucket with its group's hyperparameters."""
        self.buckets: list[ShardedBucket] = []
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for params, shard_group in _by_shard_group(group["params"], expert_grad_group):
                for some in cut_buckets(params, bucket_size_mb * 2**20):
                    bucket = ShardedBucket(
                        some,
                        dp_group=self.dp_group if shard_group is None else shard_group,
                        tp_rank=group_rank(self.tp_group),
                        param_dtype=param_dtype,
                        mean_over=self.dp_size,
                    )
                    self.buckets.append(bucket)
                    groups.append({**hyper, "params": [bucket.master]})
        return groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (one per bucket), so ``set_lr`` works unchanged."""
        return self.inner.param_groups

    @property
    def master_params(self) -> list[torch.Tensor]:
        """This rank's master slices; after ``finish_grads`` their ``.grad``."""
        return [b.master for b in self.buckets]

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if id(param) in self._fresh:
            bucket.grad_views[id(param)].copy_(param.grad)
            self._fresh.discard(id(param))
        else:
            bucket.grad_views[id(param)].add_(param.grad)
        param.grad = None  # the bucket's buffer holds it now
        if not self._syncing:
            return
        bucket.pending.discard(id(param))
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        def launch(bucket: ShardedBucket) -> None:
            bucket.zero_unwritten(self._fresh)
            self._told(bucket.launch_reduce())

        self._launch_in_order(self._launch_order, launch, force)

    def _told(self, work: dist.Work | None) -> None:
        if work is not None and self.comm_timer is not None:
            self.comm_timer.launched(work)

    @torch.no_grad()
    def finish_grads(self) -> None:
        """Wait for every bucket's reduce-scatter; point the master slices' ``.grad`` at it.

        A gradient that autograd did not accumulate fired no hook: the zero-bubble pipeline
        schedules' weight-gradient pass (torch's ``stage_backward_weight``) assigns ``.grad``
        itself. It joins its bucket here, before the buckets launch."""
        for p in self.params:
            if p.grad is not None:
                self._on_grad_ready(p)
        self._launch_ready(force=True)
        self._next_launch = 0
        for b in self._launch_order:
            if b.reduce_work is not None:
                b.reduce_work.wait()
                b.reduce_work = None
            b.reset()
            b.master.grad = b.slice(b.grad_buffer)
        self._sum_sequence_parallel_grads()

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's shard of ``param``'s DP-reduced gradient (after ``finish_grads``):
        its bucket's master slice, which holds ``param`` alone when it is tied across ranks
        (so the holders' shards can be summed element for element)."""
        bucket = self._bucket_of[id(param)]
        if len(bucket.params) != 1:
            raise ValueError("reduced_grad reads a parameter that has a bucket of its own")
        return bucket.master.grad

    def _sum_sequence_parallel_grads(self) -> None:
        # After the DP average (both are sums, so the order does not change the result).
        # Every TP rank has the same bucket layout, so the ranges line up across TP.
        parts = [b.master.grad[lo:hi] for b in self.buckets for lo, hi in b.sp_ranges]
        sum_partial_grads_(parts, self.tp_group)

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's averaged gradient, the same on every rank.

        One sum over the DP group counts every element once, experts split over ep
        included: the expert-data-parallel ranks of one ep index hold disjoint slices of
        its experts, and the ep indices disjoint experts, together the whole DP group."""
        # Per parameter (part), squares summed in the gradient's dtype and then together
        # in fp64, by the plain path's own function (engine.data_parallel.grads), so the
        # clip coefficient agrees to the last bits.
        parts = [
            b.master.grad[lo:hi]
            for b in self.buckets
            if b.master.grad is not None
            for lo, hi in b.norm_ranges
        ]
        total = square_sum(parts)
        total = total.to(self.buckets[0].master.device) if self.buckets else total
        for group in (self.dp_group, self.tp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total.sqrt().cpu()

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's master slices, then all-gather them into the parameters.

        The all-gathers run in forward order; without ``overlap_param_gather`` the step
        waits for them, with it each module waits for its own buckets before its forward.
        """
        if self.host:
            self.host.step(self.inner)
        else:
            self.inner.step()
        for bucket in reversed(self._launch_order):
            self._told(bucket.launch_gather())
        if not self._gather_in_forward:
            self.wait_params()

    def overlap_param_gather(self, model: nn.Module) -> None:
        """Let ``model``'s next forward wait bucket by bucket for the updated parameters."""
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self._bucket_of]
            if own:
                buckets = {id(self._bucket_of[id(p)]): self._bucket_of[id(p)] for p in own}
                hook = module.register_forward_pre_hook(self._waiter(list(buckets.values())))
                self._hooks.append(hook)
        # Whatever a forward did not touch is complete when it returns.
        self._hooks.append(model.register_forward_hook(lambda *_: self.wait_params()))
        self._gather_in_forward = True

    def _waiter(self, buckets: list[ShardedBucket]):
        def wait(*_: Any) -> None:
            for b in buckets:
                b.wait_gather()

        return wait

    def wait_params(self) -> None:
        """Block until every parameter holds the last step's value."""
        for b in reversed(self._launch_order):
            b.wait_gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new step's gradients (the next ones overwrite the buffers)."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.master.grad = None
        self._fresh = {id(p) for p in self.params}

    def state_bytes(self) -> int:
        """Bytes of optimizer state plus master weights held by this rank on the device
        (offloaded: none; ``host_state_bytes`` counts them)."""
        if self.host:
            return 0
        tensors = [b.master for b in self.buckets]
        tensors += [
            v for st in self.inner.state.values() for v in st.values() if torch.is_tensor(v)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def host_state_bytes(self) -> int:
        """Bytes of the offloaded masters, gradient copies and Adam state in host memory."""
        return self.host.nbytes(self.inner) if self.host else 0

    def remove(self) -> None:
        """Detach the backward and forward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @torch.no_grad()
    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Each parameter's state at its own (TP-local) shape, gathered over DP (collective).

        The layout of torch's ``optimizer.state``: the same keys, so checkpoints read and
        write both alike. fp32 masters of lower-precision parameters appear as "master".
        """
        self.wait_params()
        out: dict[nn.Parameter, dict[str, Any]] = {p: {} for p in self.params}
        for b, master in zip(self.buckets, self._stepped, strict=True):
            state = dict(self.inner.state.get(master, {}))
            if b.param_buffer.dtype != master.dtype:
                state[MASTER_KEY] = master
            for key in sorted(state):  # the same collective order on every rank
                value = state[key]
                if torch.is_tensor(value) and value.shape == master.shape:
                    value = value.to(b.param_buffer.device)  # offloaded: gather on the device
                    for p, view in b.views(b.gather(value)):
                        out[p][key] = view.clone()
                else:
                    for p in b.params:
                        out[p][key] = value.clone() if torch.is_tensor(value) else value
        return out

    @torch.no_grad()
    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Inverse of :meth:`param_states` (from any layout); parameters must be loaded first.

        Scalars (the step count) are one per slice here: the largest over its parameters.
        """
        self.wait_params()
        full = self.inner.state_dict()
        for i, b in enumerate(self.buckets):
            per_param = [states.get(p, {}) for p in b.params]
            keys = sorted({k for st in per_param for k in st})
            masters = [
                st.get(MASTER_KEY, p.detach()) for st, p in zip(per_param, b.params, strict=True)
            ]
            self._stepped[i].copy_(b.slice(b.flatten(masters)))
            entry = {}
            for key in (k for k in keys if k != MASTER_KEY):
                values = [st.get(key) for st in per_param]
                if any(torch.is_tensor(v) and v.dim() > 0 for v in values):
                    entry[key] = b.slice(b.flatten(values)).clone()
                else:
                    entry[key] = torch.tensor(max(float(v) for v in values if v is not None))
            if entry:
                full["state"][i] = entry
        self.inner.load_state_dict(full)


def _by_shard_group(
    params: list[nn.Parameter], expert_grad_group: dist.ProcessGroup | None
) -> list[tuple[list[nn.Parameter], dist.ProcessGroup | None]]:
    """``params`` as (parameters, the group their buckets are sliced over; None: the DP
    group): experts split over ep over ``expert_grad_group`` (the ranks holding the same
    experts), apart from the rest, which keep their order and buckets as without ep; a
    parameter tied across ranks (``param_roles.mark_tied_across``) alone, so its shard on
    each holder covers the same elements."""
    split = [p for p in params if expert_split(p) > 1]
    dense = [p for p in params if expert_split(p) == 1 and not tied_across(p)]
    runs = [(dense, None), (split, expert_grad_group)]
    runs += [([p], None) for p in params if tied_across(p)]  # a bucket each (param_roles)
    return [(some, group) for some, group in runs if some]
