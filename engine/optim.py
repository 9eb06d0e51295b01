"""AdamW and the warmup + cosine learning-rate schedule.

Gradient norms, clipping and fp16 loss scaling (which reduce over the mesh) live with the
data-parallel strategy, in ``engine.data_parallel.grads``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from engine.config import OptimConfig, TrainerConfig
from engine.muon import build_muon

# Where build_optimizer takes torch's fused AdamW. CUDA only: torch's CPU fused kernel
# (since torch 2.4, ~3x faster) rounds differently from the per-tensor loop, so a CPU run
# would drift from the runtime's reference (the quick start ended up to 1.1e-5 apart in
# every weight); CPU runs keep the per-tensor loop and stay bit-identical to it.
FUSED_ADAMW_DEVICES = ("cuda",)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, tp_group=None
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, norms or other 1-D params);
    with ``optim.algorithm=muon``, Muon on the transformer layers' matrices, gathered over
    ``tp_group`` (``engine.muon``), and AdamW on the rest.

    ``impl``: "auto" takes torch's fused AdamW (one kernel over every tensor) on the
    devices of ``FUSED_ADAMW_DEVICES`` and the per-tensor loop elsewhere; "apex" takes
    apex's FusedAdam (adam_w_mode), which must then be importable.
    """
    if cfg.algorithm == "muon":
        return build_muon(model, cfg, tp_group)
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
    fused = device.type in FUSED_ADAMW_DEVICES and cfg.impl in ("auto", "torch")
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
    steps = "step" if before == 1 else "steps"
    return (
        f"note: the learning-rate schedule changed on resume (cosine decay over {before} "
        f"{steps} after warmup, now {now}: trainer.max_steps moved its end); to continue the "
        f"saved schedule pass optim.decay_steps={before}"
    )


# A setting a resumed run may change, and what the change does to the data it reads: the
# note says so, filled with the saved value, this run's and the samples consumed.
DATA_CHANGE_NOTES = {
    ("trainer", "global_batch"): (
        "note: trainer.global_batch changed on resume ({0} → {1} sequences a step): the data "
        "goes on from sample {2}, and the learning-rate schedule's steps now each hold the "
        "new batch"
    ),
    ("data", "seq_len"): (
        "note: data.seq_len changed on resume ({0} → {1} tokens a sequence): the corpus is "
        "cut into other sequences in another shuffled order, read from sample {2} of it on, "
        "so within this epoch some text the run has seen comes again and some it has not is "
        "passed over"
    ),
}


def resume_notes(saved: dict, cfg, consumed_samples: int) -> list[str]:
    """One-line notes for resuming the run ``saved`` (its config as a dict) with ``cfg``
    (this run's Config) after ``consumed_samples`` samples: :func:`schedule_change`'s, and
    one per :data:`DATA_CHANGE_NOTES` setting changed (a value the saved config lacks is
    taken as unchanged)."""
    notes = [schedule_change(saved, cfg.optim, cfg.trainer.max_steps)]
    for (section, key), note in DATA_CHANGE_NOTES.items():
        try:
            before = int(saved[section][key])
        except (KeyError, TypeError, ValueError):
            continue
        now = getattr(getattr(cfg, section), key)
        if before != now:
            notes.append(note.format(before, now, consumed_samples))
    return [note for note in notes if note]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply ``lr`` to every parameter group (in place where the group holds it as a
    tensor, as a compiled step does: see :func:`compile_update`)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def compiles_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`compile_update` compiles this optimizer's step: torch's AdamW in its
    per-tensor or multi-tensor form, on fp32 (or narrower) parameters.

    The fused AdamW (CUDA) and apex's FusedAdam already run one kernel over every tensor
    and stay as they are. fp64 parameters stay eager too: traced, AdamW computes its bias
    corrections from the step counter, an fp32 tensor, where eager takes the count as a
    Python number, so an fp64 run would move by ~1e-8 relative per step (measured), and
    fp64 runs are the ones that check the math to 1e-15. In fp32 the same rounding is one
    ulp of the parameters.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return (
        type(optimizer) is torch.optim.AdamW
        and not any(group.get("fused") for group in optimizer.param_groups)
        and all(p.dtype != torch.float64 for p in params)
    )


def compile_update(
    update: Callable[..., None], optimizer: torch.optim.Optimizer, backend: str
) -> Callable[..., None]:
    """``update`` (gradient clipping and ``optimizer.step()``) compiled: two graphs, the
    clipping's and AdamW's, split by the graph breaks torch itself puts around every
    ``Optimizer.step``.

    The per-tensor AdamW runs ~10 element-wise ops per parameter tensor; compiled, each
    tensor's update is one fused loop (gpt_tiny's 28 tensors, one CPU thread, timed by a
    throwaway script: ~8 ms eager, ~2 ms compiled). The learning rate becomes a 0-d fp64 tensor in each
    group, written in place by :func:`set_lr`, so that the schedule changing it every step
    does not recompile the graph. Call only where :func:`compiles_update` says so.
    """
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
    return torch.compile(update, backend=backend)
