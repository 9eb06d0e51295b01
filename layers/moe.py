"""The mixture-of-experts MLP: a router, E experts computed as a grouped GEMM, an optional
shared expert. The "moe" entry of ``layers.spec.MLPS``.

One forward, for the T = s·b tokens of ``[s, b, h]``:

1. route (``layers.router``): each token's k experts, their weights, and which token-slots
   fit the capacity;
2. permute (``permute``): the kept token-slots sorted by expert, stably, so each expert's
   rows stay in token order: ``[n, h]`` with ``counts[e]`` rows per expert;
3. compute (``GroupedExperts``): fc1, SwiGLU (or GeLU), fc2 per expert as grouped GEMMs;
4. unpermute (``unpermute``): the rows back to their slots (a dropped slot stays zero),
   then each token's output is Σ_j weight_j · row_j, summed over j = 0 … k−1 in that
   order (no scatter-add, so the sum is the same on every device);
5. plus sigmoid(x·g) · shared(x) when there is a shared expert (Qwen2-MoE's gate).

Under expert parallelism (``shard_experts``: each of the ``expert`` group's ep ranks keeps
``E / ep`` experts) steps 1–2 and 4 stay on this rank, so routing, ties and drops are
those of ep 1, and step 3 is wrapped in ``layers.expert_parallel``'s dispatch and
combine all-to-alls.

Under tensor parallelism (``MoEMLP``'s docstring) every TP rank routes the same tokens
alike, holds a TP slice of every expert (as the dense MLP's split) and sums the experts'
partial outputs once after step 4; the ep all-to-alls then run within each TP rank's own
ep group (the ``expert`` role keeps the TP index), moving the same rows as at tp 1.

The expert weights are ``[E, in, out]`` tensors (``x @ w[e]``), fc1's columns interleaved
gate/up as ``layers.mlp``'s: giving each of several ranks its experts is a slice along
dim 0. The router's losses of the last forward are ``self.router.last_losses``
(``RouterLosses``: ``loss`` is what a trainer adds; ``moe_losses(model)`` collects them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from layers.expert_parallel import combine, dispatch, expert_range
from layers.kernel_set import Kernels, resolve_kernels
from layers.linear import replicated_weight
from layers.mappings import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from layers.mlp import ParallelMLP, activate, activation_kind
from layers.param_roles import mark_expert, mark_sp_partial_grad, mark_tp_dim
from layers.router import RouterLosses, Routing, TopKRouter, expert_counts
from layers.transformer_config import TransformerConfig
from layers.utils import as_autocast, comm_timer_of, shard
from parallel_state.groups import group_rank, group_size, resolve_tp_group
from parallel_state.random import RNGTracker

GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x`` ``[n, K]`` and ``w`` ``[E, K, N]``: CPU or
    CUDA; bf16, fp16 or fp32 (bf16 only while compiling: its meta kernel takes no other,
    torch 2.13); rows of 16-byte multiples. fp64 never (the float64 tests take the loop)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    if x.dtype not in GROUPED_MM_DTYPES or w.dtype != x.dtype:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    align = 16 // x.element_size()
    return len(x) > 0 and x.shape[1] % align == 0 and w.shape[2] % align == 0


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, impl: str = "auto"
) -> torch.Tensor:
    """``[n, K]`` rows, ``counts[e]`` of them (in order) for expert e, times ``w[e]``
    (``w``: ``[E, K, N]``) → ``[n, N]``. ``impl``: "grouped" (``torch._grouped_mm``),
    "loop" (one matmul per expert) or "auto" (grouped where ``grouped_mm_fits``).

    Under autocast both are cast to its dtype first, as autocast casts a matmul's inputs:
    ``torch._grouped_mm`` is not on autocast's list (it would run fp32 weights in fp32), and
    with the fp32 weights beside bf16 rows "auto" would take the loop, with its host sync
    and, while compiling, a graph break and a recompilation per new set of counts."""
    x, w = as_autocast(x), as_autocast(w)
    if impl == "grouped" or (impl == "auto" and grouped_mm_fits(x, w)):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offsets)
    return _per_expert_mm(x, w, counts)


@torch.compiler.disable
def _per_expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_mm``'s loop, run eagerly between compiled graphs: it needs the counts on
    the host (a sync), and traced, each new set of counts (every decode step's) and each
    weight shape recompiled it until Dynamo's recompile limit sent it to eager anyway."""
    rows = x.split(counts.tolist())
    return torch.cat([chunk @ w[e] for e, chunk in enumerate(rows)])


def permute(
    tokens: torch.Tensor, routing: Routing, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept token-slots of ``tokens`` ``[T, h]`` grouped by expert: (rows ``[n, h]``,
    ``order`` ``[n]``: the slot t·k + j each row came from, ``counts`` ``[E]``).

    Each token is first copied k times (its backward sums the k slot gradients in order);
    the rows are then a gather by distinct slots, so no gradient is scattered with atomics.
    """
    k = routing.experts.shape[1]
    key = routing.experts.reshape(-1)
    if routing.keep is not None:  # dropped slots sort past every expert and are cut off
        key = key.masked_fill(~routing.keep.reshape(-1), num_experts)
    counts = expert_counts(key, num_experts + 1)[:num_experts]
    order = torch.argsort(key, stable=True)
    if routing.keep is not None:  # the kept count is data: one host sync, only when dropping
        order = order[: int(counts.sum())]
    slots = tokens.unsqueeze(1).expand(-1, k, -1).reshape(-1, tokens.shape[-1])
    return slots[order], order, counts


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The inverse of ``permute``, combined: each row back in its slot (dropped slots zero),
    then Σ_j ``weights[t, j]`` · slot (t, j) for each token → ``[T, h]``."""
    tokens, k = weights.shape
    slots = rows.new_zeros(tokens * k, rows.shape[-1]).index_copy(0, order, rows)
    slots = slots.view(tokens, k, -1) * weights.to(rows.dtype).unsqueeze(-1)
    return slots.sum(1)


def tp_block(weight: nn.Parameter, dim: int, tp_rank: int, tp_size: int) -> nn.Parameter:
    """TP rank ``tp_rank``'s contiguous block along ``dim`` of the full ``weight``, as a
    parameter marked split there (the whole of it, so marked, at tp 1)."""
    return mark_tp_dim(nn.Parameter(shard(weight.data, dim, tp_rank, tp_size)), dim)


class GroupedExperts(nn.Module):
    """E SwiGLU (or GeLU) MLPs without biases, as two ``[E, in, out]`` weights.

    ``fc1``: ``[E, h, 2·f_e]`` (gated: gate and up columns interleaved, ``(f two)``) or
    ``[E, h, f_e]``; ``fc2``: ``[E, f_e, h]``, drawn with the residual-branch std
    init_std / √(2·layers) as the dense MLP's fc2. The full weights are drawn on the CPU from
    the seed, so any later split over ranks holds slices of the same experts. TP rank r of
    ``tp_size`` keeps the r-th block of every expert's f_e columns of fc1 and rows of fc2,
    so its output rows are partial sums over TP (summed by ``MoEMLP``).
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        kernels: Kernels,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.gated, self.approximate = activation_kind(cfg.activation)
        experts, h, f = cfg.moe_num_experts, cfg.hidden_size, cfg.moe_ffn_size
        width = f * (2 if self.gated else 1)
        fc1 = replicated_weight((experts, h, width), cfg.init_std, dtype, device)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        fc2 = replicated_weight((experts, f, h), out_std, dtype, device)
        # Over TP as the dense MLP: fc1 by columns (the interleaved gate/up pairs stay
        # together), fc2 by rows.
        self.fc1 = tp_block(fc1, 2, tp_rank, tp_size)
        self.fc2 = tp_block(fc2, 1, tp_rank, tp_size)
        for weight in (self.fc1, self.fc2):
            mark_expert(weight)
        self.impl = "auto"  # grouped_mm's choice; the tests set "loop" or "grouped"

    @torch.no_grad()
    def keep_experts(self, ep_rank: int, ep_size: int) -> None:
        """Keep only ep rank ``ep_rank``'s ``E / ep_size`` experts (a dim-0 slice of the full
        weights, which every rank drew alike from the seed)."""
        first, end = expert_range(self.fc1.shape[0], ep_rank, ep_size)
        for weight in (self.fc1, self.fc2):
            weight.data = weight.data[first:end].clone()
            mark_expert(weight, ep_size, ep_rank)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[n, h]`` grouped by expert, ``counts`` ``[E]`` → ``[n, h]``."""
        hidden = grouped_mm(rows, self.fc1, counts, impl=self.impl)
        hidden = activate(self.kernels, hidden, None, self.gated, self.approximate)
        return grouped_mm(hidden, self.fc2, counts, impl=self.impl)


class MoEMLP(nn.Module):
    """Router, grouped experts and an optional gated shared expert (module docstring).

    Constructed as every MLP slot is (``layers.spec``); ``rng`` unused (no dropout). Holds
    every expert until ``shard_experts`` gives it an ``ep_group`` and keeps this rank's
    ``E / ep`` of them.

    Over ``tp_group`` the experts split as the dense ``ParallelMLP`` does (each expert's
    fc1 by columns, gate/up pairs kept together; fc2 by rows), and the router and the
    shared expert's gate are replicated. Every TP rank routes the same tokens with the
    same logits (under sequence parallelism each rank's block's logits, all-gathered), so
    routing, ties and drops are those of tp 1. The experts' input is Megatron's f (copy to
    the TP region; under sequence parallelism the all-gathered sequence), so each TP rank
    dispatches the same rows over its own ep group, with its own slice of every expert;
    after unpermute the partial outputs are summed once by g (all-reduce; reduce-scatter
    under sequence parallelism). The routing weights pass f too: each rank's gradient of
    them sees only its slice's partial rows, and f's backward sums them. The shared expert
    is the ``ParallelMLP`` it is at any tp, with its own reduction (it lives inside its
    row-parallel fc2; folding it into the experts' would need an fc2 without it). Under
    sequence parallelism the router's and the gate's gradients cover this rank's tokens
    only and are summed over TP after backward, as a norm's are (``layers.tp_grads``).
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        tp_group: dist.ProcessGroup | None,
        rng: RNGTracker | None = None,
        kernels: Kernels | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group = resolve_tp_group(tp_group)
        self.sequence_parallel = cfg.sequence_parallel
        kernels = kernels or resolve_kernels(cfg.kernels)
        self.num_experts = cfg.moe_num_experts
        self.ep_group: dist.ProcessGroup | None = None  # set by shard_experts
        factory = dict(dtype=dtype, device=device)
        tp = dict(tp_rank=group_rank(tp_group), tp_size=group_size(tp_group))
        # Built in this order (the master weights' draws follow it).
        self.router = TopKRouter(cfg, tp_group=tp_group, **factory)
        self.experts = GroupedExperts(cfg, kernels, **tp, **factory)
        self.shared_expert = self.shared_gate = None
        if cfg.moe_shared_ffn_hidden_size:
            self.shared_expert = ParallelMLP(
                cfg,
                tp_group=tp_group,
                kernels=kernels,
                ffn_size=cfg.moe_shared_ffn_hidden_size,
                **factory,
            )
            if cfg.moe_shared_gate:  # Qwen2-MoE's shared_expert_gate: [1, h], no bias
                shape = (1, cfg.hidden_size)
                self.shared_gate = replicated_weight(shape, cfg.init_std, dtype, device)
                mark_sp_partial_grad(self.shared_gate, self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) → (the same
        shape, None: no bias to add)."""
        timer = comm_timer_of(self)
        routing = self.router(x.reshape(-1, x.shape[-1]))  # every token, in (s, b) order
        weights = copy_to_tp(routing.weights, self.tp_group, comm_timer=timer)
        if self.sequence_parallel:
            tokens = gather_from_sequence(x, self.tp_group, comm_timer=timer)
        else:
            tokens = copy_to_tp(x, self.tp_group, comm_timer=timer)
            if torch.compiler.is_compiling():
                # A graph may end here: permute's kept count under a capacity factor,
                # and in fp32 the experts' per-expert loop, need values on the host (in
                # bf16 without a capacity the whole layer is one graph). f's forward is the
                # identity, so its output would leave the graph as a view of x, which
                # AOTAutograd rebuilds outside the graph without f's backward (the
                # all-reduce): at tp 2 the MLP input's gradient came out up to 97 % off
                # (tests/test_compile_layouts.py). A copy keeps f in the graph's backward.
                tokens = tokens.clone()
        tokens = tokens.reshape(-1, x.shape[-1])  # [T, h], T = s·b
        rows, order, counts = permute(tokens, routing, self.num_experts)
        # The experts' GEMM casts the rows to autocast's dtype (grouped_mm): cast them
        # before the all-to-all instead, which then moves half the bytes of the fp32 a
        # norm hands over, each way, for the same numbers.
        rows = as_autocast(rows)
        rows, counts, plan = dispatch(rows, counts, self.ep_group)  # to the experts' ranks
        rows = combine(self.experts(rows, counts), plan)  # and back
        out = unpermute(rows, order, weights).view(-1, *x.shape[1:])  # this TP slice's part
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(out, self.tp_group, comm_timer=timer)
        else:
            out = reduce_from_tp(out, self.tp_group, comm_timer=timer)
        if self.shared_expert is not None:
            shared, _ = self.shared_expert(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(x @ self.shared_gate.T) * shared
            out = out + shared
        return out, None


def route_over_context(model: nn.Module, cp_group: dist.ProcessGroup | None) -> nn.Module:
    """Give every router of ``model`` the context-parallel group (the ranks holding the
    other parts of the same sequences), over which its load-balancing statistics are
    summed (``layers.router.load_balancing_loss``); the z-loss is a per-token mean, which
    the cp average already makes the whole sequences'. ``model`` itself, for chaining."""
    if group_size(cp_group) > 1:
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.cp_group = cp_group
    return model


def shard_experts(model: nn.Module, ep_group: dist.ProcessGroup | None) -> nn.Module:
    """Split every MoE layer of ``model`` over ``ep_group`` (the mesh's ``expert`` role):
    each rank keeps its ``E / ep`` experts and dispatches tokens to the others'. Nothing
    changes when the group has one rank. Returns ``model``."""
    ep_size = group_size(ep_group)
    for module in model.modules():
        if isinstance(module, MoEMLP) and ep_size > 1:
            if module.num_experts % ep_size:
                raise ValueError(
                    f"model.moe_num_experts={module.num_experts} is not divisible by "
                    f"ep_size={ep_size}; choose an ep_size dividing {module.num_experts}"
                )
            module.experts.keep_experts(group_rank(ep_group), ep_size)
            module.ep_group = ep_group
    return model


def moe_losses(model: nn.Module) -> list[RouterLosses]:
    """The ``RouterLosses`` of every router in ``model``'s last forward, in module order;
    a trainer adds ``sum(one.loss for one in moe_losses(model))`` to the model loss."""
    return [
        m.last_losses
        for m in model.modules()
        if isinstance(m, TopKRouter) and m.last_losses is not None
    ]
