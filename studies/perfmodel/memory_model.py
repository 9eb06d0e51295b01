"""Memory per GPU: weights, gradients, optimizer state and activations.

Bytes per parameter per rank, by what the DP axis shards (``dp_shard``, d = DP size), in
the layout the runtime holds (engine.data_parallel; docs/PERFMODEL.md derives them):

- ``none`` (gradient all-reduce): fp32 parameters that are their own masters (4), fp32
  gradients (4), Adam's two fp32 moments (8): 16 in either precision.
- ``optimizer`` (ZeRO-1): bf16 parameters (2), the fp32 gradient buffer (4), fp32 master
  and moments sharded (12/d): 6 + 12/d; in fp32 4 + 4 + 8/d.
- ``gradients`` (ZeRO-2, FSDP2 keeping parameters gathered between forward and backward):
  the gathered 16-bit parameters (2) plus the sharded fp32 master, gradient and moments
  (16/d): 2 + 16/d (fp32: 4 + 16/d).
- ``full`` (ZeRO-3, FSDP2): 16/d, plus the units gathered in flight
  (``engine.formulas.fsdp_in_flight_bytes``: the computing unit, the largest of which may
  be the embedding-side root, and the one prefetched behind it, parameters and unsharded
  gradients at the compute width, 2 + 2 bytes in bf16).
- HSDP (``dp_replicate`` R > 1, gradients or full): the same with d the ranks of one
  replica, dp ÷ R: the R replicas each hold the whole sharded state.

These and the activations of one layer are the runtime's formulas (``engine.formulas``:
``state_bytes_per_param``, ``layer_activation_bytes``, ``llama_layer_activation_bytes``);
full recompute adds one layer's working set while it is recomputed. fp32 activations take twice the 16-bit bytes. The LM head keeps
fp32 logits (4·s·b·V/t). A fragmentation margin is added on top of the sum. Under context
parallelism (model.py passes s/cp) every activation term is that of s/cp tokens; d is then
dp × cp. Routed experts' state is priced in model.py (``memory_terms``): d ÷ ep ranks
share each expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.formulas import (
    layer_activation_bytes,
    llama_layer_activation_bytes,
)

FRAGMENTATION = 0.10  # allocator fragmentation and workspace, as a fraction of the total
# What the DP axis may shard; parallel_state.dims.DP_SHARD_MODES (which imports torch through
# its package) names the same four, and a test holds them equal.
DP_SHARD = ("none", "optimizer", "gradients", "full")


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes per GPU by kind (before the margin) and the total with the margin."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        """Sum of the terms plus the fragmentation margin."""
        return (self.weights + self.gradients + self.optimizer + self.activations) * (
            1 + FRAGMENTATION
        )

    def as_dict(self) -> dict[str, float]:
        """GiB per term, for reports."""
        terms = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }
        return {k: v / 2**30 for k, v in terms.items()}


def activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    layers: int,
    vocab: int,
    t: int,
    act_bytes: int,
    *,
    sp: bool,
    recompute: str,
    fused_attention: bool,
    gated_ffn: int | None = None,
    in_flight: float = 1.0,
    routed_copies: int = 0,
) -> float:
    """Activation bytes on the rank that holds the most: ``layers`` layers of ``in_flight``
    micro-batches plus the rebuilt layer (a pipeline's first stage), or of one micro-batch
    plus the fp32 logits (the last stage, or the whole model when both are one rank).

    ``gated_ffn`` (the SwiGLU width) prices a gated (Llama) layer; None a GPT layer.
    ``routed_copies`` (MoE: top-k K) adds the K dispatched copies of each token's h-wide
    input the experts' GEMMs keep for backward (2·K·s·b·h bytes, /t under sequence
    parallelism); the MLP's own terms are priced at ``gated_ffn`` = (K + shared)·F.
    """
    scale = act_bytes / 2

    def one_layer(rc: str) -> float:
        if gated_ffn:
            routed = 2 * routed_copies * s * b * h / (t if sp else 1) if rc != "full" else 0.0
            return llama_layer_activation_bytes(s, b, h, gated_ffn, t, sp=sp, recompute=rc) + routed
        return layer_activation_bytes(
            s, b, h, a, t, sp=sp, recompute=rc, fused_attention=fused_attention
        )

    kept = layers * one_layer(recompute)
    working = one_layer("none") if recompute == "full" else 0.0  # rebuilt one at a time
    logits = 4 * s * b * vocab / t
    first = (kept * in_flight + working) * scale
    last = (kept + working) * scale + logits
    return max(first, last) if in_flight > 1 else last
