"""Dropout from the TP-aware RNG streams, eagerly and inside a compiled graph.

Where a mask comes from follows from what the activation is (``parallel_state.random``):
a replicated activation draws from the default stream (the same mask on every TP rank), a
TP- or sequence-sharded one from the tracker's sharded stream (a mask of its own on each
TP rank).

Eagerly, dropout is torch's own (``F.dropout``, ``torch.native_dropout``, the dropout of
``F.scaled_dot_product_attention``) inside ``dropout_stream``, the tracker's fork of the
generator state. TorchDynamo cannot trace that fork (it swaps the generator's state: a
graph break), so while compiling the mask comes from one custom op,
``meshtron::dropout_mask``, which the compiler keeps as an opaque call: at run time it
forks the same stream and draws the mask ``torch.native_dropout`` draws, the mask
``F.dropout`` and the attention's dropout draw too (on CPU: one ``bernoulli_(1 - p)`` of
an x-shaped contiguous buffer). The compiled step draws in eager's order, because each
mask's input depends on the previous dropout's output, so it draws eager's masks and
leaves every stream where eager leaves it.

The op is tagged ``nondeterministic_seeded``: the compiler never merges two calls nor
recomputes one as if it were pure. Inside a compiled recomputation (``layers.recompute``)
the masks are saved (``save_dropout_masks``), one byte per element, because the
compiler's own RNG replay restores the default generator only, not the tracker's streams.
"""

from __future__ import annotations

import contextlib
import functools
import math
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parallel_state.random import RNGTracker, tracker_of

# The op's tracker argument when there is none: the default stream only.
_NO_TRACKER = -1


def dropout_stream(rng: RNGTracker | None, *, sharded: bool) -> AbstractContextManager:
    """Where an eager dropout mask is drawn from.

    A TP- or sequence-sharded activation needs a different mask on each TP rank: the
    tracker's sharded stream. A replicated activation needs the same mask on every TP
    rank: the default stream, seeded identically across TP.
    """
    return rng.fork() if sharded and rng is not None else contextlib.nullcontext()


@torch.library.custom_op(
    "meshtron::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _dropout_mask(like: torch.Tensor, p: float, tracker: int, sharded: bool) -> torch.Tensor:
    rng = None if tracker == _NO_TRACKER else tracker_of(tracker)
    with dropout_stream(rng, sharded=sharded):
        return torch.native_dropout(like, p, True)[1]


@_dropout_mask.register_fake
def _(like: torch.Tensor, p: float, tracker: int, sharded: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=torch.bool, device=like.device)


def dropout_mask(
    like: torch.Tensor, p: float, *, rng: RNGTracker | None, sharded: bool
) -> torch.Tensor:
    """The boolean keep-mask eager dropout of ``like`` would draw from its stream now."""
    key = _NO_TRACKER if rng is None else rng.key
    return _dropout_mask(like.detach(), p, key, sharded)


def _masked(x: torch.Tensor, p: float, *, rng: RNGTracker | None, sharded: bool):
    return x * dropout_mask(x, p, rng=rng, sharded=sharded) * (1.0 / (1.0 - p))


def dropout(
    x: torch.Tensor, p: float, training: bool, *, rng: RNGTracker | None, sharded: bool
) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the mask from ``sharded``'s stream."""
    if not (training and p > 0):
        return F.dropout(x, p, training)
    if torch.compiler.is_compiling():
        return _masked(x, p, rng=rng, sharded=sharded)
    with dropout_stream(rng, sharded=sharded):
        return F.dropout(x, p, training)


def native_dropout(
    x: torch.Tensor, p: float, *, rng: RNGTracker | None, sharded: bool
) -> torch.Tensor:
    """``torch.native_dropout(x, p, True)[0]`` (training, keeps a 1-byte mask) with the mask
    from ``sharded``'s stream."""
    if torch.compiler.is_compiling():
        return _masked(x, p, rng=rng, sharded=sharded)
    with dropout_stream(rng, sharded=sharded):
        return torch.native_dropout(x, p, True)[0]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    *,
    causal: bool,
    rng: RNGTracker | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with dropout ``p`` on the probabilities, whose
    mask comes from the sharded stream (attention heads are TP-sharded).

    ``scale`` multiplies the scores (None: 1/sqrt(head_dim)); ``softcap`` c caps them
    to c·tanh(scores/c) before the mask (Gemma 2), which SDPA has no slot for: the scores
    are then computed as written below (the s×s scores materialized).

    While compiling with ``p > 0`` it is the math of torch's reference path (the one CPU
    takes with dropout) written out, its mask from ``dropout_mask``; inductor fuses it. On
    CUDA that gives up the flash kernels (the s×s scores are materialized) and eager's
    masks (eager CUDA attention draws its own inside the kernel): the streams' semantics
    hold, but long sequences want ``attention_dropout=0`` there (not measured: no GPU).
    """
    if softcap is not None or (p > 0 and torch.compiler.is_compiling()):
        return _attention_math(q, k, v, mask, p, causal=causal, rng=rng, scale=scale, cap=softcap)
    with dropout_stream(rng, sharded=p > 0):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None, scale=scale
        )


def _attention_math(q, k, v, mask, p, *, causal, rng, scale=None, cap=None):
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # the reference path computes in fp32
        q, k, v = q.float(), k.float(), v.float()
    if cap is None and scale is None:
        split = math.sqrt(1.0 / math.sqrt(q.shape[-1]))  # split over q and k, as torch does
        scores = (q * split) @ (k * split).transpose(-2, -1)
    else:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = (q @ k.transpose(-2, -1)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if causal and mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.ops.aten._safe_softmax(scores, -1)  # a fully masked row gives zeros, not NaN
    if p > 0:
        if torch.compiler.is_compiling():
            probs = _masked(probs, p, rng=rng, sharded=True)
        else:
            with dropout_stream(rng, sharded=True):
                probs = F.dropout(probs, p, True)
    return (probs @ v).to(dtype)


def _keep_masks(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op is torch.ops.meshtron.dropout_mask.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# A checkpoint's ``context_fn`` for compiled recomputation: recompute all but the masks.
save_dropout_masks = functools.partial(create_selective_checkpoint_contexts, _keep_masks)
