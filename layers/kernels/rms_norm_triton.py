"""RMSNorm over the last dim (Llama): launchers and autograd Function.

y = x / sqrt(mean(x²) + eps) · w. The kernels are LayerNorm's without the mean
(``layers.kernels.layer_norm_triton``, ``RMS=True``): one program normalizes one row in
fp32 and saves the row's 1/rms (fp32, 4 bytes a row) for backward, which then needs only
x, w and that; backward keeps fp32 partial sums of the weight gradient per program and
one small sum over programs gives dw (no atomics, and a result that does not depend on
scheduling).
"""

from __future__ import annotations

import torch

from layers.kernels.layer_norm_triton import norm_backward, norm_forward


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalize ``x`` over its last dim and scale by ``weight``: (y, rstd [M] fp32).

    y has the promoted dtype of x and weight, like ``weight * normed`` in torch.
    """
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y, _, rstd = norm_forward(x, weight, None, eps, rms=True, out_dtype=out_dtype)
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients (dx, dweight) of ``rms_norm_forward``; dweight None without a weight."""
    dx, dw, _ = norm_backward(dy, x, weight, None, None, rstd)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dim; saves x, weight and the fp32 row 1/rms (not the output)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None
