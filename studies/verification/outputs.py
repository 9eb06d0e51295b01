"""Comparing one tensor with its reference (``compare``), and catching every module's
forward output at full shape (``OutputCapture``): the rows the layout verifier reports.

Error of a tensor: ``max_abs`` = max |target − reference|, ``max_rel`` = max_abs divided by
max |reference|. A row fails when max_rel (or, asked for, max_abs) exceeds the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from engine.models import ParallelModel
from engine.models.base import ParallelLMHead
from layers import ColumnParallelLinear
from layers.attention import CoreAttention
from layers.gqa import ReplicatedKVLinear
from layers.mappings import gather_along
from layers.ring_attention import unshard_from_cp
from parallel_state import groups


@dataclass(frozen=True)
class Row:
    """One compared tensor."""

    kind: str  # "output", "loss" or "grad"
    name: str
    max_abs: float
    max_rel: float
    ok: bool


def compare(
    kind: str, name: str, got: torch.Tensor, want: torch.Tensor, tol: float, *, absolute=False
) -> Row:
    """Row for ``got`` against ``want``; ``tol`` bounds the relative (or absolute) error."""
    if got.shape != want.shape:
        return Row(kind, name, float("inf"), float("inf"), False)
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    max_abs = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return Row(kind, name, max_abs, max_rel, (max_abs if absolute else max_rel) <= tol)


def output_tp_dim(module: nn.Module) -> int | None:
    """The dim along which a module's output is split across TP (None: replicated).

    Column-style outputs are split on their last dim; a module whose
    ``sequence_parallel`` is True outputs its sequence shard (dim 0, since activations are
    ``[s, b, ...]`` inside the models).
    """
    if isinstance(
        module, (ColumnParallelLinear, CoreAttention, ParallelLMHead, ReplicatedKVLinear)
    ):
        return None if getattr(module, "gather_output", False) else -1
    return 0 if getattr(module, "sequence_parallel", False) else None


def join_tp(out: torch.Tensor, tp_dim: int | None, copies: int, tp_group) -> torch.Tensor:
    """A module's output at full shape over TP (a collective over ``tp_group``): the
    shards joined along ``tp_dim`` (``output_tp_dim``), one copy of each block that
    ``copies`` TP ranks hold (KV heads replicated past their count)."""
    out = gather_along(out, tp_dim, tp_group)
    if copies > 1:
        blocks = out.unflatten(-1, (groups.group_size(tp_group), -1))
        out = blocks[..., ::copies, :].flatten(-2)
    return out


class OutputCapture:
    """Forward hooks keeping each module's first output (recomputation reruns forwards)."""

    def __init__(self, model: ParallelModel) -> None:
        self.outputs: dict[str, tuple[torch.Tensor, int | None, int | None]] = {}
        self.copies: dict[str, int] = {}
        vocab = model.cfg.vocab_size
        self._handles = [
            module.register_forward_hook(
                partial(self._keep, name, vocab if isinstance(module, ParallelLMHead) else None)
            )
            for name, module in model.named_modules()
            if name and not isinstance(module, nn.ModuleList)
        ]

    def _keep(self, name, trim, module, args, out) -> None:
        if name not in self.outputs and isinstance(out, torch.Tensor):
            self.outputs[name] = (out.detach().clone(), output_tp_dim(module), trim)
            self.copies[name] = getattr(module, "copies", 1)  # KV heads held by several ranks

    def gathered(self, tp_group, dp_group, cp_group=None) -> dict[str, torch.Tensor]:
        """Every output at full shape, vocabulary unpadded: TP shards joined, then each cp
        rank's share of the sequence put back in order, then DP batch slices (collective
        over the groups; None groups: nothing to join)."""
        cp = groups.group_size(cp_group)
        full = {}
        for name, (out, tp_dim, trim) in self.outputs.items():
            out = join_tp(out, tp_dim, self.copies[name], tp_group)
            # Inside the models 3-D activations are [s, b, ...], 2-D ones [b, ...].
            if cp > 1 and out.dim() == 3:  # [s/cp, b, ...] in the load-balanced layout
                shares = gather_along(out, 0, cp_group).chunk(cp, dim=0)
                out = unshard_from_cp(shares, dim=0)
            out = gather_along(out, 1 if out.dim() == 3 else 0, dp_group)
            full[name] = out if trim is None else out[..., :trim]
        return full

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
