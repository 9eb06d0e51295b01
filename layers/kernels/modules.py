"""``LayerNorm`` and ``RMSNorm``: drop-ins for ``torch.nn``'s over the last dim, on the fused kernels."""

from __future__ import annotations

import torch
from torch import nn

from layers.kernels.functional import layer_norm, rms_norm


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last dim, with the same parameters and state_dict
    names (``weight``, ``bias``), computed by ``layers.kernels.layer_norm``."""

    def __init__(
        self,
        normalized_shape: int | tuple[int] | list[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        shape = (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        if len(shape) != 1:
            raise ValueError(
                f"this LayerNorm normalizes the last dim only; got normalized_shape {shape}"
            )
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(shape, **factory)) if elementwise_affine else None
        self.bias = (
            nn.Parameter(torch.zeros(shape, **factory)) if elementwise_affine and bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, backend={self.backend!r}"
        )


class RMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` over the last dim, with the same parameter and state_dict name
    (``weight``), computed by ``layers.kernels.rms_norm`` (output in the promoted dtype of
    the input and the weight)."""

    def __init__(
        self,
        size: int,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.size, self.eps, self.backend = size, eps, backend
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(size, **factory)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.eps}, affine={self.weight is not None}, backend={self.backend!r}"
