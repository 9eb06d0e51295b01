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
- ``full`` (ZeRO-3, FSDP2): 16/d, plus the layers gathered in flight: ``IN_FLIGHT_LAYERS``
  layers' parameters and unsharded gradients at the compute width (2 + 2 bytes in bf16).

Activations of one layer (16-bit, s·b·h units, t = TP size) follow the standard table:
34 + 5as/h without TP; 10 + 24/t + 5as/(ht) with TP; 34/t + 5as/(ht) with TP + SP;
the 5as/h term is gone with selective recompute or a fused attention kernel; full
recompute keeps only the layer input (2sbh, /t under SP) plus one layer's working set
while it is recomputed. fp32 activations take twice the 16-bit bytes. The LM head keeps
fp32 logits (4·s·b·V/t). A fragmentation margin is added on top of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

FRAGMENTATION = 0.10  # allocator fragmentation and workspace, as a fraction of the total
# What the DP axis may shard; parallel_state.dims.DP_SHARD_MODES (which imports torch through
# its package) names the same four, and a test holds them equal.
DP_SHARD = ("none", "optimizer", "gradients", "full")
# Layers whose parameters FSDP2 holds gathered at once under ``full``: the one computing and
# the one prefetched behind it.
IN_FLIGHT_LAYERS = 2


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


def state_bytes_per_param(precision: str, dp_shard: str, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer incl. master) bytes per parameter held between layers
    on one rank (the module doc's table; ``full``'s in-flight layers are extra)."""
    if dp_shard not in DP_SHARD:
        raise ValueError(f"dp_shard={dp_shard!r} is not one of {DP_SHARD}")
    compute = 4.0 if precision == "fp32" else 2.0
    if dp_shard == "none":
        return 4.0, 4.0, 8.0
    if dp_shard == "optimizer":
        master = 0.0 if precision == "fp32" else 4.0  # fp32 parameters are their own masters
        return compute, 4.0, (8.0 + master) / dp
    whole = compute if dp_shard == "gradients" else 0.0
    return whole, 4.0 / dp, 12.0 / dp


def in_flight_bytes(layer_params: float, precision: str, dp_shard: str) -> float:
    """Bytes of the layers FSDP2 holds gathered at once: parameters and their unsharded
    gradients at the compute width (``full``); ``gradients`` keeps parameters whole
    already, so only the unsharded gradients of those layers; nothing otherwise."""
    width = 4.0 if precision == "fp32" else 2.0
    per_param = {"full": 2 * width, "gradients": width}.get(dp_shard, 0.0)
    return IN_FLIGHT_LAYERS * layer_params * per_param


def layer_activation_bytes(
    s: int, b: int, h: int, a: int, t: int, *, sp: bool, recompute: str, fused_attention: bool
) -> float:
    """16-bit activation bytes one layer keeps for backward (the table in the module doc)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    scores = 0.0 if (recompute == "selective" or fused_attention) else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + scores)
    if t == 1:
        return s * b * h * (34 + scores)
    return s * b * h * (10 + 24 / t + scores)


def llama_layer_activation_bytes(
    s: int, b: int, h: int, a: int, kv: int, f: int, t: int, *, sp: bool, recompute: str
) -> float:
    """16-bit bytes one Llama layer keeps for backward (fused attention, no dropout).

    In s·b·h units: the two RMSNorm inputs (4), the QKV input (2), Q (2), K and V (4·kv/a:
    grouped-query attention's smaller projections), the output projection's input (2), the
    MLP input (2) and the f-wide gate, silu(gate), up and product tensors (8·f/h). Heads
    and f are split over TP (a rank holds kv/t KV heads, at least one); the norm, QKV and
    MLP inputs (8) are whole on every TP rank unless sequence parallelism splits them.
    Full recompute keeps the layer input. Derived from what autograd saves; not measured.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    split = (4 + 8 * f / h) / t
    kv_part = 4 * kv / a / min(t, kv)
    whole = 8.0 / (t if sp else 1)
    return s * b * h * (whole + split + kv_part)


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
    llama: tuple[int, int] | None = None,
    in_flight: float = 1.0,
) -> float:
    """Activation bytes on the rank that holds the most: ``layers`` layers of ``in_flight``
    micro-batches plus the rebuilt layer (a pipeline's first stage), or of one micro-batch
    plus the fp32 logits (the last stage, or the whole model when both are one rank).

    ``llama`` = (kv_heads, ffn) prices a Llama layer; None a GPT layer.
    """
    scale = act_bytes / 2

    def one_layer(rc: str) -> float:
        if llama:
            kv, f = llama
            return llama_layer_activation_bytes(s, b, h, a, kv, f, t, sp=sp, recompute=rc)
        return layer_activation_bytes(
            s, b, h, a, t, sp=sp, recompute=rc, fused_attention=fused_attention
        )

    kept = layers * one_layer(recompute)
    working = one_layer("none") if recompute == "full" else 0.0  # rebuilt one at a time
    logits = 4 * s * b * vocab / t
    first = (kept * in_flight + working) * scale
    last = (kept + working) * scale + logits
    return max(first, last) if in_flight > 1 else last
