"""What every family's ``costs.py`` does alike: apply one of ``engine.formulas``' FLOP or
activation formulas to a ``ModelConfig``. The family passes its formula and the terms only
it has (Llama's K/V width, the GPT table's unfused attention)."""

from __future__ import annotations

from collections.abc import Callable

from engine.formulas import moe_mlp_forward_flops
from engine.models.config import ModelConfig


def config_flops(
    formula: Callable[..., int],
    cfg: ModelConfig,
    batch: int,
    seq: int,
    *,
    vocab: int,
    recompute: bool,
    mlp_matrices: int = 2,
    **family_terms,
) -> int:
    """``formula(batch, seq, layers, hidden, vocab, recompute=, ffn_hidden=, **family_terms)``
    with ``cfg``'s layers, hidden and FFN widths: forward + backward matmul FLOPs on
    ``batch`` sequences, the head ``vocab`` wide.

    With ``cfg.mlp == "moe"`` each MoE layer (every ``moe_layer_freq``-th) counts its
    experts by active parameters (``engine.formulas.moe_mlp_forward_flops``: router, top-k
    experts, shared expert) in place of the dense MLP the family's formula counted
    (``mlp_matrices`` h×f matrices: 2 for GPT's and BERT's, 3 for Llama's SwiGLU), with the
    formula's passes (3: forward and backward; 4 with recomputation)."""
    total = formula(
        batch,
        seq,
        cfg.num_layers,
        cfg.hidden_size,
        vocab,
        recompute=recompute,
        ffn_hidden=cfg.ffn_size,
        **family_terms,
    )
    if cfg.mlp != "moe":
        return total
    tokens, h = batch * seq, cfg.hidden_size
    moe_layers = sum((i + 1) % cfg.moe_layer_freq == 0 for i in range(cfg.num_layers))
    experts = moe_mlp_forward_flops(
        tokens,
        h,
        num_experts=cfg.moe_num_experts,
        top_k=cfg.moe_top_k,
        expert_ffn=cfg.moe_ffn_size,
        matrices=3 if cfg.activation == "swiglu" else 2,
        shared_ffn=cfg.moe_shared_ffn_hidden_size,
        shared_gate=cfg.moe_shared_gate,
    )
    dense = 2 * tokens * mlp_matrices * h * cfg.ffn_size
    return total + (4 if recompute else 3) * moe_layers * (experts - dense)


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
