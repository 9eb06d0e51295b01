"""The unsplit reference the data-parallel tests compare against: one process, the whole
batch, torch's own AdamW (the trainer's decay grouping: weight matrices decay, vectors do
not) and ``clip_grad_norm_``, none of meshtron's optimizer or gradient code."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engine.config import OptimConfig


def alone_group() -> dist.ProcessGroup:
    """A group of this rank only (every rank creates every group, in the same order)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]


def train_unsplit(
    model: nn.Module, optim: OptimConfig, batches: Iterable[torch.Tensor]
) -> list[float]:
    """Train ``model`` one step per batch of token rows (next-token loss) and return the
    losses; every step clips to ``optim.clip_grad``."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    losses = []
    for x in batches:
        loss = model(x[:, :-1], x[:, 1:]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, optim.clip_grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
