"""ZeRO-1: optimizer state and fp32 master weights sharded across the data-parallel group.

One optimizer step (ZeRO-1; bytes per parameter in docs/PERFMODEL.md):

1. **reduce-scatter** — each parameter group's gradients (one flat buffer per dtype,
   padded to a multiple of dp) are divided by dp and reduce-scattered over the DP group,
   so DP rank r ends with the averaged gradient of its 1/dp slice;
2. the inner AdamW (same class and hyperparameters as the plain optimizer) updates rank
   r's fp32 master slice;
3. **all-gather** — every rank gathers the updated slices into the parameters.

Per parameter a rank keeps 12/dp bytes of fp32 master + Adam moments instead of the
plain optimizer's 8 bytes of moments beside its fp32 parameters. This replaces GradSync's
DP all-reduce: build GradSync with ``dp_group=None`` so it only does the sequence-parallel
TP sums, or the gradients would be reduced twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from layers.utils import TP_DIM_ATTR, CommTimer, group_rank, group_size, timed

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MASTER_KEY = "master"  # exported state key of fp32 masters of lower-precision parameters


class _FlatShard:
    """Parameters of one group and dtype laid end to end, cut into dp equal slices.

    Masters, gradients and state are fp32, or the parameters' dtype when wider (fp64).
    """

    def __init__(self, params: list[nn.Parameter], *, dp_group, tp_rank: int) -> None:
        self.params, self.dp_group = params, dp_group
        self.dtype = torch.promote_types(params[0].dtype, torch.float32)
        self.dp_size, dp_rank = group_size(dp_group), group_rank(dp_group)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        padded = -(-self.offsets[-1] // self.dp_size) * self.dp_size
        self.shard_numel = padded // self.dp_size
        self.lo, self.hi = dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel
        self.master = self.slice(self.flatten([p.detach() for p in params])).clone()
        # Parts of this slice that count toward the gradient norm: TP-split parameters on
        # every TP rank, replicated ones (identical on all TP ranks) on TP rank 0 only.
        self.norm_ranges = [
            (max(start, self.lo) - self.lo, min(end, self.hi) - self.lo)
            for p, start, end in zip(params, self.offsets, self.offsets[1:], strict=False)
            if (getattr(p, TP_DIM_ATTR, None) is not None or tp_rank == 0)
            and max(start, self.lo) < min(end, self.hi)
        ]

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """Concatenation of ``tensors`` (None: zeros) in the master dtype, padded to dp slices."""
        flat = torch.zeros(
            self.shard_numel * self.dp_size, dtype=self.dtype, device=self.params[0].device
        )
        for t, p, start in zip(tensors, self.params, self.offsets[:-1], strict=True):
            if t is not None:
                flat[start : start + p.numel()].copy_(t.reshape(-1))
        return flat

    def slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a flat buffer."""
        return flat[self.lo : self.hi]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's slice into the full flat buffer."""
        if self.dp_size == 1:
            return part
        full = part.new_empty(self.shard_numel * self.dp_size)
        _all_gather_flat(full, part.contiguous(), group=self.dp_group)
        return full

    def views(self, flat: torch.Tensor):
        """(parameter, its part of ``flat`` in the parameter's shape) pairs."""
        for p, start in zip(self.params, self.offsets[:-1], strict=True):
            yield p, flat[start : start + p.numel()].view(p.shape)


class ZeroOptimizer:
    """AdamW whose state and fp32 master weights are sharded across ``dp_group``.

    Built from a plain, never-stepped torch AdamW, which supplies the parameters, their
    grouping and hyperparameters. Per step::

        grad_sync.finish()                   # GradSync(dp_group=None): SP sums only
        zero.reduce_scatter_grads()          # master_params[i].grad: this rank's slice
        norm = zero.grad_norm()              # global, over DP and TP
        clip_grads_(zero.master_params, max_norm, norm)
        zero.step(); zero.zero_grad()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.AdamW) or optimizer.state:
            raise ValueError(
                "ZeroOptimizer wraps a fresh torch.optim.AdamW (optim.impl torch/auto)"
            )
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_size = group_size(dp_group)
        self.comm_timer: CommTimer | None = None  # times the DP collectives when set
        self.shards: list[_FlatShard] = []
        groups = []
        for group in optimizer.param_groups:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in group["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
            for params in by_dtype.values():
                shard = _FlatShard(params, dp_group=dp_group, tp_rank=group_rank(tp_group))
                self.shards.append(shard)
                hyper = {k: v for k, v in group.items() if k != "params"}
                groups.append({**hyper, "params": [shard.master]})
        self.inner = torch.optim.AdamW(groups)
        self.params = [p for s in self.shards for p in s.params]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (one per shard), so ``set_lr`` works unchanged."""
        return self.inner.param_groups

    @property
    def master_params(self) -> list[torch.Tensor]:
        """This rank's fp32 master slices; after ``reduce_scatter_grads`` their ``.grad``."""
        return [s.master for s in self.shards]

    @torch.no_grad()
    def reduce_scatter_grads(self) -> None:
        """Average gradients over DP into this rank's slice; frees the full gradients."""
        for s in self.shards:
            flat = s.flatten([p.grad for p in s.params]).div_(self.dp_size)
            if self.dp_size == 1:
                s.master.grad = flat
            else:
                s.master.grad = torch.empty_like(s.master)
                timed(
                    self.comm_timer, _reduce_scatter_flat, s.master.grad, flat, group=self.dp_group
                )
            for p in s.params:
                p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's averaged gradient (engine.optim.global_grad_norm's)."""
        squares = [
            s.master.grad[a:b].double().pow(2).sum()
            for s in self.shards
            if s.master.grad is not None
            for a, b in s.norm_ranges
        ]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
        total = total.to(self.shards[0].master.device) if self.shards else total
        for group in (self.dp_group, self.tp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total.sqrt().cpu()

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's master slices, then all-gather them into the parameters."""
        self.inner.step()
        for s in self.shards:
            for p, view in s.views(timed(self.comm_timer, s.gather, s.master)):
                p.copy_(view)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' gradients and the slices' gradients."""
        for p in self.params:
            p.grad = None
        for s in self.shards:
            s.master.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state plus fp32 master weights held by this rank."""
        tensors = [s.master for s in self.shards]
        tensors += [
            v for st in self.inner.state.values() for v in st.values() if torch.is_tensor(v)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Each parameter's state at its own (TP-local) shape, gathered over DP (collective).

        The layout of torch's ``optimizer.state``: the same keys, so checkpoints read and
        write both alike. fp32 masters of lower-precision parameters appear as "master".
        """
        out: dict[nn.Parameter, dict[str, Any]] = {p: {} for p in self.params}
        for s in self.shards:
            state = dict(self.inner.state.get(s.master, {}))
            if s.params[0].dtype != s.master.dtype:
                state[MASTER_KEY] = s.master
            for key in sorted(state):  # the same collective order on every rank
                value = state[key]
                if torch.is_tensor(value) and value.shape == s.master.shape:
                    for p, view in s.views(s.gather(value)):
                        out[p][key] = view.clone()
                else:
                    for p in s.params:
                        out[p][key] = value.clone() if torch.is_tensor(value) else value
        return out

    @torch.no_grad()
    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Inverse of :meth:`param_states` (from any layout); parameters must be loaded first.

        Scalars (the step count) are one per slice here: the largest over its parameters.
        """
        full = self.inner.state_dict()
        for i, s in enumerate(self.shards):
            per_param = [states.get(p, {}) for p in s.params]
            keys = sorted({k for st in per_param for k in st})
            masters = [
                st.get(MASTER_KEY, p.detach()) for st, p in zip(per_param, s.params, strict=True)
            ]
            s.master.copy_(s.slice(s.flatten(masters)))
            entry = {}
            for key in (k for k in keys if k != MASTER_KEY):
                values = [st.get(key) for st in per_param]
                if any(torch.is_tensor(v) and v.dim() > 0 for v in values):
                    entry[key] = s.slice(s.flatten(values)).clone()
                else:
                    entry[key] = torch.tensor(max(float(v) for v in values if v is not None))
            if entry:
                full["state"][i] = entry
        self.inner.load_state_dict(full)
