"""The mixture-of-experts router: which k experts each token goes to, with what weight.

Two kinds (``cfg.moe_router``):

* ``"softmax"`` (Mixtral, Qwen2-MoE, Qwen3-MoE): p = softmax(z) over the E experts, the k
  largest chosen, their p the weights, renormalised to sum 1 when ``cfg.moe_renormalize``
  (Mixtral, Qwen3-MoE; Qwen2-MoE does not).
* ``"sigmoid"`` (DeepSeek-V3): s = sigmoid(z); the k largest of s + b are chosen, where b
  is a per-expert bias buffer that no gradient touches (``update_bias`` moves it after a
  step); the weights are the chosen s (not s + b), renormalised when asked. The step
  runners move it after every training step by the load of the whole global batch
  (``engine.moe_observe.MoEWindow.end_step``), and checkpoints keep it in their trainer
  state (``router_biases`` / ``load_router_biases``), so a resumed run and a server
  loading the checkpoint route as the run did.

**Precision** (``cfg.moe_router_dtype``, Megatron-Core's ``moe_router_dtype``): the
logits z = x·W_rᵀ are computed in the wider of the model's dtype and the router dtype (a
bf16 model's router runs in fp32, and so does an fp32 model's under bf16 autocast, which
the router turns off for its GEMM); the probabilities, the choice, the weights and the
losses in the router dtype. At "fp32" an fp64 model rounds its routing weights to fp32 exactly as
transformers' MoE blocks do (their softmax is ``dtype=torch.float``); "fp64" keeps them
exact, for float64 proofs of the math.

**Ties** are broken by the lower expert index, at every layout: the choice is a stable
descending sort of the scores (``stable_top_k``), not ``torch.topk``, whose order among
equal values is unspecified.

**Capacity** (``cfg.moe_capacity_factor``; None: dropless). Each expert takes at most
C = ⌈factor · T · k / E⌉ of the T tokens' k·T token-slots; past C it keeps the slots of the
highest selection score (p, or s + b) and, among equal scores, of the earlier token (the
lower index in the flattened ``[s, b]`` order). A dropped slot adds nothing to its token's
output; the token still passes through the residual. Weights are renormalised before
dropping, so a dropped slot does not raise its token's other weights.

**Losses** (``RouterLosses``), per forward on the tokens it was given:

* load balancing, transformers' ``load_balancing_loss_func`` for one layer (the
  Switch/GShard form): E · Σ_i f_i · P_i, with f_i = (token-slots chosen for expert i) / T
  (before dropping; it sums to k) and P_i the mean over tokens of expert i's probability:
  p for softmax, s / Σ_j s_j for sigmoid (DeepSeek-V3's normalised scores). Only P carries
  a gradient. ``pooled_load_balancing_loss`` gives transformers' several-layer form, which
  pools f and P over layers before multiplying.
* z-loss (ST-MoE): the mean over tokens of logsumexp(z)².

What a trainer adds for one forward is ``router_objective`` of every layer's losses:
``cfg.moe_aux_loss_pooling`` "layer" sums each layer's weighted losses; "model" weighs the
pooled load-balancing loss once (transformers' ``router_aux_loss_coef · aux_loss``) and
adds each layer's weighted z-loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from layers.linear import replicated_weight
from layers.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from layers.param_roles import mark_sp_partial_grad
from layers.transformer_config import TransformerConfig
from layers.utils import comm_timer_of

ROUTERS = ("softmax", "sigmoid")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
AUX_LOSS_POOLINGS = ("layer", "model")
BIAS_KEY = ".expert_bias"  # a sigmoid router's bias in a full state dict: <router name> + this


@dataclass
class RouterLosses:
    """One forward's router statistics and losses (tensors; nothing is synchronised).

    ``loss`` is what a trainer adds to the model loss: aux_coeff · aux + z_coeff · z.
    """

    aux: torch.Tensor  # load-balancing loss (unweighted, transformers' value), scalar
    z: torch.Tensor  # router z-loss (unweighted), scalar
    loss: torch.Tensor  # the weighted sum to add to the training loss, scalar
    slots_per_expert: torch.Tensor  # [E] int64, token-slots chosen per expert (pre-drop)
    prob_sum: torch.Tensor  # [E] Σ over tokens of P's per-token probabilities (with grad)
    tokens: int  # T, the tokens routed
    dropped: torch.Tensor  # int64 scalar: token-slots dropped past capacity (0: dropless)
    aux_coeff: float  # the weights ``loss`` applies, for ``router_objective``'s pooled form
    z_coeff: float
    cp_group: dist.ProcessGroup | None = None  # where the balance statistics are summed


@dataclass
class Routing:
    """Where the T tokens go: ``experts[t, j]`` is token t's j-th choice (descending
    score), ``weights[t, j]`` its weight, ``keep[t, j]`` whether it fits the capacity
    (None: dropless, all kept)."""

    logits: torch.Tensor  # [T, E], the wider of the model's and the router's dtype
    experts: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k], the router's dtype
    keep: torch.Tensor | None  # [T, k] bool


def stable_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of each row of ``scores``, largest first; equal scores
    in the lower index first (a stable descending sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class _LinearWithoutAutocast(torch.autograd.Function):
    """``x · wᵀ`` in the operands' dtype under autocast too, forward and backward (autocast
    would run the GEMMs in bf16). A Function, not an ``autocast(enabled=False)`` block: in
    a compiled graph the block's backward is traced under the outer autocast, in bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return x @ w.T

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            grad = grad.to(x.dtype)
            return grad @ w, grad.T @ x


def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` int64: how many of ``ids`` (any shape, each in [0, n)) equal 0, 1, …, n-1.
    ``torch.bincount``'s result, but its length is ``n`` whatever the data (bincount's
    depends on the largest id, which ends a compiled graph)."""
    flat = ids.reshape(-1).long()
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Token-slots one expert takes: ⌈factor · tokens · top_k / num_experts⌉."""
    return math.ceil(factor * tokens * top_k / num_experts)


def capacity_keep(
    experts: torch.Tensor, scores: torch.Tensor, limit: int, num_experts: int
) -> torch.Tensor:
    """``[T, k]`` bool: which token-slots fit ``limit`` slots per expert. Within an expert,
    slots rank by ``scores`` (``[T, k]``) descending, then by token index ascending."""
    flat_experts, n = experts.reshape(-1), experts.numel()
    # Two stable sorts: by score (ties keep slot order, i.e. token order, since a token
    # picks an expert at most once), then by expert, which keeps the score order inside.
    by_score = torch.argsort(-scores.reshape(-1), stable=True)
    grouped = by_score[torch.argsort(flat_experts[by_score], stable=True)]
    counts = expert_counts(flat_experts, num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(flat_experts)
    rank[grouped] = torch.arange(n, device=experts.device) - starts[flat_experts[grouped]]
    return (rank < limit).reshape(experts.shape)


def load_balancing_loss(
    slots: torch.Tensor, prob_sum: torch.Tensor, tokens: int, cp_group=None
) -> torch.Tensor:
    """E · Σ_i f_i · P_i with f_i = slots_i / T and P_i = prob_sum_i / T.

    With a ``cp_group`` of several ranks (context parallelism: each holds part of every
    sequence) the three are first summed over it, so every cp rank has the whole
    sequences' loss, as the unsplit model does (the product of per-part means is not the
    mean's product). ``prob_sum``'s backward sums over the group too (g then f): each cp
    rank's objective holds that same loss, and the gradient group averages over cp.
    """
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        slots = reduce_from_tp(slots, cp_group)  # counts: no gradient
        prob_sum = copy_to_tp(reduce_from_tp(prob_sum, cp_group), cp_group)
        tokens = tokens * dist.get_world_size(cp_group)
    slots = slots.to(prob_sum.dtype)
    return slots.numel() * (slots / tokens * prob_sum / tokens).sum()


def pooled_load_balancing_loss(layers: list[RouterLosses]) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over several layers: f and P averaged
    over every layer's tokens first, then E · Σ_i f_i · P_i (not the mean of the layers'
    own losses); over the layers' ``cp_group`` as :func:`load_balancing_loss` says."""
    rows = sum(one.tokens for one in layers)
    slots = sum(one.slots_per_expert for one in layers)
    probs = sum(one.prob_sum for one in layers)
    return load_balancing_loss(slots, probs, rows, layers[0].cp_group)


def router_objective(layers: list[RouterLosses], pooling: str = "layer") -> torch.Tensor:
    """The router losses one forward adds to the training loss (``layers``: every MoE
    layer's, in model order). "layer": Σ each layer's ``loss``. "model": aux_coeff · the
    pooled load-balancing loss (transformers' ``router_aux_loss_coef · aux_loss``, one
    value for the model) plus each layer's z_coeff · z."""
    if pooling == "layer":
        return sum(one.loss for one in layers)
    if pooling != "model":
        raise ValueError(
            f"model.moe_aux_loss_pooling={pooling!r} is not one of {AUX_LOSS_POOLINGS}"
        )
    total = layers[0].aux_coeff * pooled_load_balancing_loss(layers)
    for one in layers:
        if one.z_coeff:  # a zero weight adds nothing, not even 0 · z
            total = total + one.z_coeff * one.z
    return total


class TopKRouter(nn.Module):
    """z = x·W_rᵀ at the router's precision, then ``cfg.moe_top_k`` experts (module docstring).

    ``weight``: ``[E, h]``, like transformers' ``gate.weight``. The sigmoid router also
    holds ``expert_bias`` (``[E]``, fp32, a buffer), which only ``update_bias`` changes.

    Every rank of ``tp_group`` holds the whole ``weight`` and routes all the tokens of its
    DP slice, so the TP ranks route alike. Under sequence parallelism each computes its own
    block's logits and they are all-gathered (backward: each rank keeps its block's rows),
    so ``weight``'s gradient is a per-rank partial sum, summed over TP as a norm's is.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, cfg.sequence_parallel
        self.kind, self.top_k = cfg.moe_router, cfg.moe_top_k
        self.num_experts, self.renormalize = cfg.moe_num_experts, cfg.moe_renormalize
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.bias_update_rate = cfg.moe_bias_update_rate
        self.router_dtype = ROUTER_DTYPES[cfg.moe_router_dtype]
        shape = (self.num_experts, cfg.hidden_size)
        self.weight = replicated_weight(shape, cfg.init_std, dtype, device)
        # Under sequence parallelism each TP rank's logits cover its own block of tokens.
        mark_sp_partial_grad(self.weight, self.sequence_parallel)
        if self.kind == "sigmoid":
            bias = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            self.register_buffer("expert_bias", bias)
        self.last_losses: RouterLosses | None = None
        # The context-parallel ranks holding the rest of each sequence (route_over_context).
        self.cp_group: dist.ProcessGroup | None = None

    def forward(self, tokens: torch.Tensor) -> Routing:
        """``tokens``: ``[T, h]`` (under sequence parallelism this TP rank's block of the
        sequence; the logits of every block are gathered, so the routing covers them all).
        Sets ``last_losses`` and returns the ``Routing``."""
        wide = torch.promote_types(tokens.dtype, self.router_dtype)
        logits = _LinearWithoutAutocast.apply(tokens.to(wide), self.weight.to(wide))  # [T, E]
        if self.sequence_parallel:  # all-gather forward, this block's rows backward
            timer = comm_timer_of(self)
            logits = gather_from_tp(logits, self.tp_group, dim=0, comm_timer=timer)
        scores = logits.to(self.router_dtype)
        if self.kind == "softmax":
            probs = scores.softmax(-1)
            select, balance = probs, probs
        else:
            probs = scores.sigmoid()
            select = probs + self.expert_bias.to(self.router_dtype)
            balance = probs / probs.sum(-1, keepdim=True)
        experts = stable_top_k(select.detach(), self.top_k)  # [T, k]
        weights = probs.gather(1, experts)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = None
        if self.capacity_factor is not None:
            limit = capacity(len(logits), self.top_k, self.num_experts, self.capacity_factor)
            keep = capacity_keep(
                experts, select.detach().gather(1, experts), limit, self.num_experts
            )
        self.last_losses = self._losses(scores, balance, experts, keep)
        return Routing(logits=logits, experts=experts, weights=weights, keep=keep)

    def _losses(self, logits, balance, experts, keep) -> RouterLosses:
        tokens = len(logits)
        slots = expert_counts(experts, self.num_experts)
        prob_sum = balance.sum(0)
        aux = load_balancing_loss(slots, prob_sum, tokens, self.cp_group)
        z = logits.logsumexp(-1).square().mean()
        dropped = (~keep).sum() if keep is not None else slots.new_zeros(())
        return RouterLosses(
            aux=aux,
            z=z,
            loss=self.aux_coeff * aux + self.z_coeff * z,
            slots_per_expert=slots,
            prob_sum=prob_sum,
            tokens=tokens,
            dropped=dropped,
            aux_coeff=self.aux_coeff,
            z_coeff=self.z_coeff,
            cp_group=self.cp_group,
        )

    @torch.no_grad()
    def update_bias(self, slots_per_expert: torch.Tensor | None = None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: b_i += γ · sign(mean load − load_i),
        γ = ``cfg.moe_bias_update_rate``. ``slots_per_expert`` is the load to balance
        (None: the last forward's); a trainer passes the sum over its micro-batches (and,
        under data parallelism, over the ranks that route with the same bias)."""
        if self.kind != "sigmoid":
            raise ValueError(
                f"update_bias moves the sigmoid router's expert bias; this router is "
                f"{self.kind!r} (set model.moe_router=sigmoid)"
            )
        load = self.last_losses.slots_per_expert if slots_per_expert is None else slots_per_expert
        load = load.to(self.expert_bias)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


def sigmoid_routers(model: nn.Module) -> dict[str, TopKRouter]:
    """``model``'s sigmoid routers by module name (the names a pipeline stage keeps too)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, TopKRouter) and m.kind == "sigmoid"
    }


def router_biases(model: nn.Module) -> dict[str, list[float]]:
    """Every sigmoid router's ``expert_bias`` of ``model``, by module name, as numbers
    (exact: an fp32 value is a Python float, which JSON writes to the last bit)."""
    return {name: m.expert_bias.tolist() for name, m in sigmoid_routers(model).items()}


@torch.no_grad()
def load_router_biases(model: nn.Module, saved: dict[str, list[float]] | None) -> None:
    """Set ``model``'s sigmoid routers' biases from :func:`router_biases` output (of the
    whole model: a pipeline stage takes its own routers'). A router the record does not
    name keeps its bias (a checkpoint written before biases were saved has none); one
    of another expert count is refused."""
    for name, router in sigmoid_routers(model).items():
        value = (saved or {}).get(name)
        if value is None:
            continue
        if len(value) != router.num_experts:
            raise ValueError(
                f"{name}: the checkpoint holds {len(value)} expert biases for "
                f"{router.num_experts} experts: not this model's checkpoint"
            )
        router.expert_bias.copy_(torch.tensor(value, dtype=torch.float32))
