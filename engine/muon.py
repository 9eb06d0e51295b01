"""Muon on the transformer layers' matrices, AdamW on the rest, under tensor parallelism.

``optim.algorithm=muon`` (the ``optim=muon`` preset) builds :class:`TPMuon`: torch's
Muon update (``torch.optim.Muon``: momentum, Nesterov, Newton-Schulz orthogonalization,
the shape-dependent lr adjustment, decoupled weight decay) on the 2-D weight matrices of
the transformer layers, and torch's ``AdamW`` on everything else (embeddings, norms,
biases, the LM head), as the Muon papers do. One optimizer object with both kinds of
parameter groups and one ``state`` dict, so the schedule (``engine.optim.set_lr``), the
checkpoint code (``PlainOptimizerState``) and the gradient clipping see an ordinary torch
optimizer.

**Under TP.** A column- or row-parallel weight holds a slice of its matrix, and
Newton-Schulz needs the whole matrix (it orthogonalizes it: ``X X^T`` couples every row
with every other). The step here:

1. the momentum buffer and the Nesterov blend are element-wise, so each rank runs them on
   its slice (the buffer is saved and resumed as a TP slice of the full matrix's, like
   Adam's moments);
2. the blended update is all-gathered over the TP group along the split dim (one copy of
   each block kept for GQA's replicated KV heads), giving the full matrix in the layout of
   the unsplit model's (full state dicts do not depend on the TP size);
3. **every TP rank runs Newton-Schulz on the whole matrix** (and scales the lr for the
   whole matrix's shape) and keeps its slice.

Chosen over "each rank orthogonalizes some of the matrices, then the results are
scattered back": that needs a second collective per matrix and a plan of which rank owns
which matrix, for tp × fewer Newton-Schulz FLOPs per rank. Here every TP rank spends the
unsplit model's Newton-Schulz FLOPs (5 iterations of three matmuls per matrix; not yet
timed on a GPU), and the only communication is one all-gather of the update per split
matrix. Every rank runs the same bf16 Newton-Schulz on bitwise the same input, so the
slices fit together exactly.

**Under DP** with ``parallel.dp_shard=none`` every replica holds the all-reduced gradient
and runs the same step. ZeRO-1 and FSDP hand a rank a flat slice of the gradient, not
whole matrices; ``engine.config`` refuses Muon with them before any worker starts, and
:func:`engine.data_parallel.build_data_parallel` again for callers that skip validation.

**Matching torch.** The update calls torch's own ``_zeropower_via_newtonschulz`` and
``_adjust_lr`` (``torch.optim._muon``) and copies ``_single_tensor_muon``'s arithmetic
in the same order, so given the same gradient it is ``torch.optim.Muon``'s step bit for
bit. Split runs differ from the unsplit one only where their gradients do (the last fp64
bits of a split matmul or a DP all-reduce), and those rarely survive Muon's cast to bf16:
in tests/test_muon.py the Muon matrices of tp=2 and dp=2 runs came out bitwise equal to
torch's after 3 fp64 steps, the AdamW ones within 6e-13.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from layers.gqa import dedupe_gathered
from layers.mappings import all_gather_dim
from layers.param_roles import expert_split, replicas, tp_dim
from parallel_state.groups import group_rank, group_size

# torch.optim.Muon's defaults for what the config does not set.
MUON_DEFAULTS = {"ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C), "eps": EPS}
MOMENTUM = "momentum_buffer"  # torch.optim.Muon's state key, kept so the states read alike


def muon_param_names(model: nn.Module) -> list[str]:
    """The parameters Muon updates: 2-D weights inside a transformer layer (``layers.N``).

    Not the word/position embeddings or an untied LM head (outside the layers), norms and
    biases (1-D), nor a MoE layer's experts (stacked 3-D, dim 0 the experts; the check on
    ep guards a 2-D expert weight). A MoE router's 2-D weight is a layer matrix: Muon."""
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad
        and p.dim() == 2
        and ("layers" in name.split(".")[:-1])
        and expert_split(p) == 1
    ]


class TPMuon(torch.optim.Optimizer):
    """Muon groups (``group["muon"]``) stepped here, AdamW groups by an inner torch AdamW
    sharing this optimizer's groups and state. See the module docstring."""

    def __init__(
        self,
        muon_params: Iterable[nn.Parameter],
        adamw_groups: list[dict],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        ns_steps: int,
        adjust_lr_fn: str,
        betas: tuple[float, float],
        eps: float,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.tp_group = tp_group
        adamw_groups = [g for g in adamw_groups if g["params"]]
        self.adamw = (
            torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps) if adamw_groups else None
        )
        muon_group = {
            "params": list(muon_params),
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": True,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "muon": True,
            **MUON_DEFAULTS,
        }
        groups = ([muon_group] if muon_group["params"] else []) + (
            self.adamw.param_groups if self.adamw else []
        )
        super().__init__(groups, {"lr": lr, "muon": False})
        self._share()

    def _share(self) -> None:
        """Point the inner AdamW at this optimizer's AdamW groups and state (again after
        ``load_state_dict``, which replaces both)."""
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, refusing state of the other algorithm (a checkpoint of an AdamW
        run resumed with Muon, or back), which would otherwise continue from other moments."""
        params = [(p, g["muon"]) for g in self.param_groups for p in g["params"]]
        for i, (p, muon) in enumerate(params):  # checked before anything is replaced
            keys = set(state_dict["state"].get(i, {}))
            if keys and (MOMENTUM in keys) != muon:
                raise ValueError(
                    f"the saved optimizer state ({', '.join(sorted(keys))}) is not "
                    f"{'Muon' if muon else 'AdamW'}'s for a {tuple(p.shape)} "
                    "parameter: resume with the saved run's optim.algorithm"
                )
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on the Muon groups, then torch's AdamW step on the rest."""
        if closure is not None:
            raise ValueError("TPMuon.step takes no closure")
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
        if self.adamw is not None:
            self.adamw.step()

    def _muon_group(self, group: dict) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, state = p.grad, self.state[p]
            if MOMENTUM not in state:
                state[MOMENTUM] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state[MOMENTUM]
            # torch's _single_tensor_muon, with the gather around Newton-Schulz:
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            full = self._gather(update, p)
            ortho = _zeropower_via_newtonschulz(
                full, group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], full.shape)
            p.mul_(1 - lr * wd)
            p.add_(self._slice(ortho, p), alpha=-adjusted_lr)

    def _gather(self, local: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """The full matrix of ``p``'s TP slices ``local`` (itself when not split)."""
        dim, size = tp_dim(p), group_size(self.tp_group)
        if dim is None or size == 1:
            return local
        full = all_gather_dim(local, dim, self.tp_group)
        return dedupe_gathered(full, replicas(p), size) if dim == 0 else full

    def _slice(self, full: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """This rank's slice of a full matrix of ``p`` (the inverse of :meth:`_gather`)."""
        dim, size = tp_dim(p), group_size(self.tp_group)
        if dim is None or size == 1:
            return full
        copies = replicas(p) if dim == 0 else 1
        return full.chunk(size // copies, dim=dim)[group_rank(self.tp_group) // copies]


def build_muon(model: nn.Module, cfg, tp_group: dist.ProcessGroup | None) -> TPMuon:
    """:class:`TPMuon` for ``model`` with ``cfg`` (an ``OptimConfig``): Muon on
    :func:`muon_param_names`, AdamW on the rest (weight decay on its matrices only, as
    ``engine.optim.build_optimizer`` groups them)."""
    chosen = set(muon_param_names(model))
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if name in chosen else decay if p.dim() >= 2 else no_decay).append(p)
    return TPMuon(
        muon,
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        tp_group=tp_group,
    )
