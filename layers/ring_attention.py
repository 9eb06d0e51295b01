"""Ring attention over a context-parallel (cp) group, with the load-balanced causal layout.

**Layout.** A sequence of ``s`` tokens is cut into ``2·cp`` chunks of ``s/(2·cp)``; cp rank
``r`` holds chunks ``r`` and ``2·cp−1−r``, in that order (``shard_for_cp``). Under a causal
mask every rank then does the same work: an early chunk sees little of the past, its
partner late chunk sees most of it (docs/REFERENCE.md §10). ``cp_positions`` gives each
local token's global position (for RoPE); ``unshard_from_cp`` undoes the layout.

**Ring.** Each rank keeps its queries and passes its keys and values to the next rank,
``cp`` steps in all; at step ``t`` rank ``r`` attends to the chunks of rank ``r − t``.
Only the KV heads travel (grouped-query attention never repeats them). The next step's
K/V are in flight (``batch_isend_irecv``) while the current block computes. Partial
results merge by the log-sum-exp rule in fp32 (fp64 for fp64 inputs). The backward pass
walks the ring again, recomputing each block from the final log-sum-exp, and the dK/dV of
each visiting chunk travel with it and then one hop further, home.

**Blocks.** Which (query half, key half) pairs a step computes is ``ring_blocks``: a block
entirely in the future is skipped, one entirely in the past computed unmasked, and only
the two diagonal blocks of a rank's own chunks carry the causal triangle. Each rank
computes ``2·cp−1`` unmasked chunk-by-chunk blocks and 2 diagonal ones: ``4·cp`` half
blocks, the same on every rank. They run as chunk × chunk squares: the same work cut as
one ``[s/cp, chunk]`` block on one rank and one ``[chunk, s/cp]`` on another ran 10–25 %
apart on a CPU (studies/bench/cp_balance.py); a GPU kernel would rather take the larger
blocks whole.

**Window.** With ``window`` (Mistral, Gemma 2) a query sees the keys fewer than ``window``
positions back: each chunk-by-chunk block is masked at its global positions, and a block
wholly outside the window is skipped, so a short window over a long sequence does less
work (the ring still walks every step: the K/V still pass every rank). Gemma's score
scale and soft cap are elementwise on each block's scores; the backward multiplies dS
by the cap's derivative.

**Documents.** With ``document_ids`` (packed rows), a token sees only its own document's
tokens: the blocks are cut chunk by chunk, a block with no same-document pair in the batch
is skipped, a block within one document is unmasked, and the rest carry the mask. The skip
reads the ids on the host (a sync per block on a GPU, where the boundaries would rather
come from the data loader, and the kernel be a varlen one with ``cu_seqlens``).

**Padding.** With ``key_mask`` (BERT's padded rows: True on the real tokens) no query sees
a padding key, as a ``[b, 1, 1, s]`` mask does in unsplit attention: the blocks are cut
chunk by chunk as for documents, a block whose keys are all padding is skipped, and the
rest are masked. Both masks combine (a pair must pass each).

**Dropout.** ``dropout_keep`` holds this rank's query rows of the attention's keep-mask
over the whole sequence's keys, indexed by global key position, so a (query, key) pair's
draw does not depend on the split; each block reads its part (``_Ring._drop``). The
probabilities are scaled after the softmax (keep / (1 − p)) while the log-sum-exp stays
the undropped one, so the merge still normalises by the whole row; the backward scales dV
and the gradient reaching the probabilities alike, and delta = rowsum(dO·O) holds as is.

**The per-block kernel** is explicit math (``_block_forward`` / ``_block_backward``), in
the accumulation dtype, returning the log-sum-exp: correctness first. It runs over row
tiles of at most ``_ROW_TILE`` queries, so a block's score-sized tensors are a tile's, not
the block's: each row's forward arithmetic is unchanged (bitwise), and dK/dV sum the
tiles' shares (another order of the same sum: ~1e-16 relative in fp64). On a GPU it is
replaced by a kernel that returns the log-sum-exp and whose backward takes the final one:
torch's ``aten._scaled_dot_product_flash_attention`` / ``..._backward`` (what torch's own
``context_parallel`` calls) or FlashAttention's ``_flash_attn_forward`` /
``_flash_attn_backward`` (``softmax_lse``, as ring-flash-attn and Transformer Engine's
P2P context parallelism use). Diagonal blocks are square, so the kernels' top-left causal
flag is the right triangle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel_state.groups import group_rank, group_size

_KV_TAG, _DKV_TAG = 0, 1  # both are in flight to the same peer during backward
# Query rows per call of the block kernel. The explicit kernel materialises a block's
# scores (several such tensors alive at once in backward), so a block runs in row tiles:
# at 512 rows, llama_tiny's 4 heads over a 2,048-key chunk make 16 MiB of fp32 scores per
# sequence and tile instead of 64 MiB per block, bounding the working memory at long
# context. Rows are independent in the softmax, so tiling only reorders dK/dV's sums.
_ROW_TILE = 512


# ---------------------------------------------------------------------------------------
# The load-balanced layout


def _check_divisible(length: int, cp_size: int) -> int:
    if length % (2 * cp_size):
        raise ValueError(
            f"sequence length ({length}) is not divisible by 2 × cp ({2 * cp_size}): the "
            "load-balanced layout cuts it into 2·cp equal chunks"
        )
    return length // (2 * cp_size)


def shard_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, *, dim: int) -> torch.Tensor:
    """Rank ``cp_rank``'s part of the full sequence ``x`` (along ``dim``): chunks
    ``cp_rank`` and ``2·cp_size−1−cp_rank`` of ``2·cp_size``, concatenated in that order."""
    chunk = _check_divisible(x.shape[dim], cp_size)
    early = x.narrow(dim, cp_rank * chunk, chunk)
    late = x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)
    return torch.cat((early, late), dim=dim)


def unshard_from_cp(shards: Sequence[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The full sequence from every cp rank's part (``shards[r]`` from rank ``r``)."""
    cp_size = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [halves[r][0] for r in range(cp_size)]
    ordered += [halves[r][1] for r in reversed(range(cp_size))]
    return torch.cat(ordered, dim=dim)


def cp_positions(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions ``[seq_len/cp]`` (int64) of rank ``cp_rank``'s tokens."""
    return shard_for_cp(torch.arange(seq_len, device=device), cp_size, cp_rank, dim=0)


# ---------------------------------------------------------------------------------------
# Which blocks a ring step computes


@dataclass(frozen=True)
class Block:
    """A (queries, keys) pair of one ring step: rows of the local queries, rows of the
    visiting keys, and whether it is a diagonal block (square, causal triangle)."""

    q: slice
    k: slice
    causal: bool


def ring_blocks(
    rank: int, source: int, cp_size: int, local_len: int, *, causal: bool
) -> tuple[Block, ...]:
    """The blocks rank ``rank`` computes against the K/V of rank ``source`` (both in the
    load-balanced layout, ``local_len`` tokens each). Fully masked blocks are absent."""
    whole = slice(0, local_len)
    if not causal:
        return (Block(whole, whole, False),)
    if cp_size == 1:  # one chunk pair in order: plain causal attention
        return (Block(whole, whole, True),)
    half = local_len // 2
    early, late = slice(0, half), slice(half, local_len)
    if source == rank:  # our own chunks: two diagonals, and late sees early whole
        return (Block(early, early, True), Block(late, early, False), Block(late, late, True))
    if source < rank:  # its early chunk precedes both of ours; its late follows both
        return (Block(whole, early, False),)
    return (Block(late, whole, False),)  # both its chunks lie between our two


# ---------------------------------------------------------------------------------------
# The per-block kernel (explicit math; see the module docstring for its GPU replacement)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _capped(q, k, scale, softcap):
    """``[b, kv_heads, group, m, n]`` scores QKᵀ·scale, soft-capped to c·tanh(·/c) when
    ``softcap`` c is given (Gemma 2), unmasked."""
    s = torch.einsum("bhgmd,bhnd->bhgmn", q, k) * scale
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def _masked(s, causal, same_doc, row0=0):
    """Scores ``s`` with −inf above a diagonal block's triangle and, when ``same_doc``
    ``[b or 1, m, n]`` (the pairs a block may see: same document, inside the window) is
    given, where it is False. ``s`` holds the block's rows from ``row0`` on (a row tile),
    so its row ``i`` is the block's row ``row0 + i``."""
    if causal:
        m, n = s.shape[-2:]
        future = torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1 + row0)
        s = s.masked_fill(future, float("-inf"))
    if same_doc is not None:
        s = s.masked_fill(~same_doc[:, None, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with −inf (a row that sees nothing yet) replaced by 0, so exp(−inf − 0) = 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _block_forward(
    q, k, v, scale: float, causal: bool, same_doc, drop=None, softcap=None, row0: int = 0
):
    """Attention of q ``[b, kv_heads, group, m, d]`` over k, v ``[b, kv_heads, n, d]``:
    (output ``[b, kv_heads, group, m, d]``, log-sum-exp ``[b, kv_heads, group, m]``).
    ``drop`` ``[b, kv_heads, group, m, n]`` (dropout: keep-mask / (1 − p)) scales the
    probabilities after the softmax, as ``F.dropout`` of the attention weights does; the
    log-sum-exp stays the undropped one, so the merge keeps the true normalisation.
    ``softcap`` caps the scores before the mask (:func:`_capped`). ``row0``: the first
    row's place in the block, when q is a row tile of it (:func:`_masked`)."""
    s = _masked(_capped(q, k, scale, softcap), causal, same_doc, row0)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    if drop is not None:
        p = p * drop
    return torch.einsum("bhgmn,bhnd->bhgmd", p, v), lse


def _block_backward(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    scale: float,
    causal: bool,
    same_doc,
    drop=None,
    softcap=None,
    row0: int = 0,
):
    """(dq, dk, dv) of one block, from the final log-sum-exp and delta = rowsum(dO·O).

    With dropout (``drop`` as in :func:`_block_forward`): O = (P∘D)·V, so dV = (P∘D)ᵀ·dO,
    the gradient reaching P is D∘(dO·Vᵀ), and dS = P∘(D∘(dO·Vᵀ) − delta), where delta =
    rowsum(dO·O) still (Σₙ Pₙ·Dₙ·(dO·vₙ) = dO·O). With ``softcap`` c the capped score
    c·tanh(x/c) has derivative 1 − tanh², so dS reaches the raw scores times that. On a
    row tile (``row0`` as in :func:`_block_forward`) dK and dV are that tile's share."""
    capped = _capped(q, k, scale, softcap)
    p = torch.exp(_masked(capped, causal, same_doc, row0) - _finite(lse)[..., None])
    dp = torch.einsum("bhgmd,bhnd->bhgmn", dout, v)
    if drop is not None:
        dv = torch.einsum("bhgmn,bhgmd->bhnd", p * drop, dout)
        dp = dp * drop
    else:
        dv = torch.einsum("bhgmn,bhgmd->bhnd", p, dout)
    ds = p * (dp - delta[..., None])
    if softcap is not None:
        ds = ds * (1 - (capped / softcap) ** 2)
    dq = torch.einsum("bhgmn,bhnd->bhgmd", ds, k) * scale
    dk = torch.einsum("bhgmn,bhgmd->bhnd", ds, q) * scale
    return dq, dk, dv


def _merge_(out, lse, block_out, block_lse) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, block_lse)
    base = _finite(new)
    out.mul_(torch.exp(lse - base)[..., None]).add_(
        block_out * torch.exp(block_lse - base)[..., None]
    )
    lse.copy_(new)


# ---------------------------------------------------------------------------------------
# The ring: point-to-point exchange with the neighbours, and the autograd Function


class _RingShift:
    """``x`` sent to the next cp rank while the previous rank's is received, in flight."""

    def __init__(self, x: torch.Tensor, group: dist.ProcessGroup, tag: int) -> None:
        rank, size = group_rank(group), group_size(group)
        self.received = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % size, tag=tag),
            dist.P2POp(
                dist.irecv, self.received, group=group, group_peer=(rank - 1) % size, tag=tag
            ),
        ]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self.received


def _grouped(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, heads, s, d]`` → ``[b, kv_heads, heads/kv_heads, s, d]``: query head ``j`` uses
    KV head ``j // group``, as ``repeat_interleave`` pairs them in ``layers.attention``."""
    return x.unflatten(1, (kv_heads, -1)).to(dtype)


@dataclass(frozen=True)
class _Ring:
    """What one ring attention call is: its group, mask and scale, and its dropout (the
    keep-mask of this rank's query rows over the whole sequence's keys, and p)."""

    group: dist.ProcessGroup | None
    causal: bool
    scale: float
    documents: torch.Tensor | None  # [b, s] document ids of the full sequence
    keep: torch.Tensor | None = None  # [b, heads, s/cp, s] bool: keys at global positions
    p: float = 0.0
    window: int | None = None  # a query sees its last ``window`` keys (itself included)
    softcap: float | None = None  # scores → c·tanh(scores/c) before the mask
    keys: torch.Tensor | None = None  # [b, s] bool: the keys a query may see (padding)

    def steps(self, local_len: int):
        """Per ring step, the blocks against rank ``rank − step``'s chunks, each as
        (block, same-document mask ``[b, m, n]`` or None, dropout ``[b, heads, m, n]``
        keep-mask or None)."""
        size, rank = group_size(self.group), group_rank(self.group)
        for step in range(size):
            source = (rank - step) % size
            blocks = self._blocks(rank, source, size, local_len)
            yield [(blk, same, self._drop(blk, source, size, local_len)) for blk, same in blocks]

    def _blocks(self, rank: int, source: int, size: int, local_len: int):
        blocks = ring_blocks(rank, source, size, local_len, causal=self.causal)
        if self.causal:  # equal shapes on every rank: chunk × chunk squares
            blocks = _by_chunk(blocks, local_len, size)
        if self.documents is None and self.window is None and self.keys is None:
            return [(blk, None) for blk in blocks]
        kept = []
        for blk in _by_chunk(blocks, local_len, size):
            seen = self._visible(blk, rank, source, size, local_len)  # [b or 1, m, n]
            # A block between two documents or past the window is skipped, not masked
            # (one host sync each); a diagonal one always holds its own tokens.
            if blk.causal or seen.any():
                kept.append((blk, None if seen.all() else seen))
        return kept

    def _visible(self, blk: Block, rank: int, source: int, size: int, local_len: int):
        """Which of a block's (query, key) pairs the documents, the window and the key
        mask let through, ``[b or 1, m, n]``; the causal triangle aside."""
        device = next((t.device for t in (self.documents, self.keys) if t is not None), None)
        seen = torch.ones(1, 1, 1, dtype=torch.bool, device=device)
        if self.documents is not None:
            doc_q, doc_k = (shard_for_cp(self.documents, size, r, dim=1) for r in (rank, source))
            seen = doc_q[:, blk.q, None] == doc_k[:, None, blk.k]
        if self.window is not None:  # at global positions: q − k < window
            pos_q, pos_k = (
                cp_positions(size * local_len, size, r, device=device) for r in (rank, source)
            )
            seen = seen & ((pos_q[blk.q, None] - pos_k[None, blk.k]) < self.window)[None]
        if self.keys is not None:  # padding: no query sees it
            seen = seen & shard_for_cp(self.keys, size, source, dim=1)[:, None, blk.k]
        return seen

    def _drop(self, blk: Block, source: int, size: int, local_len: int):
        """The block's keep-mask ``[b, heads, m, n]``: this rank's query rows ``blk.q`` of
        ``keep`` at the global positions of rank ``source``'s key rows ``blk.k``."""
        if self.keep is None:
            return None
        keys = cp_positions(size * local_len, size, source, device=self.keep.device)[blk.k]
        return self.keep[:, :, blk.q].index_select(-1, keys)

    def factor(self, keep: torch.Tensor | None, kv_heads: int, dtype: torch.dtype):
        """A block's keep-mask as the dropout factor ``[b, kv_heads, group, m, n]``: keep
        / (1 − p) in ``dtype`` (None: no dropout)."""
        if keep is None:
            return None
        return keep.unflatten(1, (kv_heads, -1)).to(dtype) * (1.0 / (1.0 - self.p))


def _by_chunk(blocks, local_len: int, size: int) -> list[Block]:
    """``blocks`` cut into chunk-by-chunk blocks, so that each can be skipped alone."""
    if size == 1:
        return list(blocks)
    half = local_len // 2
    chunks = (slice(0, half), slice(half, local_len))

    def parts(rows: slice):
        return [c for c in chunks if rows.start <= c.start and c.stop <= rows.stop]

    return [Block(q, k, b.causal) for b in blocks for q in parts(b.q) for k in parts(b.k)]


def _row_tiles(blk: Block, same, keep):
    """A block's query rows in tiles of at most ``_ROW_TILE``, each as (its rows of the
    local queries, its first row's place in the block, its rows of the same-document mask
    ``[b or 1, m, n]`` and of the dropout keep-mask ``[b, heads, m, n]``, each or None)."""
    tile = _ROW_TILE
    for row0 in range(0, blk.q.stop - blk.q.start, tile):
        part = slice(row0, min(row0 + tile, blk.q.stop - blk.q.start))
        rows = slice(blk.q.start + part.start, blk.q.start + part.stop)
        same_t = None if same is None else same[:, part]
        keep_t = None if keep is None else keep[:, :, part]
        yield rows, row0, same_t, keep_t


def _ring_forward(q, k, v, ring: _Ring):
    acc = _accumulation_dtype(q.dtype)
    qg = _grouped(q, k.shape[1], acc)
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack((k, v))  # one message per step: [2, b, kv_heads, s/cp, d]
    size = group_size(ring.group)
    for step, blocks in enumerate(ring.steps(q.shape[2])):
        shift = _RingShift(kv, ring.group, _KV_TAG) if step < size - 1 else None
        for blk, same, keep in blocks:
            k_blk, v_blk = kv[:, :, :, blk.k].to(acc)
            for rows, row0, same_t, keep_t in _row_tiles(blk, same, keep):
                drop = ring.factor(keep_t, k.shape[1], acc)
                mask = (ring.scale, blk.causal, same_t, drop, ring.softcap, row0)
                o, m = _block_forward(qg[..., rows, :], k_blk, v_blk, *mask)
                _merge_(out[..., rows, :], lse[..., rows], o, m)
        if shift is not None:
            kv = shift.wait()
    return out.flatten(1, 2).to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring):
    acc = _accumulation_dtype(q.dtype)
    kv_heads = k.shape[1]
    qg, dog = _grouped(q, kv_heads, acc), _grouped(dout, kv_heads, acc)
    delta = (dog * _grouped(out, kv_heads, acc)).sum(-1)
    dq = torch.zeros_like(qg)
    kv, dkv_shift = torch.stack((k, v)), None
    size = group_size(ring.group)
    for step, blocks in enumerate(ring.steps(q.shape[2])):
        kv_shift = _RingShift(kv, ring.group, _KV_TAG) if step < size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # for the visiting chunks
        for blk, same, keep in blocks:
            k_blk, v_blk = kv[:, :, :, blk.k].to(acc)
            for rows, row0, same_t, keep_t in _row_tiles(blk, same, keep):
                tile = (qg[..., rows, :], k_blk, v_blk, dog[..., rows, :], lse[..., rows])
                drop = ring.factor(keep_t, kv_heads, acc)
                mask = (ring.scale, blk.causal, same_t, drop, ring.softcap, row0)
                grads = _block_backward(*tile, delta[..., rows], *mask)
                dq[..., rows, :] += grads[0]
                dkv[0, :, :, blk.k] += grads[1]
                dkv[1, :, :, blk.k] += grads[2]
        if dkv_shift is not None:  # what the earlier ranks added for these chunks
            dkv += dkv_shift.wait()
        if size > 1:  # onward with the chunks; after the last step that hop is home
            dkv_shift = _RingShift(dkv, ring.group, _DKV_TAG)
        if kv_shift is not None:
            kv = kv_shift.wait()
    if dkv_shift is not None:
        dkv = dkv_shift.wait()
    return dq.flatten(1, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Forward: K/V around the ring, log-sum-exp merge. Backward: K/V around again with
    per-block recomputation, dK/dV travelling with them and then home."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*_ring_backward(dout, *ctx.saved_tensors, ctx.ring), None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | None,
    causal: bool,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_keep: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(QKᵀ·scale)·V of this rank's queries over the whole sequence's keys.

    q ``[b, heads, s/cp, d]``, k and v ``[b, kv_heads, s/cp, d]`` (``heads`` a multiple of
    ``kv_heads``), each rank's part in the load-balanced layout of ``shard_for_cp``; returns
    ``[b, heads, s/cp, d]`` in q's dtype. ``scale`` defaults to 1/√d. ``cp_group`` None is a
    single rank (no communication).

    ``document_ids`` ``[b, s]`` (the full sequence's, the same on every cp rank: b·s
    integers are cheaper to hold than to pass around) restricts attention to tokens of the
    same document: block-diagonal causal, or block-diagonal when not ``causal``.

    Attention dropout: ``dropout_keep`` ``[b, heads, s/cp, s]`` (bool) is the keep-mask of
    this rank's query rows (local order) over every key at its global position, so each
    (query, key) pair's draw depends on the pair alone, not on the split: given the rows of
    the mask the unsplit attention draws (``RingCoreAttention``), the ring computes what it
    computes. The kept probabilities are scaled by 1/(1 − ``dropout_p``).

    ``window`` (causal only) limits each query to its last ``window`` keys, itself included
    (q − k < window at global positions, as ``layers.attention.sliding_window_mask``):
    blocks wholly outside it are skipped, so a short window over a long sequence costs
    less. ``softcap`` c caps the scores to c·tanh(scores/c) before the mask (Gemma 2).

    ``key_mask`` ``[b, s]`` (bool, the full sequence's, the same on every cp rank) hides
    the keys where it is False from every query (padding), as a ``[b, 1, 1, s]`` mask does;
    each row must keep at least one key.
    """
    cp = group_size(cp_group)
    _check_shapes(q, k, cp, causal, window, document_ids, dropout_keep, key_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = None if key_mask is None else key_mask.bool()
    ring = _Ring(
        cp_group, causal, scale, document_ids, dropout_keep, dropout_p, window, softcap, keys
    )
    return _RingAttention.apply(q, k, v, ring)


def _check_shapes(q, k, cp: int, causal: bool, window, document_ids, dropout_keep, key_mask):
    """ValueError, in one line, for inputs :func:`ring_attention` cannot take."""
    local = q.shape[2]
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads ({q.shape[1]}) is not a multiple of kv heads ({k.shape[1]})")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} limits causal attention: give causal=True, window >= 1")
    masked = document_ids is not None or key_mask is not None  # cut chunk by chunk
    if (causal or masked) and cp > 1 and local % 2:
        raise ValueError(f"ring attention needs an even local length (two chunks), got {local}")
    rows = (q.shape[0], cp * local)
    for name, ids in (("document_ids", document_ids), ("key_mask", key_mask)):
        if ids is not None and tuple(ids.shape) != rows:
            raise ValueError(
                f"{name} {tuple(ids.shape)} must be [batch, full sequence] = [{rows[0]}, {rows[1]}]"
            )
    if dropout_keep is not None and tuple(dropout_keep.shape) != (*q.shape[:3], cp * local):
        raise ValueError(
            f"dropout_keep {tuple(dropout_keep.shape)} must be [batch, heads, s/cp, s] = "
            f"[{q.shape[0]}, {q.shape[1]}, {local}, {cp * local}]"
        )
