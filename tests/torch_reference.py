"""The unsplit reference the data-parallel tests compare against: one process, the whole
batch, torch's own AdamW (the trainer's decay grouping: weight matrices decay, vectors do
not) and ``clip_grad_norm_``, none of meshtron's optimizer or gradient code. Also the tiny
GPT and the optimizer settings those tests (and others that need a small model) share."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engine.config import OptimConfig
from engine.data_parallel import build_data_parallel
from engine.models.config import ModelConfig, preset

# clip_grad below the gradient norm of tiny_gpt(500) (~1.5), so every step clips and the
# (possibly sharded) norm is exercised, not just computed.
DP_OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.3)


def cpu_data_parallel(model: nn.Module, dp_group, tp_group, *, zero: bool = False, **options):
    """``build_data_parallel`` on the CPU with ``DP_OPTIM`` (``zero``: ZeRO-1, sharded
    optimizer state) and the strategy ``options`` a test varies."""
    optim = dataclasses.replace(DP_OPTIM, distributed=zero)
    return build_data_parallel(
        model, optim, grad_group=dp_group, tp_group=tp_group, device=torch.device("cpu"), **options
    )


def tiny_gpt(vocab_size: int, **overrides) -> ModelConfig:
    """gpt_tiny at width 32 with 4 heads and no dropout (so runs compare exactly), with
    ``overrides`` (any of those included: a test that wants dropout sets it)."""
    tiny = dict(hidden_size=32, num_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    return preset("gpt_tiny", vocab_size=vocab_size, **(tiny | overrides))


def relative_errors(reference, other) -> dict[str, float]:
    """Each of ``other``'s (loss, {name: grad}) relative to ``reference``'s: |Δloss|/|loss|,
    and per gradient max|Δ|/max|ref|."""
    (ref_loss, ref_grads), (loss, grads) = reference, other
    errors = {"loss": ((loss - ref_loss).abs() / ref_loss.abs()).item()}
    for name, ref in ref_grads.items():
        errors[name] = ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return errors


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
