"""Memory per GPU: weights, gradients, optimizer state and activations.

Bytes per parameter and the activations of one layer are the runtime's formulas
(``engine.formulas.state_bytes_per_param``, ``layer_activation_bytes``); full recompute
adds one layer's working set while it is recomputed. fp32 activations take twice the
16-bit bytes. The LM head keeps fp32 logits (4·s·b·V/t). A fragmentation margin is added
on top of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.formulas import layer_activation_bytes

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
