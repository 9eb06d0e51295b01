"""Rotary position embeddings (RoPE), with the Llama 3 frequency scaling.

The angles are computed in fp32 whatever the model's dtype and then cast, as Hugging
Face's Llama does, so that a model matches its reference bit for bit in fp64 as well.
Rotation pairs dimension i with i + d/2 ("rotate half"), HF's layout, so imported q/k
weights need no permutation.
"""

from __future__ import annotations

import math

import torch

ROPE_SCALINGS = ("none", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """fp32 ``[head_dim/2]`` rotation frequencies θ^(−2i/d), Llama-3-scaled when ``scaling``
    (``factor, low_freq_factor, high_freq_factor, original_max_positions``) is given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = original / low, original / high
    # Long wavelengths are slowed by `factor`, short ones kept; the band between blends.
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each ``[b, 1, s, d]``, for ``positions`` ``[b, s]`` (any integer dtype)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device, torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, d]`` by the angles in ``cos``/``sin`` ``[b, 1, s, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
