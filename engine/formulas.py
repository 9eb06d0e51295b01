"""The runtime's closed-form formulas, in plain Python (no torch): matmul FLOPs of GPT and
BERT steps, the padded vocabulary, the bytes each rank holds per parameter and the
activation bytes one transformer layer keeps for backward.

The trainer (through engine.flops, which re-exports them and derives them), its tests
and the performance model (studies/perfmodel, which runs where torch is not installed)
all read them here, so each formula has one source.
"""

from __future__ import annotations


def _layer_forward_flops(batch: int, seq: int, hidden: int, ffn: int) -> int:
    """Matmul FLOPs of one transformer layer's forward pass (see engine.flops)."""
    projections = 2 * batch * seq * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 4 * batch * seq * seq * hidden  # QKᵀ and scores·V, all s×s entries
    return projections + attention


def gpt_flops_per_iteration(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    *,
    recompute: bool = False,
    ffn_hidden: int | None = None,
) -> int:
    """Forward + backward matmul FLOPs of a GPT step on ``batch`` sequences of ``seq`` tokens.

    With ``ffn_hidden`` None (4·hidden) this is exactly the usual model-FLOPs formula,
    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)); ``recompute=True`` (full activation
    recomputation) counts the layers' extra forward: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
    Pass the vocabulary the LM head actually multiplies by (the padded one) to count the
    work done; MFU conventions (Megatron's included) do the same.

    The recompute count is the usual one (a whole extra forward). torch's non-reentrant
    checkpoint stops once the last saved tensor is regenerated, so on a pre-LN layer it
    skips fc2's forward: the hardware then does 2·B·s·f·h·l fewer FLOPs than counted.
    """
    ffn = ffn_hidden or 4 * hidden
    layer_passes = 4 if recompute else 3
    lm_head = 2 * batch * seq * hidden * vocab
    return layer_passes * layers * _layer_forward_flops(batch, seq, hidden, ffn) + 3 * lm_head


def bert_flops_per_iteration(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    *,
    recompute: bool = False,
    ffn_hidden: int | None = None,
) -> int:
    """Forward + backward matmul FLOPs of a BERT pre-training step (MLM on every position + SOP).

    Derived with the same counting as GPT:

    - layers: bidirectional attention forms the same s×s scores as causal attention
      (neither kernel skips masked blocks), so each layer costs what a GPT layer costs;
    - MLM head: the transform dense (h×h) and the decoder (h×V) run on all B·s positions,
      not only the masked ones: 2·B·s·h² + 2·B·s·h·V forward;
    - pooler dense (h×h) on the [CLS] token and the sentence-order head (h×2):
      2·B·h² + 4·B·h forward.

    Every one of these matmuls also computes its input and weight gradients, so
    forward + backward is 3× the forward, and with f = 4h

        F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h) + 1/(12·l)) + 6·B·h² + 12·B·h.

    ``recompute=True`` adds one more forward of the layers only (96 for 72 in the layer
    term; the heads are not recomputed).
    """
    gpt_part = gpt_flops_per_iteration(
        batch, seq, layers, hidden, vocab, recompute=recompute, ffn_hidden=ffn_hidden
    )
    mlm_transform = 2 * batch * seq * hidden * hidden
    pooler_and_sop = 2 * batch * hidden * hidden + 2 * batch * hidden * 2
    return gpt_part + 3 * (mlm_transform + pooler_and_sop)


def pad_vocab(vocab: int, multiple: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (the embedding rows actually allocated)."""
    return -(-vocab // multiple) * multiple


def state_bytes_per_param(precision: str, dp_shard: str, dp: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state incl. masters) bytes one rank holds per
    parameter, as the runtime's data-parallel strategies hold them.

    ``dp_shard="none"`` (the all-reduce path): fp32 parameters, their own masters, under
    autocast in every precision; fp32 gradients; Adam's two fp32 moments: 4 + 4 + 8 = 16.
    (The 18 of a bf16-parameter layout counts a bf16 copy this path never keeps.)
    ``"optimizer"`` (ZeRO-1): the fp32 gradient buffer (4) and a 1/dp slice of the moments
    (8/dp); in bf16, bf16 parameters (2) with fp32 master slices (4/dp), else fp32
    parameters that are their own masters (4). Measured per rank in
    tests/test_data_parallel.py. A new sharding mode adds its branch here.
    """
    if dp_shard == "none":
        return 4.0, 4.0, 8.0
    if dp_shard == "optimizer":
        return (2.0, 4.0, 12.0 / dp) if precision == "bf16" else (4.0, 4.0, 8.0 / dp)
    raise ValueError(f"parallel.dp_shard={dp_shard!r} has no bytes-per-parameter formula")


def layer_activation_bytes(
    s: int, b: int, h: int, a: int, t: int, *, sp: bool, recompute: str, fused_attention: bool
) -> float:
    """16-bit activation bytes one transformer layer keeps for backward (Korthikanti et al.'s
    table, sequence ``s``, micro-batch ``b``, hidden ``h``, ``a`` heads, TP size ``t``).

    Without TP 34 + 5as/h (in s·b·h bytes); with TP 10 + 24/t + 5as/(ht); with TP + sequence
    parallelism (``sp``) 34/t + 5as/(ht). The 5as/h term (the stored s×s softmax, its
    dropout mask and output) is gone with selective recompute or a fused attention
    kernel; full recompute keeps only the layer input (2sbh, /t under SP). Measured per
    layer in tests/test_transformer.py.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    scores = 0.0 if (recompute == "selective" or fused_attention) else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + scores)
    return s * b * h * (10 + 24 / t + scores)
