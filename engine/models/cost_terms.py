"""What every family's ``costs.py`` does alike: apply one of ``engine.formulas``' FLOP or
activation formulas to a ``ModelConfig``. The family passes its formula and the terms only
it has (Llama's K/V width, the GPT table's unfused attention)."""

from __future__ import annotations

from collections.abc import Callable

from engine.models.config import ModelConfig


def config_flops(
    formula: Callable[..., int],
    cfg: ModelConfig,
    batch: int,
    seq: int,
    *,
    vocab: int,
    recompute: bool,
    **family_terms,
) -> int:
    """``formula(batch, seq, layers, hidden, vocab, recompute=, ffn_hidden=, **family_terms)``
    with ``cfg``'s layers, hidden and FFN widths: forward + backward matmul FLOPs on
    ``batch`` sequences, the head ``vocab`` wide."""
    return formula(
        batch,
        seq,
        cfg.num_layers,
        cfg.hidden_size,
        vocab,
        recompute=recompute,
        ffn_hidden=cfg.ffn_size,
        **family_terms,
    )


def config_activation_bytes(
    formula: Callable[..., float],
    cfg: ModelConfig,
    width: int,
    *,
    seq_len: int,
    batch_size: int,
    tp_size: int,
    **family_terms,
) -> float:
    """``formula(seq_len, batch_size, hidden, width, tp_size, sp=, recompute=,
    **family_terms)`` with ``cfg``'s hidden size, sequence parallelism and recompute mode:
    16-bit bytes one layer keeps for backward. ``width`` is the formula's own fourth term
    (the heads in the GPT table, the FFN width in Llama's)."""
    return formula(
        seq_len,
        batch_size,
        cfg.hidden_size,
        width,
        tp_size,
        sp=cfg.sequence_parallel,
        recompute=cfg.recompute,
        **family_terms,
    )
