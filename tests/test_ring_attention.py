"""layers.ring_attention: the load-balanced layout, the block plan, and the ring on real
gloo ranks against unsplit attention.

The reference is torch's ``F.scaled_dot_product_attention`` over the whole sequence, with
the KV heads repeated as ``layers.attention`` repeats them, forward and backward. Inputs
are fp64 so the comparison proves the math: the ring only reorders sums of O(1) terms, so
outputs and gradients agree to a few ulps, and 1e-12 leaves three orders of margin while a
wrong merge or a wrong mask is off by O(0.1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import layers.ring_attention as ring
from layers.ring_attention import (
    cp_positions,
    ring_attention,
    ring_blocks,
    shard_for_cp,
    unshard_from_cp,
)
from tests.multiproc import run_ranks

BATCH, HEADS, HEAD_DIM = 2, 4, 8
CHUNK = 3  # tokens per chunk of the 2·cp: odd, so no power-of-two luck
ATOL = 1e-12  # fp64; see the module docstring
CASES = [  # (causal, kv heads): MHA and GQA, causal and bidirectional
    (True, HEADS),
    (True, 2),
    (False, HEADS),
    (False, 2),
]
NAMES = ("output", "dQ", "dK", "dV")


def _inputs(seq: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and the output gradient, fp64, the same on every rank."""
    g = torch.Generator().manual_seed(1000 * seq + kv_heads)
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, BATCH, kv_heads, seq, HEAD_DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(seq: int, causal: bool, kv_heads: int) -> list[torch.Tensor]:
    """(output, dq, dk, dv) of unsplit attention over the full sequence."""
    q, k, v, dout = _inputs(seq, kv_heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = HEADS // kv_heads
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal
    )
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _ring(seq: int, causal: bool, kv_heads: int, group, cp: int, rank: int):
    """This rank's (output, dq, dk, dv) in the load-balanced layout."""
    full = _inputs(seq, kv_heads)
    q, k, v, dout = (shard_for_cp(t, cp, rank, dim=2) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cp_group=group, causal=causal)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _assert_matches(per_rank: list[list[torch.Tensor]], expected: list[torch.Tensor]) -> None:
    for i, name in enumerate(NAMES):
        got = unshard_from_cp([r[i] for r in per_rank], dim=2)
        torch.testing.assert_close(
            got, expected[i], rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


# ---------------------------------------------------------------------------------------
# Pure functions, one process


def test_shard_unshard_and_positions():
    seq, cp = 16, 4  # 8 chunks of 2
    x = torch.arange(seq).view(1, seq) * 10
    parts = [shard_for_cp(x, cp, r, dim=1) for r in range(cp)]
    # Rank r holds chunks r and 2·cp−1−r: rank 0 → 0, 7; rank 3 → 3, 4.
    assert parts[0].tolist() == [[0, 10, 140, 150]]
    assert parts[3].tolist() == [[60, 70, 80, 90]]
    assert torch.equal(unshard_from_cp(parts, dim=1), x)
    for r in range(cp):
        assert torch.equal(cp_positions(seq, cp, r), parts[r][0] // 10)
    assert torch.equal(cp_positions(seq, 1, 0), torch.arange(seq))  # cp 1: the identity
    with pytest.raises(ValueError, match=r"not divisible by 2 × cp \(8\)"):
        shard_for_cp(torch.zeros(12), 4, 0, dim=0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plan_covers_exactly_the_causal_pairs(cp):
    """Every visible (query, key) pair is in exactly one block; no block is fully masked;
    an unmasked block is wholly visible, a diagonal one exactly its lower triangle."""
    seq = 2 * cp * CHUNK
    local = seq // cp
    for rank in range(cp):
        q_pos = cp_positions(seq, cp, rank)
        for source in range(cp):
            k_pos = cp_positions(seq, cp, source)
            visible = q_pos[:, None] >= k_pos[None, :]
            covered = torch.zeros_like(visible, dtype=torch.int64)
            for blk in ring_blocks(rank, source, cp, local, causal=True):
                sub = visible[blk.q, blk.k]
                want = torch.ones_like(sub).tril() if blk.causal else torch.ones_like(sub)
                assert torch.equal(sub, want), (rank, source, blk)
                covered[blk.q, blk.k] += want.long()
            assert torch.equal(covered, visible.long()), (rank, source)


def _block_halves(blocks, chunk: int) -> int:
    """Work in half chunk-by-chunk blocks: an unmasked chunk × chunk block is 2, a diagonal 1."""
    units = 0
    for m, n, causal in blocks:
        units += 1 if causal else 2 * m * n // chunk**2
    return units


def test_one_rank_equals_unsplit_attention():
    for causal, kv_heads in CASES:
        seq = 2 * 7  # a prime chunk
        _assert_matches(
            [_ring(seq, causal, kv_heads, None, 1, 0)], _reference(seq, causal, kv_heads)
        )


def test_bad_shapes_are_refused():
    q, k = torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"heads \(3\) is not a multiple of kv heads \(2\)"):
        ring_attention(q, k, k, cp_group=None, causal=True)


# ---------------------------------------------------------------------------------------
# Real ranks


def _cases_on_ranks(cases):
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = 2 * cp * CHUNK
    return {case: _ring(seq, *case, group, cp, rank) for case in cases}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_cases_on_ranks, 2, CASES)


@pytest.mark.parametrize(("causal", "kv_heads"), CASES)
def test_two_ranks_equal_unsplit_attention(two_ranks, causal, kv_heads):
    expected = _reference(4 * CHUNK, causal, kv_heads)
    _assert_matches([r[(causal, kv_heads)] for r in two_ranks], expected)


def _counted_on_ranks():
    """The causal GQA case, with every block the kernel computes recorded as (m, n, causal)."""
    calls = {"forward": [], "backward": []}
    forward, backward = ring._block_forward, ring._block_backward

    def count_forward(q, k, v, *rest):
        # rest: scale, causal, same-document mask, dropout factor
        calls["forward"].append((q.shape[-2], k.shape[-2], rest[1]))
        return forward(q, k, v, *rest)

    def count_backward(q, k, v, *rest):
        # rest: dout, lse, delta, scale, causal, same-document mask, dropout factor
        calls["backward"].append((q.shape[-2], k.shape[-2], rest[4]))
        return backward(q, k, v, *rest)

    ring._block_forward, ring._block_backward = count_forward, count_backward
    try:
        result = _cases_on_ranks([(True, 2)])[(True, 2)]
    finally:
        ring._block_forward, ring._block_backward = forward, backward
    return result, calls


def test_four_ranks_equal_unsplit_attention_with_balanced_blocks():
    cp = 4
    ranks = run_ranks(_counted_on_ranks, cp)
    _assert_matches([result for result, _ in ranks], _reference(2 * cp * CHUNK, True, 2))
    # Causal work is (2·cp)² chunk blocks below or on the diagonal: 2·cp diagonals (one
    # half-block each) and 2·cp·(2·cp−1)/2 unmasked (two each), 4·cp² halves in all. The
    # layout gives each rank 2 diagonals and 2·cp−1 unmasked blocks: 2 + 2·(2·cp−1) = 4·cp
    # (16 at cp 4); a contiguous split would give rank r 8r+4 (4 to 28 at cp 4).
    for _, calls in ranks:
        for direction in ("forward", "backward"):
            blocks = calls[direction]
            assert sum(causal for _, _, causal in blocks) == 2, direction
            # Every block a chunk × chunk square: the same shapes on every rank.
            assert all(m == n == CHUNK for m, n, _ in blocks), direction
            assert _block_halves(blocks, CHUNK) == 4 * cp, direction
        assert calls["forward"] == calls["backward"]  # the backward recomputes the same blocks


# ---------------------------------------------------------------------------------------
# Document masks: packed rows against each document run alone

# Two packed rows of 12 tokens (cp 2: chunks of 3). Row 0: documents of 5 and 7 tokens
# (a boundary inside chunk 1); row 1: 2, 1, 3 and 6 (chunk 0 holds three documents).
DOCUMENTS = torch.tensor(
    [
        [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3],
    ]
)


def _document_reference(causal: bool, kv_heads: int) -> list[torch.Tensor]:
    """(output, dq, dk, dv) with each document of each row attended on its own."""
    q, k, v, dout = _inputs(DOCUMENTS.shape[1], kv_heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = HEADS // kv_heads
    k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    rows = []
    for b, ids in enumerate(DOCUMENTS):
        lengths = torch.unique_consecutive(ids, return_counts=True)[1].tolist()
        pieces = []
        for doc in torch.arange(ids.shape[0]).split(lengths):
            span = slice(int(doc[0]), int(doc[-1]) + 1)
            one = [t[b : b + 1, :, span] for t in (q, k_all, v_all)]
            pieces.append(F.scaled_dot_product_attention(*one, is_causal=causal))
        rows.append(torch.cat(pieces, dim=2))
    out = torch.cat(rows)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _visible_chunk_pairs(
    rank: int, cp: int, causal: bool, documents: torch.Tensor = DOCUMENTS, window=None
) -> int:
    """Chunk-by-chunk blocks of rank ``rank`` that hold at least one visible pair (same
    document, not in the future and, with ``window``, fewer than ``window`` tokens back)."""
    chunk = documents.shape[1] // (2 * cp)
    pos = torch.arange(documents.shape[1])
    visible = documents[:, :, None] == documents[:, None, :]  # [b, s, s]
    if causal:
        visible &= pos[:, None] >= pos[None, :]
    if window is not None:
        visible &= (pos[:, None] - pos[None, :]) < window
    blocks = visible.any(0).unflatten(0, (2 * cp, chunk)).unflatten(2, (2 * cp, chunk))
    seen = blocks.any(3).any(1)  # [query chunk, key chunk]
    return int(seen[[rank, 2 * cp - 1 - rank]].sum())


def _ring_counting_blocks(seq: int, kv_heads: int, calls: dict) -> dict:
    """Per key of ``calls`` (``ring_attention`` keyword arguments): this rank's (output, dq,
    dk, dv) and how many blocks the forward computed."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    counted, forward = [], ring._block_forward

    def count_forward(q, *rest):
        counted.append(q.shape[-2])
        return forward(q, *rest)

    ring._block_forward = count_forward
    results = {}
    try:
        for key, keywords in calls.items():
            counted.clear()
            full = _inputs(seq, kv_heads)
            q, k, v, dout = (shard_for_cp(t, cp, rank, dim=2) for t in full)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = ring_attention(q, k, v, cp_group=group, **keywords)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            results[key] = ([out.detach(), *grads], len(counted))
    finally:
        ring._block_forward = forward
    return results


# BERT's padded rows: 6 and 9 real tokens of 12 (cp 2: chunks of 3), so key chunk 3 is
# padding in both rows and chunk 2 in row 0 only.
KEYS = torch.arange(12) < torch.tensor([[6], [9]])


def _padding_reference(kv_heads: int) -> list[torch.Tensor]:
    """(output, dq, dk, dv) of unsplit bidirectional attention with the ``[b, 1, 1, s]``
    key mask BERT gives torch's SDPA."""
    q, k, v, dout = _inputs(KEYS.shape[1], kv_heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    k_all, v_all = (t.repeat_interleave(HEADS // kv_heads, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=KEYS[:, None, None, :])
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _documents_on_ranks(kv_heads: int):
    calls = {causal: dict(causal=causal, document_ids=DOCUMENTS) for causal in (True, False)}
    calls["padding"] = dict(causal=False, key_mask=KEYS)
    return _ring_counting_blocks(DOCUMENTS.shape[1], kv_heads, calls)


@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_documents_equal_documents_run_alone(causal):
    q, k, v, dout = _inputs(DOCUMENTS.shape[1], 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cp_group=None, causal=causal, document_ids=DOCUMENTS)
    got = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    _assert_matches([got], _document_reference(causal, 2))


def test_two_ranks_documents_equal_documents_run_alone_and_skip_blocks_between_them():
    cp = 2
    ranks = run_ranks(_documents_on_ranks, cp, 2)
    for causal in (True, False):
        _assert_matches([r[causal][0] for r in ranks], _document_reference(causal, 2))
        # Every chunk pair with something visible is computed once; the rest, skipped.
        computed = [r[causal][1] for r in ranks]
        expected = [_visible_chunk_pairs(rank, cp, causal) for rank in range(cp)]
        assert computed == expected, causal
        # Without documents: all (2·cp)² chunk pairs, or the 2·cp·(2·cp+1)/2 on or below
        # the diagonal; documents leave fewer.
        chunks = 2 * cp
        assert sum(expected) < (chunks * (chunks + 1) // 2 if causal else chunks**2)
    # Padding: what SDPA computes under BERT's key mask; the key chunk that is padding in
    # every row is skipped, so each rank computes its 2 query chunks × 3 key chunks.
    _assert_matches([r["padding"][0] for r in ranks], _padding_reference(2))
    assert [r["padding"][1] for r in ranks] == [6, 6]


def test_one_rank_key_mask_equals_torch_attention_with_the_padding_mask():
    q, k, v, dout = _inputs(KEYS.shape[1], 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cp_group=None, causal=False, key_mask=KEYS)
    got = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    _assert_matches([got], _padding_reference(2))


# ---------------------------------------------------------------------------------------
# Attention dropout: the keep-mask read at global (query, key) positions


def test_dropout_on_one_rank_equals_torch_attention_with_the_same_draw():
    """One rank (no ring), causal GQA (4 query heads on 2 KV heads), fp64: given the mask
    ``F.scaled_dot_product_attention`` draws from the same generator state (the mask of
    ``torch.native_dropout`` on a buffer of the probabilities' shape and dtype), the ring's
    output and its q, k, v gradients equal torch's within 1e-12 (measured ≤ 1.5e-15):
    the probabilities scaled by keep / (1 − p) after the softmax, the log-sum-exp left
    undropped, and the backward through the same mask."""
    b, heads, kv_heads, s, d, p = 2, 4, 2, 8, 4, 0.3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    torch.manual_seed(5)
    keep = torch.native_dropout(torch.empty(b, heads, s, s, dtype=torch.float64), p, True)[1]
    got = ring.ring_attention(q, k, v, cp_group=None, causal=True, dropout_p=p, dropout_keep=keep)
    torch.manual_seed(5)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(q, kr, vr, dropout_p=p, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for name, a, b_ in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")
    with pytest.raises(ValueError, match=r"^dropout_keep \(2, 4, 8, 7\) must be"):
        ring.ring_attention(
            q, k, v, cp_group=None, causal=True, dropout_p=p, dropout_keep=keep[..., :7]
        )


# ---------------------------------------------------------------------------------------
# Sliding window, score scale and soft cap (Mistral, Gemma 2)

WINDOW_SEQ = 4 * 2 * CHUNK  # cp 2: chunks of 6 tokens
WINDOW_CASES = [  # (window, scale, soft cap): window alone, then with Gemma's scale and cap
    (5, None, None),
    (7, 0.2, 1.5),
]


def _window_reference(window: int, scale, softcap) -> list[torch.Tensor]:
    """(output, dq, dk, dv) of unsplit causal GQA attention limited to the last ``window``
    keys, written out (scores, cap, mask, softmax) with autograd for the gradients."""
    q, k, v, dout = _inputs(WINDOW_SEQ, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    k_all, v_all = (t.repeat_interleave(HEADS // 2, 1) for t in (k, v))
    scores = q @ k_all.transpose(-2, -1) * (HEAD_DIM**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(WINDOW_SEQ)
    back = pos[:, None] - pos[None, :]
    scores = scores.masked_fill(~((back >= 0) & (back < window)), float("-inf"))
    out = torch.softmax(scores, -1) @ v_all
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _windows_on_ranks():
    """Per window: this rank's (output, dq, dk, dv) and how many blocks the forward computed."""
    calls = {
        window: dict(causal=True, window=window, scale=scale, softcap=softcap)
        for window, scale, softcap in WINDOW_CASES
    }
    return _ring_counting_blocks(WINDOW_SEQ, 2, calls)


def test_two_ranks_with_a_window_equal_windowed_attention_and_skip_blocks_outside_it():
    """cp 2, 24 tokens, causal GQA, fp64: a window of 5 (then 7 with a score scale of 0.2
    and scores capped at 1.5) gives the unsplit windowed attention's output and gradients
    within 1e-12 (rounding only, as above). Each rank computes exactly the chunk pairs that
    hold a pair inside the window: fewer than plain causal attention's."""
    cp = 2
    ranks = run_ranks(_windows_on_ranks, cp)
    one_doc = torch.zeros(1, WINDOW_SEQ, dtype=torch.long)
    for window, scale, softcap in WINDOW_CASES:
        _assert_matches([r[window][0] for r in ranks], _window_reference(window, scale, softcap))
        computed = [r[window][1] for r in ranks]
        expected = [_visible_chunk_pairs(rk, cp, True, one_doc, window) for rk in range(cp)]
        assert computed == expected, window
        chunks = 2 * cp
        assert sum(expected) < chunks * (chunks + 1) // 2, window


def test_a_window_is_refused_without_causal_attention():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"^window=3 limits causal attention"):
        ring_attention(q, q, q, cp_group=None, causal=False, window=3)


# ---------------------------------------------------------------------------------------
# Row tiles: each block's kernel runs over at most ``_ROW_TILE`` query rows at a time

TILE_SEQ = 2 * 2 * 5  # cp 2: chunks of 5 tokens, so tiles of 3 rows come out as 3 + 2
TILE_DOCUMENTS = torch.tensor([[0] * 7 + [1] * 13, [0] * 2 + [1] + [2] * 9 + [3] * 8])
TILE_P = 0.3  # attention dropout


def _tiles_on_ranks(tiles: tuple[int, ...]):
    """Per row tile: this rank's (output, dq, dk, dv) of causal GQA attention with
    documents, dropout and a soft cap, and the query rows of each forward kernel call."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(BATCH, HEADS, TILE_SEQ, TILE_SEQ, generator=g) > TILE_P
    keep = shard_for_cp(keep, cp, rank, dim=2)  # this rank's query rows, every key
    keywords = dict(causal=True, document_ids=TILE_DOCUMENTS, softcap=1.5)
    keywords.update(dropout_p=TILE_P, dropout_keep=keep)
    rows, forward, default = [], ring._block_forward, ring._ROW_TILE

    def count_forward(q, *rest):
        rows.append(q.shape[-2])
        return forward(q, *rest)

    results = {}
    ring._block_forward = count_forward
    try:
        for tile in tiles:
            ring._ROW_TILE = tile
            rows.clear()
            q, k, v, dout = (shard_for_cp(t, cp, rank, dim=2) for t in _inputs(TILE_SEQ, 2))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = ring_attention(q, k, v, cp_group=group, **keywords)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            results[tile] = ([out.detach(), *grads], list(rows))
    finally:
        ring._block_forward, ring._ROW_TILE = forward, default
    return results


def test_two_ranks_row_tiles_equal_whole_blocks_with_documents_dropout_and_a_cap():
    """cp 2, 20 tokens (chunks of 5), causal GQA with packed documents, dropout (p 0.3)
    and scores capped at 1.5, fp64: blocks cut into uneven row tiles (3 + 2 rows) give the
    whole blocks' output and q, k, v gradients within 1e-12. The masks (causal triangle
    from the tile's first row, documents, dropout) must follow each tile's rows, or rows
    see the wrong keys and differ by O(1) (measured 3.2 with the triangle not shifted);
    the forward's rows keep their arithmetic (output and dQ measured bitwise equal) and
    dK/dV only add the tiles' shares in another order (measured ≤ 1.8e-15)."""
    cp, small, whole = 2, 3, 512
    ranks = run_ranks(_tiles_on_ranks, cp, (small, whole))
    for r in ranks:
        assert sorted(set(r[small][1])) == [2, 3]  # every block cut, unevenly
        assert set(r[whole][1]) == {5}  # one call per chunk × chunk block
    expected = [unshard_from_cp([r[whole][0][i] for r in ranks], dim=2) for i in range(4)]
    _assert_matches([r[small][0] for r in ranks], expected)
