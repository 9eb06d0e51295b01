"""Which classes fill a transformer layer's slots: the norm, the attention, the MLP.

A ``LayerSpec`` names one class per slot; ``spec_for(cfg)`` picks them from the registries
below by the names the model config carries (``cfg.norm``, ``cfg.attention``, ``cfg.mlp``).
A new attention or MLP (sliding-window, ring, mixture of experts) is a class plus an entry
in ``ATTENTIONS`` or ``MLPS``; the layer (``layers.transformer``) is not edited.

The slot constructors, which the layer calls in this order (it fixes the RNG draws of the
master weights):

* attention and MLP: ``cls(cfg, *, tp_group, rng, kernels, dtype, device)``. The layer
  passes every keyword; a class ignores those it has no use for (the dense MLP draws no
  dropout, so ignores ``rng``; attention uses ``kernels`` only for its QK norms).
  ``forward`` takes ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) and
  returns ``(out, bias or None)``: the bias unadded, for the layer's fused bias + dropout +
  residual add. Attention's forward also takes ``mask, cache, rotary``,
  and its constructor ``cp_group`` too (the context-parallel ranks splitting each
  sequence; None or one rank: none), since attention alone sees across tokens, and
  ``window`` where the spec holds one (a sliding window; not passed when None, so a class
  without windows needs no such keyword).
* norm (both ``attention_norm`` and ``mlp_norm``): ``cls(width, eps, *,
  sequence_parallel, kernels, dtype, device)``, the form the embedding and head norms are
  built with too; ``forward`` maps ``[..., width]`` to the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from layers.attention import ParallelAttention
from layers.mlp import ParallelMLP
from layers.moe import MoEMLP
from layers.norm import NORMS
from layers.transformer_config import TransformerConfig

ATTENTIONS: dict[str, type[nn.Module]] = {"standard": ParallelAttention}  # MHA, GQA, MQA
MLPS: dict[str, type[nn.Module]] = {
    "dense": ParallelMLP,  # GeLU or SwiGLU per cfg.activation
    "moe": MoEMLP,  # mixture of experts (layers.moe)
}

__all__ = ["ATTENTIONS", "MLPS", "NORMS", "LayerSpec", "pick", "spec_for"]


@dataclass(frozen=True)
class LayerSpec:
    """The classes a ``ParallelTransformerLayer`` builds its slots from (see the module
    docstring for the constructor each slot is called with)."""

    norm: type[nn.Module]  # attention_norm and mlp_norm (and the post norms, if any)
    attention: type[nn.Module]
    mlp: type[nn.Module]
    # The sliding window this layer's attention keeps (``window=`` to its constructor);
    # None: all earlier keys, and the keyword is not passed.
    window: int | None = None


def pick(slot: str, name: str, registry: dict[str, type[nn.Module]]) -> type[nn.Module]:
    """``registry[name]``; a one-line ValueError naming ``name`` and the known names."""
    if name not in registry:
        raise ValueError(f"unknown {slot} {name!r}; known: {sorted(registry)}")
    return registry[name]


def spec_for(cfg: TransformerConfig, layer: int | None = None) -> LayerSpec:
    """The spec ``cfg.norm``, ``cfg.attention`` and ``cfg.mlp`` name.

    ``layer`` (0-based; None: any) thins the MLP: layer i holds ``cfg.mlp`` when
    (i + 1) % ``cfg.moe_layer_freq`` == 0 and the dense MLP otherwise (transformers'
    ``decoder_sparse_step``: experts on every k-th layer). It also picks the attention's
    sliding window: ``cfg.sliding_window``, but none on the layers i with (i + 1) %
    ``cfg.full_attention_every`` == 0 (Gemma 2 alternates: 2).
    """
    window = cfg.sliding_window
    every = cfg.full_attention_every
    if layer is not None and every and (layer + 1) % every == 0:
        window = None
    return LayerSpec(
        norm=pick("norm", cfg.norm, NORMS),
        attention=pick("attention", cfg.attention, ATTENTIONS),
        mlp=pick("mlp", mlp_name(cfg, layer), MLPS),
        window=window,
    )


def mlp_name(cfg: TransformerConfig, layer: int | None = None) -> str:
    """The MLP class name layer ``layer`` holds (see :func:`spec_for`): ``cfg.mlp`` on
    layers i with (i + 1) % ``cfg.moe_layer_freq`` == 0, "dense" on the others."""
    sparse = layer is None or (layer + 1) % cfg.moe_layer_freq == 0
    return cfg.mlp if sparse else "dense"
