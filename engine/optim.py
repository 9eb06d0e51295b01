"""AdamW, the warmup + cosine schedule, mesh-aware gradient clipping and fp16 loss scaling."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engine.config import OptimConfig, TrainerConfig
from layers.utils import TP_DIM_ATTR


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, norms or other 1-D params).

    ``impl``: "auto" takes torch's fused AdamW on CUDA and the default elsewhere; "apex"
    takes apex's FusedAdam (adam_w_mode), which must then be importable.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if cfg.impl == "apex":
        try:
            from apex.optimizers import FusedAdam
        except ImportError:
            raise RuntimeError(
                "optim.impl=apex but apex is not importable; install NVIDIA apex or use optim.impl=auto"
            ) from None
        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    fused = device.type == "cuda" and cfg.impl in ("auto", "torch")
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)


def decay_length(cfg: OptimConfig, max_steps: int) -> int:
    """Steps of cosine decay after warmup: ``optim.decay_steps``, else to ``max_steps``.

    The schedule's length is separate from where a run stops: with decay_steps fixed, a
    run stopped early and resumed with a larger ``trainer.max_steps`` follows the same
    schedule as one run to that step (past the end the rate stays at min_lr).
    """
    return cfg.decay_steps or max(1, max_steps - cfg.warmup_steps)


def scale_lr(cfg: OptimConfig, trainer: TrainerConfig) -> OptimConfig:
    """The linear scaling rule: with ``scale_lr_with_batch=B``, lr and min_lr grow by
    global_batch / B (the warmup keeps the first steps of a large batch stable)."""
    if cfg.scale_lr_with_batch <= 0:
        return cfg
    factor = trainer.global_batch / cfg.scale_lr_with_batch
    return dataclasses.replace(
        cfg, lr=cfg.lr * factor, min_lr=cfg.min_lr * factor, scale_lr_with_batch=0
    )


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate after ``step`` optimizer steps: linear warmup, then cosine to min_lr."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / decay_length(cfg, max_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_change(saved: dict, cfg: OptimConfig, max_steps: int) -> str | None:
    """A one-line note when resuming with ``cfg`` changes the saved run's cosine length.

    ``saved`` is the checkpoint's config (a dict); None when the schedule is unchanged.
    """
    try:
        before = decay_length(OptimConfig(**saved["optim"]), saved["trainer"]["max_steps"])
    except (KeyError, TypeError):
        return None
    now = decay_length(cfg, max_steps)
    if now == before:
        return None
    return (
        f"note: the learning-rate schedule changed on resume (cosine decay over {before} "
        f"steps after warmup, now {now}: trainer.max_steps moved its end); to continue the "
        f"saved schedule pass optim.decay_steps={before}"
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply ``lr`` to every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def global_grad_norm(
    params: Iterable[nn.Parameter], tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank of the mesh.

    TP-sharded parameters contribute their local shard and are summed across TP;
    replicated ones are identical on every TP rank (after grad sync) and are counted once,
    on TP rank 0. After DP averaging every DP replica holds the same gradients, so no DP
    reduction is needed.
    """
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    grads = [
        p.grad.detach()
        for p in params
        if p.grad is not None and (getattr(p, TP_DIM_ATTR, None) is not None or tp_rank == 0)
    ]
    # Squares by multi-tensor ops, each summed in at least fp32 and then together in fp64,
    # all on the device: no host sync here. (Per-tensor sums keep the exact numerics ZeRO's
    # sliced norm reproduces; a different summation would move the clip coefficient.)
    square_sums = {}
    for (_, dtype), group in _by_device_and_dtype(grads).items():
        wide = [g.to(_accumulation(dtype)) for g in group]
        for g, sq in zip(group, torch._foreach_pow(wide, 2), strict=True):
            square_sums[id(g)] = sq.sum()
    squares = [square_sums[id(g)] for g in grads]  # in parameter order, as summed before
    total = torch.stack(squares).double().sum() if squares else torch.zeros((), dtype=torch.float64)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        total = total.to(_collective_device(tp_group))
        dist.all_reduce(total, group=tp_group)
    return total.sqrt()


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


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """gloo reduces CPU tensors; NCCL needs them on this rank's GPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_grads_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm is at most ``max_norm``.

    The coefficient stays on the device (no host sync): gradients are multiplied by
    min(1, max_norm / (norm + 1e-6)), and a factor of exactly 1 leaves them unchanged.
    A non-finite ``norm`` cannot be fixed by any coefficient: the trainer's bad-step guard
    (engine/guard.py) skips such a step before it reaches clipping.
    """
    if max_norm <= 0:
        return
    coef = (max_norm / (norm.double() + 1e-6)).clamp_max(1.0)
    grads = [p.grad for p in params if p.grad is not None]
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        # Cast to the op's accumulation dtype, as a Python float scalar would be.
        torch._foreach_mul_(group, coef.to(device=device, dtype=_accumulation(dtype)))


class DynamicLossScaler:
    """fp16 loss scaling: halve the scale and skip the step on overflow, grow it when stable.

    Overflow is agreed on by every rank of the mesh (an all-reduce MAX of the local flag),
    so all ranks skip the same steps.
    """

    def __init__(self, init_scale: float, growth_interval: int = 1000) -> None:
        self.scale, self.growth_interval, self._good_steps = init_scale, growth_interval, 0

    def found_overflow(self, params: list[nn.Parameter]) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        flag = torch.zeros(())
        for (device, _), group in _by_device_and_dtype(grads).items():
            # One multi-tensor pass per group sets found to 1 on any inf/NaN; unscaling by
            # exactly 1 leaves the gradients as they are. One host sync, at the end.
            found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
            flag = flag.maximum(found.cpu().squeeze())
        if dist.is_initialized():
            flag = flag.to(_collective_device(dist.group.WORLD))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

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
