"""The fused ops' public functional forms: each picks Triton or torch (``choose_backend``).

Each is a drop-in for the torch expression in its docstring, and its ``backend="torch"``
path is exactly that expression. The Triton modules (and triton itself) are imported on
first use of a Triton path. The fused cross-entropy, which communicates over the TP
group, is a layer: ``layers.fused_cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layers.kernels.dispatch import choose_backend


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``F.layer_norm(x, (x.shape[-1],), weight, bias, eps)``, fused.

    ``backend="apex"`` runs apex's FusedLayerNorm (an error when apex is not installed).
    The Triton path accepts a weight and bias dtype different from x (e.g. fp32 weights
    with bf16 activations); the output has x's dtype.
    """
    backend = choose_backend("layer_norm", x, backend)
    if backend == "apex":
        return _apex_layer_norm(x, weight, bias, eps)
    if backend == "triton":
        from layers.kernels.layer_norm_triton import LayerNormFunction

        return LayerNormFunction.apply(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _apex_layer_norm(x, weight, bias, eps):
    try:
        from apex.normalization.fused_layer_norm import (
            fused_layer_norm,
            fused_layer_norm_affine,
        )
    except ImportError as err:
        raise RuntimeError(
            "backend='apex' needs NVIDIA apex built with its CUDA extensions "
            "(apex.normalization.fused_layer_norm); use backend='auto' or 'triton'"
        ) from err
    shape = (x.shape[-1],)
    if weight is None and bias is None:
        return fused_layer_norm(x, shape, eps)
    if weight is None or bias is None:
        raise ValueError("apex's fused LayerNorm takes both weight and bias, or neither")
    return fused_layer_norm_affine(x, weight, bias, shape, eps)


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    approximate: str = "tanh",
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)``, fused; bias may be None.

    Backward recomputes x + bias from x rather than saving the output or the sum.
    """
    if choose_backend("bias_gelu", x, backend) == "triton":
        from layers.kernels.bias_gelu_triton import BiasGeluFunction

        return BiasGeluFunction.apply(x, bias, approximate)
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm over the last dim, ``x / sqrt(mean(x²) + eps) · weight``, fused.

    The torch path computes in at least fp32 (half inputs are upcast, as Hugging Face's
    Llama does; fp64 stays fp64), rounds the normalized x back to x's dtype and multiplies
    by the weight: the output has the promoted dtype of x and weight. The Triton path keeps
    everything in fp32 and rounds once, to that same dtype.
    """
    if choose_backend("rms_norm", x, backend) == "triton":
        from layers.kernels.rms_norm_triton import RMSNormFunction

        return RMSNormFunction.apply(x, weight, eps)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def swiglu(
    gate_up: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """``F.silu(gate) * up`` of interleaved ``[..., (f two)]`` columns (gate at even, up at
    odd; ``layers.mlp``'s layout), plus ``bias`` first when given, → ``[..., f]``, fused.

    The Triton path writes dgate and dup interleaved straight into gate_up's gradient. A
    bias is added by torch before the kernel (the Llama family has none).
    """
    if bias is not None:
        gate_up = gate_up + bias
    if choose_backend("swiglu", gate_up, backend) == "triton":
        from layers.kernels.swiglu_triton import SwiGLUFunction

        return SwiGLUFunction.apply(gate_up)
    return F.silu(gate_up[..., 0::2]) * gate_up[..., 1::2]


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    seed: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``residual + F.dropout(x + bias, p, training)``, fused; bias may be None.

    The Triton mask is Philox of (seed, element index), regenerated in backward, so no
    mask is stored; the same seed gives the same mask (recomputation reproduces the
    forward exactly). With ``seed=None`` the seed is drawn from the current default
    generator of x's device, and that is how TP awareness works: inside
    ``with parallel_state.get().rng.fork():`` the draw comes from this TP rank's sharded
    stream (masks differ across TP ranks, for TP-sharded activations); outside it comes
    from the replicated stream (the same mask on every TP rank, for replicated
    activations). The torch backend draws its mask from the same generator, through
    ``F.dropout``, so the two backends give different masks of the same distribution.
    """
    if choose_backend("bias_dropout_add", x, backend) != "triton":
        return residual + F.dropout(x if bias is None else x + bias, p, training)
    from layers.kernels.bias_dropout_add_triton import BiasDropoutAddFunction

    dropout = training and p > 0.0
    if not dropout:
        seed_t = torch.zeros(1, dtype=torch.int64, device=x.device)  # unused by the kernels
    elif seed is None:
        seed_t = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=x.device)
    else:
        seed_t = torch.tensor([seed], dtype=torch.int64, device=x.device)
    return BiasDropoutAddFunction.apply(x, bias, residual, p, seed_t, dropout)
