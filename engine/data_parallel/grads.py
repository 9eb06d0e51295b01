"""Mesh-aware gradient norm, clipping and fp16 loss scaling (the step's reductions).

The groups are always passed in: the norm sums over TP (and, for ZeRO's slices, over DP
inside ``ZeroOptimizer.grad_norm``); overflow is agreed on over the TP and DP groups,
which together cover the mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from layers.param_roles import counted_in_norm, is_expert
from layers.utils import group_size
from parallel_state.groups import collective_device


def global_grad_norm(
    params: Iterable[nn.Parameter],
    tp_group: dist.ProcessGroup | None,
    ep_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank of the mesh.

    TP-sharded parameters contribute their local shard and are summed across TP;
    replicated ones are identical on every TP rank (after grad sync) and are counted once,
    on TP rank 0. After DP averaging every DP replica holds the same gradients, so no DP
    reduction is needed, except for experts split over ``ep_group`` (the mesh's
    ``expert`` role): each ep rank holds other experts, whose squares are summed over it.
    """
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    counted = [p for p in params if p.grad is not None and counted_in_norm(p, tp_rank)]
    if group_size(ep_group) > 1:
        dense = square_sum([p.grad.detach() for p in counted if not is_expert(p)])
        expert = square_sum([p.grad.detach() for p in counted if is_expert(p)])
        expert = expert.to(collective_device(ep_group))
        dist.all_reduce(expert, group=ep_group)
        total = dense + expert.to(dense.device)
    else:
        total = square_sum([p.grad.detach() for p in counted])
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        total = total.to(collective_device(tp_group))
        dist.all_reduce(total, group=tp_group)
    return total.sqrt()


# Where each gradient's sum of squares comes from one multi-tensor norm kernel over all of
# them (torch._foreach_norm, fp32 accumulation), squared back. It reads each gradient once;
# the per-tensor path below writes every square out and reads it back (at GPT 1.3B in
# fp32, 10 GB more traffic per step, about 2.5 ms on an H200) and launches one sum per
# tensor. CUDA only: elsewhere the per-tensor sums keep the numerics the CPU tests and
# ZeRO's sliced norm reproduce bit for bit (a norm squared back differs in the last bits).
FUSED_NORM_DEVICES = ("cuda",)


def square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ of the squares of ``grads``, in fp64 (0 for none)."""
    # Squares by multi-tensor ops, each summed in at least fp32 and then together in fp64,
    # all on the device: no host sync here.
    square_sums = {}
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        wide = _accumulation(dtype)
        if device.type in FUSED_NORM_DEVICES:
            sums = torch._foreach_pow(torch._foreach_norm(group, 2, dtype=wide), 2)
        else:
            sums = [sq.sum() for sq in torch._foreach_pow([g.to(wide) for g in group], 2)]
        square_sums.update(zip(map(id, group), sums, strict=True))
    squares = [square_sums[id(g)] for g in grads]  # in parameter order, as summed before
    return torch.stack(squares).double().sum() if squares else torch.zeros((), dtype=torch.float64)


def _by_device_and_dtype(
    grads: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Gradients grouped as the multi-tensor ops take them: one device and dtype each."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (bf16/fp16 gradients are summed in fp32, fp64 ones in fp64)."""
    return torch.promote_types(dtype, torch.float32)


def clip_grads_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm is at most ``max_norm``.

    The coefficient stays on the device (no host sync): gradients are multiplied by
    min(1, max_norm / (norm + 1e-6)), and a factor of exactly 1 leaves them unchanged.
    A non-finite ``norm`` cannot be fixed by any coefficient: the trainer's bad-step guard
    (engine/resilience/guard.py) skips such a step before it reaches clipping.
    """
    scale_grads_([p.grad for p in params if p.grad is not None], max_norm, norm)


def scale_grads_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """:func:`clip_grads_` on the gradient tensors themselves (e.g. FSDP's local shards)."""
    if max_norm <= 0:
        return
    coef = (max_norm / (norm.double() + 1e-6)).clamp_max(1.0)
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        # Cast to the op's accumulation dtype, as a Python float scalar would be.
        torch._foreach_mul_(group, coef.to(device=device, dtype=_accumulation(dtype)))


class DynamicLossScaler:
    """fp16 loss scaling: halve the scale and skip the step on overflow, grow it when stable.

    Overflow is agreed on by every rank of the mesh (an all-reduce MAX of the local flag
    over each of ``groups``, e.g. the TP and the DP group), so all ranks skip the same steps.
    """

    def __init__(self, init_scale: float, growth_interval: int = 1000) -> None:
        self.scale, self.growth_interval, self._good_steps = init_scale, growth_interval, 0

    def found_overflow(
        self, params: list[nn.Parameter], groups: Sequence[dist.ProcessGroup | None] = ()
    ) -> bool:
        """Whether any gradient of ``params`` on any rank of ``groups`` is inf or NaN."""
        grads = [p.grad for p in params if p.grad is not None]
        flag = torch.zeros(())
        for (device, _), group in _by_device_and_dtype(grads).items():
            # One multi-tensor pass per group sets found to 1 on any inf/NaN; unscaling by
            # exactly 1 leaves the gradients as they are. One host sync, at the end.
            found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
            flag = flag.maximum(found.cpu().squeeze())
        for group in groups:
            if group_size(group) > 1:
                flag = flag.to(collective_device(group))
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def skip_or_unscale(
        self, params: list[nn.Parameter], groups: Sequence[dist.ProcessGroup | None] = ()
    ) -> bool:
        """A step's check: whether it overflowed anywhere in ``groups`` (then it is to be
        skipped), else its gradients unscaled; either way the scale adapts."""
        overflow = self.found_overflow(params, groups)
        if not overflow:
            self.unscale_(params)
        self.update(overflow)
        return overflow

    def unscale_(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self.scale)

    def state_dict(self) -> dict[str, float]:
        """The scale and the count of good steps since the last change (for checkpoints)."""
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self._good_steps = max(self.scale / 2.0, 1.0), 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2.0
