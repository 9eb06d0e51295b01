"""The Llama family's FLOP terms (matmuls only, 2 per multiply-accumulate).

Per layer and token the forward multiplies by the query (h×h), key/value (h×2·kv·d,
smaller than h×2h under grouped-query attention), output (h×h) and the SwiGLU MLP's three
matrices, gate and up (h×f each) and down (f×h), and forms QKᵀ and attention·V against
all s positions (every query head, so GQA does not shrink them)::

    per-layer forward = 2·B·s·(2·h² + 2·h·kv·d + 3·h·f) + 4·B·s²·h

Backward is twice the forward, full recomputation one forward more; the LM head adds
2·B·s·h·V forward, as for GPT (engine.formulas).
"""

from __future__ import annotations


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
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * ffn_hidden + 2 * hidden
    per_layer += (hidden + 2 * kv_width) if qkv_bias else 0
    per_layer += (2 * hidden + 2 * ffn_hidden) if linear_bias else 0
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden  # + final norm
