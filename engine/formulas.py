"""The runtime's closed-form formulas, in plain Python (no torch): matmul FLOPs of GPT,
BERT and Llama-family steps, the Llama family's parameter count, the padded vocabulary,
the bytes each rank holds per parameter and the activation bytes one transformer layer
keeps for backward; and the whole-percent split of a step the console and the planner print.

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
    parameter between layers, as the runtime's data-parallel strategies hold them
    (``dp_shard`` one of none, optimizer, gradients, full; ``dp`` the DP size).

    ``"none"`` (the all-reduce path): fp32 parameters, their own masters, under autocast
    in every precision; fp32 gradients; Adam's two fp32 moments: 4 + 4 + 8 = 16. (The 18
    of a bf16-parameter layout counts a bf16 copy this path never keeps.)
    ``"optimizer"`` (ZeRO-1): the fp32 gradient buffer (4) and a 1/dp slice of the moments
    (8/dp); in bf16, bf16 parameters (2) with fp32 master slices (4/dp), else fp32
    parameters that are their own masters (4). Measured per rank in
    tests/test_data_parallel.py.
    ``"gradients"`` (ZeRO-2): compute-width parameters kept whole (2 in bf16, 4 in fp32),
    gradients sharded (4/dp) and the fp32 master and moments sharded (12/dp).
    ``"full"`` (ZeRO-3): everything sharded, 16/dp; the layers gathered in flight are extra.
    """
    if dp_shard == "none":
        return 4.0, 4.0, 8.0
    compute = 4.0 if precision == "fp32" else 2.0
    if dp_shard == "optimizer":
        return (2.0, 4.0, 12.0 / dp) if precision == "bf16" else (4.0, 4.0, 8.0 / dp)
    if dp_shard in ("gradients", "full"):
        return (compute if dp_shard == "gradients" else 0.0), 4.0 / dp, 12.0 / dp
    raise ValueError(f"parallel.dp_shard={dp_shard!r} has no bytes-per-parameter formula")


# Units FSDP2 (ZeRO-2/3) holds gathered at once at its peak: the one computing and the one
# prefetched behind it (engine/data_parallel/fsdp.py prefetches one unit ahead).
IN_FLIGHT_UNITS = 2


def fsdp_in_flight_bytes(
    layer_params: float, root_params: float, precision: str, dp_shard: str
) -> float:
    """Bytes one rank holds gathered beyond :func:`state_bytes_per_param`'s shards under
    FSDP2, at its peak: :data:`IN_FLIGHT_UNITS` units, the largest of which may be the root
    unit (embeddings, final norm, head: ``root_params``) rather than a layer
    (``layer_params``), both per TP rank. ``full`` gathers their parameters and holds their
    unsharded gradients until reduce-scattered, at the compute width (2 bytes each in
    bf16/fp16, 4 in fp32); ``gradients`` keeps its parameters whole already (counted per
    parameter), so only the unsharded gradients; nothing for the other modes.
    """
    width = 4.0 if precision == "fp32" else 2.0
    per_param = {"full": 2 * width, "gradients": width}.get(dp_shard, 0.0)
    units = max(layer_params, root_params) + (IN_FLIGHT_UNITS - 1) * layer_params
    return units * per_param


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


# The Llama family (engine/models/llama/costs.py re-exports these). Per layer and token
# the forward multiplies by the query (h×h), key/value (h×2·kv·d, smaller than h×2h under
# grouped-query attention), output (h×h) and the SwiGLU MLP's three matrices, gate and up
# (h×f each) and down (f×h), and forms QKᵀ and attention·V against all s positions (every
# query head, so GQA does not shrink them)::
#
#     per-layer forward = 2·B·s·(2·h² + 2·h·kv·d + 3·h·f) + 4·B·s²·h
#
# Backward is twice the forward, full recomputation one forward more; the LM head adds
# 2·B·s·h·V forward, as for GPT.


def llama_layer_weights(hidden: int, ffn_hidden: int, kv_width: int) -> dict[str, int]:
    """Weights of one Llama layer by group (no biases): query and output projections,
    key/value projections, the SwiGLU MLP's three matrices, the two RMSNorm weights."""
    return {
        "q_out": 2 * hidden * hidden,
        "kv": 2 * hidden * kv_width,
        "mlp": 3 * hidden * ffn_hidden,
        "norms": 2 * hidden,
    }


def llama_flops_per_iteration(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    *,
    ffn_hidden: int,
    kv_width: int,
    recompute: bool = False,
) -> int:
    """Forward + backward matmul FLOPs of a Llama-family step; ``kv_width`` = kv_heads · d."""
    tokens = batch * seq
    projections = (
        2 * tokens * (2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * ffn_hidden)
    )
    attention = 4 * batch * seq * seq * hidden
    layer_passes = 4 if recompute else 3
    lm_head = 2 * tokens * hidden * vocab
    return layer_passes * layers * (projections + attention) + 3 * lm_head


def moe_mlp_forward_flops(
    tokens: int,
    hidden: int,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn: int,
    matrices: int,
    shared_ffn: int = 0,
    shared_gate: bool = False,
) -> int:
    """Matmul FLOPs of one mixture-of-experts MLP's forward on ``tokens`` tokens, counted by
    active parameters: the router GEMM (h×E), each token's ``top_k`` experts (``matrices``
    h×f_e-sized matrices each: 3 for SwiGLU, 2 for GeLU), the shared expert (the same
    matrices, ``shared_ffn`` wide; 0: none) and its sigmoid gate (h×1)::

        2·T·(h·E + k·m·h·f_e + m·h·f_s + h·[gate])

    Every chosen slot counts, also one a capacity factor drops (model FLOPs, as the dense
    attention's masked half counts); the permutation and the weighted sum are no matmuls.
    """
    per_token = hidden * num_experts + top_k * matrices * hidden * expert_ffn
    if shared_ffn:
        per_token += matrices * hidden * shared_ffn + (hidden if shared_gate else 0)
    return 2 * tokens * per_token


def llama_params_count(
    layers: int,
    hidden: int,
    vocab: int,
    *,
    ffn_hidden: int,
    kv_width: int,
    qkv_bias: bool,
    linear_bias: bool,
    tied: bool,
) -> int:
    """Parameters of the full model (unpadded vocabulary), as ``full_state_dict`` holds.

    Per layer: q and output h² each, K/V 2·h·kv_width, SwiGLU 3·h·f, two RMSNorm weights
    2h; QKV biases h + 2·kv_width, output and MLP biases 2h + 2f when present.
    """
    per_layer = sum(llama_layer_weights(hidden, ffn_hidden, kv_width).values())
    per_layer += (hidden + 2 * kv_width) if qkv_bias else 0
    per_layer += (2 * hidden + 2 * ffn_hidden) if linear_bias else 0
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden  # + final norm


def llama_layer_activation_bytes(
    s: int, b: int, h: int, f: int, t: int, *, sp: bool, recompute: str
) -> float:
    """16-bit bytes one Llama layer keeps for backward (fused attention, no dropout), as the
    runtime's torch path keeps them (measured in tests/test_perfmodel.py).

    In s·b·h units, whole on every TP rank unless sequence parallelism splits them (16):
    each RMSNorm's fp32 input (4 + 4) and 16-bit output (2 + 2), and the 16-bit inputs the
    column-parallel QKV and gate/up projections save (2 + 2). Split over TP (8 + 8f/h): Q,
    K and V (K and V expanded to the query heads for the attention kernel, so grouped-query
    attention saves no activation memory here), the attention output (2), the f-wide gate
    and up (4f/h), their SwiGLU product and the down projection's input (2f/h each). Full
    recompute keeps the layer input.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    whole = 16.0 / (t if sp else 1)
    return s * b * h * (whole + (8 + 8 * f / h) / t)


def whole_percentages(values: list[float]) -> list[int]:
    """Each value's share of their sum in whole percent, summing to exactly 100 (to 0 for
    an all-zero list): the floors, then one more point each to the largest remainders (the
    earlier part on a tie). Rounding each share alone prints 1% + 97% + 3% = 101%. A
    negative value (a clock's rounding below zero) counts as 0."""
    values = [max(0.0, v) for v in values]
    total = sum(values)
    if total <= 0:
        return [0] * len(values)
    exact = [100 * v / total for v in values]
    whole = [int(x) for x in exact]
    by_remainder = sorted(range(len(values)), key=lambda i: whole[i] - exact[i])
    for i in by_remainder[: 100 - sum(whole)]:
        whole[i] += 1
    return whole
