"""What the families' Hugging Face maps share: per-head QKV rows, GeLU spellings, and the
contiguous copies a converted state dict is made of."""

from __future__ import annotations

import torch
from einops import rearrange

# config.json activation names → ModelConfig.activation
GELU_NAMES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def activation_from_hf(name: str) -> str:
    """``ModelConfig.activation`` of an HF GeLU name; a one-line error for others."""
    if name not in GELU_NAMES:
        raise ValueError(f"activation {name!r} is not supported; use one of {sorted(GELU_NAMES)}")
    return GELU_NAMES[name]


def activation_to_hf(activation: str, original: str | None) -> str:
    """The HF name of ``activation``: the imported original's spelling when it means the
    same (``gelu_pytorch_tanh`` and ``gelu_new`` are one function), else the usual one."""
    if GELU_NAMES.get(original) == activation:
        return original
    return "gelu_new" if activation == "gelu_tanh" else "gelu"


def qkv_to_meshtron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Fuse q, k, v (rows ``(heads d)``) into meshtron's per-head ``(heads three d)`` rows,
    so that each TP rank's contiguous slice holds whole heads."""
    return rearrange(
        torch.stack([q, k, v]), "three (heads d) ... -> (heads three d) ...", heads=heads
    )


def qkv_from_meshtron(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`qkv_to_meshtron`: (q, k, v), each with rows ``(heads d)``."""
    return tuple(rearrange(qkv, "(heads three d) ... -> three (heads d) ...", heads=heads, three=3))


def contiguous_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor copied into its own contiguous storage (no views of the input left)."""
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in state.items()}
