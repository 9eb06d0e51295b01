"""Memory per GPU: weights, gradients, optimizer state and activations.

Bytes per parameter (p = parameter bytes, g = gradient bytes):

- plain: bf16 training keeps bf16 weights (2), fp32 gradients (4), fp32 master weights (4)
  and Adam's two fp32 moments (8): 18. fp32 training has no master copy: 4 + 4 + 8 = 16.
- ZeRO-1 shards master weights and moments over d: 6 + 12/d (bf16), 8 + 8/d (fp32).

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


def state_bytes_per_param(precision: str, zero1: bool, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer incl. master) bytes per parameter on one rank."""
    if precision == "fp32":
        weights, grads, opt = 4.0, 4.0, 8.0
    else:
        weights, grads, opt = 2.0, 4.0, 12.0
    return weights, grads, opt / dp if zero1 else opt


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
) -> float:
    """All activation bytes of one micro-batch on one rank (layers, working set, logits)."""
    scale = act_bytes / 2
    kept = layers * layer_activation_bytes(
        s, b, h, a, t, sp=sp, recompute=recompute, fused_attention=fused_attention
    )
    if recompute == "full":  # one layer is rebuilt at a time in backward
        kept += layer_activation_bytes(
            s, b, h, a, t, sp=sp, recompute="none", fused_attention=fused_attention
        )
    logits = 4 * s * b * vocab / t
    return kept * scale + logits
