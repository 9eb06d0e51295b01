"""Tensor-parallel self-attention: whole heads per TP rank, one fused QKV projection.

The fused QKV weight's output rows are ordered per head, ``(heads three d)``::

    [head0: q k v | head1: q k v | ...]

so the contiguous slice a ColumnParallelLinear keeps on each TP rank holds complete heads
with their q, k and v together, and no communication is needed until the row-parallel
output projection sums the heads' contributions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange
from torch import nn

from layers import dropout
from layers.documents import DocumentMask, PaddingMask
from layers.gqa import kv_projection
from layers.kernel_set import Kernels
from layers.linear import (
    ColumnParallelLinear,
    branch_options,
    normal_init,
    residual_output_linear,
)
from layers.norm import NORMS
from layers.param_roles import mark_sp_partial_grad
from layers.quantize import kv_layout
from layers.recompute import checkpointed
from layers.ring_attention import ring_attention, shard_for_cp
from layers.rotary import apply_rotary
from layers.transformer_config import TransformerConfig
from parallel_state.groups import group_rank, group_size, resolve_tp_group
from parallel_state.random import RNGTracker


def heads_per_rank(num_heads: int, tp_size: int) -> int:
    """Heads each TP rank owns; raises naming both numbers when they do not divide."""
    if num_heads % tp_size:
        raise ValueError(
            f"num_heads ({num_heads}) is not divisible by the tensor-parallel size ({tp_size}); "
            "each TP rank must own whole attention heads"
        )
    return num_heads // tp_size


class KVCache:
    """Keys and values of the positions one attention layer has seen, for this rank's heads.

    Under tensor parallelism each rank holds only its own heads' keys and values, so the
    cache needs no communication. It is preallocated to ``capacity`` positions: a decoding
    step writes one slot instead of copying the whole past, so per-token time stays flat as
    the context grows. Made by :meth:`ParallelAttention.new_cache`, passed in explicitly.
    """

    def __init__(
        self, batch: int, heads: int, head_dim: int, capacity: int, *, dtype, device
    ) -> None:
        self.keys = torch.empty(batch, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0  # positions filled so far

    @property
    def capacity(self) -> int:
        """Positions the cache can hold."""
        return self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[b, heads, n, d]`` new keys and values; return all of them so far."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, {end} were needed")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def decoder_mask(
    key_mask: torch.Tensor | None, queries: int, past: int, *, batch: int, device
) -> torch.Tensor:
    """Boolean ``[b, 1, queries, past + queries]``: True where a query may attend to a key.

    The queries are the last ``queries`` positions. A key is visible when it is not later
    than the query (causal) and ``key_mask`` (``[b, past + queries]``, False at padding)
    allows it. Every query also sees itself, so a padding query attends to something and
    yields no NaN that the masked-out product ``0 · NaN`` would spread to real rows.
    """
    keys = past + queries
    causal = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(past)
    mask = causal.expand(batch, 1, queries, keys)
    if key_mask is not None:
        mask = mask & key_mask.bool()[:, None, None, :]
    diagonal = torch.zeros(queries, keys, dtype=torch.bool, device=device)
    diagonal[:, past:] = torch.eye(queries, dtype=torch.bool, device=device)
    return mask | diagonal


def sliding_window_mask(queries: int, keys: int, window: int, *, device=None) -> torch.Tensor:
    """Boolean ``[queries, keys]``: True where a query may attend to a key under causal
    attention limited to the last ``window`` keys (itself included).

    The queries are the last ``queries`` of the ``keys`` positions (a KV cache's past comes
    first), so query i sits at position ``keys - queries + i`` and sees the keys j with
    ``position - window < j <= position``.
    """
    at = torch.arange(keys - queries, keys, device=device)[:, None]
    key = torch.arange(keys, device=device)[None, :]
    return (key <= at) & (key > at - window)


def windowed(mask: torch.Tensor | None, queries: int, keys: int, window: int, *, device):
    """``mask`` (None: plain causal; else boolean, broadcastable to ``[b, heads, queries,
    keys]``) limited to the last ``window`` keys of each query (:func:`sliding_window_mask`)."""
    limit = sliding_window_mask(queries, keys, window, device=device)
    return limit if mask is None else mask & limit


class CoreAttention(nn.Module):
    """softmax(QKᵀ/√d)·V with attention dropout, over this rank's heads.

    Input q ``[b, heads/tp, s, d]``, k and v ``[b, kv heads on this rank, s, d]`` (each KV
    head serves a run of query heads); output ``[s, b, heads/tp · d]`` (TP-sharded on its
    last dim). With ``recompute=True`` nothing inside is kept for backward (selective
    recomputation): the s×s scores are the largest activations of a layer and the
    cheapest to recompute.
    """

    def __init__(
        self,
        dropout: float,
        *,
        causal: bool,
        recompute: bool,
        rng: RNGTracker | None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.dropout, self.causal, self.recompute, self.rng = dropout, causal, recompute, rng
        # Sliding window (last ``window`` keys), score scale (None: 1/√d) and soft cap.
        self.window, self.scale, self.softcap = window, scale, softcap

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """A ``mask`` given to causal attention is the whole pattern (see ``decoder_mask``);
        a ``DocumentMask`` (packed documents) or ``PaddingMask`` becomes its dense pattern."""
        if self.recompute:
            # No dropout, no draws to replay: a plain checkpoint (Dynamo traces it whole).
            rng = self.rng if self.dropout > 0 and self.training else None
            return checkpointed(self._attend, q, k, v, mask, rng=rng)
        return self._attend(q, k, v, mask)

    def _attend(self, q, k, v, mask):
        if isinstance(mask, (DocumentMask, PaddingMask)):  # explicit: correctness first
            mask = mask.dense(causal=self.causal)
        if self.window is not None:  # validated causal: the window limits the causal mask
            mask = windowed(mask, q.shape[2], k.shape[2], self.window, device=q.device)
        if k.shape[1] != q.shape[1]:  # grouped-query: each KV head serves a run of q heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        p = self.dropout if self.training else 0.0
        # Attention probabilities are TP-sharded (each rank has its own heads): sharded stream.
        out = dropout.attention(
            q,
            k,
            v,
            mask,
            p,
            causal=self.causal,
            rng=self.rng,
            scale=self.scale,
            softcap=self.softcap,
        )
        return rearrange(out, "b heads s d -> s b (heads d)")


class RingCoreAttention(CoreAttention):
    """The attention core of a context-parallel rank: this rank's queries over the whole
    sequence, whose keys and values travel around ``cp_group`` (``layers.ring_attention``).

    q, k, v hold this rank's share of the sequence in the load-balanced layout
    (``shard_for_cp``), already rotated at their global positions; only the KV heads
    travel. Nothing to recompute: the ring keeps no s×s scores.

    Attention dropout draws what the unsplit model's attention draws: every cp rank draws
    the whole ``[b, heads/tp, s, s]`` keep-mask from the sharded stream, as the unsplit
    ``F.scaled_dot_product_attention`` does (the same draw, ``layers.dropout.dropout_mask``;
    the cp ranks of a TP rank hold the same stream), and keeps the rows of its own queries;
    each block then reads it at the global (query, key) positions. The split changes which
    rank applies a pair's draw, never the draw. The price: the whole mask is drawn on each
    rank (b·heads·s² draws, a transient s×s buffer per layer) and 1/cp of it is kept for
    backward, one byte per element; a counter-based mask (a hash of the pair's positions)
    would draw each block alone, but would no longer be the unsplit model's draw.
    """

    def __init__(
        self,
        cp_group: dist.ProcessGroup,
        *,
        causal: bool,
        dropout: float = 0.0,
        rng: RNGTracker | None = None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(
            dropout,
            causal=causal,
            recompute=False,
            rng=rng,
            window=window,
            scale=scale,
            softcap=softcap,
        )
        self.cp_group = cp_group

    def _keep_rows(self, q: torch.Tensor, p: float) -> torch.Tensor:
        """This rank's query rows ``[b, heads, s/cp, s]`` of the keep-mask the unsplit
        attention draws now for ``[b, heads, s, s]`` probabilities (fp32 ones under fp16 or
        bf16, as the reference attention computes them)."""
        cp, rank = group_size(self.cp_group), group_rank(self.cp_group)
        b, heads, local, _ = q.shape
        dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        probs = torch.empty((b, heads, local * cp, local * cp), dtype=dtype, device=q.device)
        whole = dropout.dropout_mask(probs, p, rng=self.rng, sharded=True)
        return shard_for_cp(whole, cp, rank, dim=2)

    def _attend(self, q, k, v, mask):
        if mask is not None and not isinstance(mask, (DocumentMask, PaddingMask)):
            raise ValueError(
                "ring attention takes no dense mask: causal or full attention, a "
                "DocumentMask (packed documents) or a PaddingMask (padded rows)"
            )
        documents = mask.ids if isinstance(mask, DocumentMask) else None  # the full rows'
        keys = mask.keys if isinstance(mask, PaddingMask) else None
        p = self.dropout if self.training else 0.0
        out = ring_attention(
            q,
            k,
            v,
            cp_group=self.cp_group,
            causal=self.causal,
            document_ids=documents,
            key_mask=keys,
            dropout_p=p,
            dropout_keep=self._keep_rows(q, p) if p > 0 else None,
            scale=self.scale,
            window=self.window,
            softcap=self.softcap,
        )
        return rearrange(out, "b heads s d -> s b (heads d)")


class ParallelAttention(nn.Module):
    """Self-attention on ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

    ``mask``: None (causal or full attention, per ``cfg.causal``), a boolean tensor
    broadcastable to ``[b, heads, s, s]``, True where a query may attend to a key, or a
    ``layers.documents.DocumentMask`` (packed documents, block-diagonal).

    The "standard" entry of ``layers.spec.ATTENTIONS``; constructed as every attention slot
    is (``kernels`` runs the QK norms, if any; the attention core is torch's).
    ``cfg.qk_norm`` normalizes q and k per head (``cfg.norm``'s class over head_dim, one
    replicated ``[head_dim]`` weight each) before RoPE, as Qwen3 does; a ring then gets
    them normalized. A ``cp_group`` of several ranks (context parallelism) makes the core a ring (:class:`RingCoreAttention`): the input is
    then this rank's share of each sequence, and ``rotary`` holds its global positions.
    The layout, not the model config, decides, so one config runs at every cp size.

    ``window`` (from the layer's spec, ``layers.spec.spec_for``) limits each query to its
    last ``window`` keys; ``cfg.query_pre_attn_scalar`` and ``cfg.attn_logit_softcapping``
    set the scores' scale and soft cap. The ring applies all three, at global positions
    (``layers.ring_attention``).
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        tp_group: dist.ProcessGroup | None,
        rng: RNGTracker | None,
        kernels: Kernels | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        cp_group: dist.ProcessGroup | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        tp_group = resolve_tp_group(tp_group)
        heads_per_rank(cfg.num_heads, group_size(tp_group))
        self.head_dim = cfg.head_dim  # hidden / heads unless the config sets its own
        self.sequence_parallel = cfg.sequence_parallel
        common = branch_options(cfg, tp_group, dtype, device)
        self._build_projections(cfg, tp_group, common)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = (
                self._head_norm(cfg, kernels, dtype, device) for _ in range(2)
            )
        self.core = self._build_core(cfg, rng, cp_group, window)
        width = cfg.num_heads * self.head_dim  # the heads' concatenated output
        self.dense = residual_output_linear(cfg, width, common)

    def _head_norm(self, cfg: TransformerConfig, kernels, dtype, device) -> nn.Module:
        """A norm over one head's width, its weight shared by every head. Each TP rank
        normalizes only its own heads (whole sequences: the projections gathered them), so
        the weight's gradient is a partial sum over TP at any TP size: it is marked to be
        summed over TP after backward, as sequence-parallel norm weights are
        (``layers.param_roles``, ``layers.tp_grads``)."""
        norm = NORMS[cfg.norm](
            self.head_dim,
            cfg.layernorm_eps,
            kernels=kernels or cfg.kernels,
            dtype=dtype,
            device=device,
        )
        for p in norm.parameters():
            mark_sp_partial_grad(p, True)
        return norm

    @staticmethod
    def _build_core(cfg: TransformerConfig, rng, cp_group, window=None) -> CoreAttention:
        """The ring over ``cp_group`` when it has several ranks, else the local core; both
        take the layer's window, score scale and soft cap."""
        qpas = cfg.query_pre_attn_scalar
        reach = dict(
            window=window,
            scale=None if qpas is None else qpas**-0.5,
            softcap=cfg.attn_logit_softcapping,
        )
        if group_size(cp_group) == 1:
            recompute = cfg.recompute == "selective"
            return CoreAttention(
                cfg.attention_dropout, causal=cfg.causal, recompute=recompute, rng=rng, **reach
            )
        return RingCoreAttention(
            cp_group, causal=cfg.causal, dropout=cfg.attention_dropout, rng=rng, **reach
        )

    def _build_projections(self, cfg: TransformerConfig, tp_group, common: dict) -> None:
        """Multi-head: one fused ``qkv``, rows ``(heads three d)``. Grouped-query (fewer KV
        heads): ``query`` rows ``(heads d)`` and ``key_value`` rows ``(kv_heads two d)``,
        the latter split over TP or, past the KV heads, replicated (``layers.gqa``)."""
        self.kv_heads = cfg.num_kv_heads or cfg.num_heads
        bias, init = cfg.qkv_bias, normal_init(cfg.init_std)
        width = cfg.num_heads * self.head_dim
        if self.kv_heads == cfg.num_heads:
            self.qkv = ColumnParallelLinear(
                cfg.hidden_size, 3 * width, bias, init_method=init, **common
            )
            return
        self.query = ColumnParallelLinear(cfg.hidden_size, width, bias, init_method=init, **common)
        self.key_value = kv_projection(
            cfg.hidden_size, self.kv_heads, self.head_dim, bias, init_method=init, **common
        )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[b, heads/tp, s, d]``; k, v ``[b, kv heads on this rank, s, d]``."""
        if not hasattr(self, "query"):
            qkv = self.qkv(x)  # [s, b, 3h/tp], whole heads
            return rearrange(
                qkv, "s b (heads three d) -> three b heads s d", three=3, d=self.head_dim
            )
        q = rearrange(self.query(x), "s b (heads d) -> b heads s d", d=self.head_dim)
        k, v = rearrange(
            self.key_value(x), "s b (heads two d) -> two b heads s d", two=2, d=self.head_dim
        )
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output projection without its bias, that bias). ``cache``: this layer's keys and
        values so far (inference); the new ones are added. ``rotary``: (cos, sin)
        ``[b, 1, s, d]`` of the positions, for rotary position embeddings."""
        q, k, v = self._project(x)
        if hasattr(self, "q_norm"):  # per head, before the rotation (Qwen3's order)
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            if isinstance(self.core, RingCoreAttention):
                raise ValueError("a KV cache (generation) runs at cp_size=1, not on a ring")
            past = cache.length
            k, v = cache.append(k, v)  # [b, heads/tp, past + s, d]
            if mask is None and self.core.causal and past:
                # is_causal aligns the query block with the first keys; decoding needs the last.
                mask = decoder_mask(None, q.shape[2], past, batch=q.shape[0], device=q.device)
        return self.dense(self.core(q, k, v, mask))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``capacity`` positions, this rank's heads."""
        if hasattr(self, "query"):  # [2·(kv heads here)·d, h]
            rows, dtype, device = kv_layout(self.key_value)
            heads = rows // (2 * self.head_dim)
        else:  # [3·heads/tp·d, h]
            rows, dtype, device = kv_layout(self.qkv)
            heads = rows // (3 * self.head_dim)
        return KVCache(batch, heads, self.head_dim, capacity, dtype=dtype, device=device)
