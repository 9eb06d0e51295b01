"""The element-wise ops of a layer as one swappable set, chosen by ``ModelConfig.kernels``.

The one place where fused kernels get wired into the model. Which backend runs an op is
``layers.kernels.dispatch.choose_backend``: the same "auto" rule as the functional ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layers import dropout
from layers.cross_entropy import vocab_parallel_cross_entropy
from layers.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from layers.kernels import functional as fused
from layers.kernels.dispatch import BACKENDS, choose_backend
from parallel_state.random import RNGTracker


def _torch_bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    *,
    rng: RNGTracker | None = None,
    sharded: bool = False,
) -> torch.Tensor:
    x = x if bias is None else x + bias
    if training and p > 0:
        # native_dropout keeps a 1-byte mask for backward; F.dropout keeps an x-sized one on CPU.
        x = dropout.native_dropout(x, p, rng=rng, sharded=sharded)
    return residual + x


@dataclass(frozen=True)
class Kernels:
    """The element-wise ops of a layer, as one swappable set."""

    layer_norm: Callable[..., torch.Tensor]  # (x, weight, bias, eps)
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps)
    gelu: Callable[..., torch.Tensor]  # (x, bias | None, approximate: "none" | "tanh")
    # (gate_up with interleaved [..., (f two)] columns, bias | None) -> silu(gate) * up
    swiglu: Callable[..., torch.Tensor]
    # (x, bias | None, residual, p, training, *, rng, sharded): the mask from the tracker
    # ``rng``'s sharded stream if ``sharded`` (layers.dropout), else from the default one
    bias_dropout_add: Callable[..., torch.Tensor]
    # (logits, target, *, vocab_size, tp_group, comm_timer): vocab_parallel_cross_entropy's
    cross_entropy: Callable[..., torch.Tensor]


TORCH_KERNELS = Kernels(
    layer_norm=lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
    rms_norm=lambda x, w, eps: fused.rms_norm(x, w, eps, backend="torch"),
    gelu=lambda x, b, approximate: F.gelu(x if b is None else x + b, approximate=approximate),
    swiglu=lambda gate_up, b: fused.swiglu(gate_up, b, backend="torch"),
    bias_dropout_add=_torch_bias_dropout_add,
    cross_entropy=vocab_parallel_cross_entropy,
)


def _fused_kernels(name: str) -> Kernels:
    """The ``layers.kernels`` ops under ``model.kernels=name``; torch's where the rule says so."""
    # apex has a LayerNorm only; the other ops follow the "auto" rule.
    other = "auto" if name == "apex" else name

    def layer_norm(x, w, b, eps):
        backend = choose_backend("layer_norm", x, name)
        if backend == "torch":
            return TORCH_KERNELS.layer_norm(x, w, b, eps)
        return fused.layer_norm(x, w, b, eps, backend=backend)

    def rms_norm(x, w, eps):
        if choose_backend("rms_norm", x, other) == "torch":
            return TORCH_KERNELS.rms_norm(x, w, eps)
        return fused.rms_norm(x, w, eps, backend="triton")

    def gelu(x, bias, approximate):
        if choose_backend("bias_gelu", x, other) == "torch":
            return TORCH_KERNELS.gelu(x, bias, approximate)
        return fused.bias_gelu(x, bias, approximate=approximate, backend="triton")

    def swiglu(gate_up, bias):
        if choose_backend("swiglu", gate_up, other) == "torch":
            return TORCH_KERNELS.swiglu(gate_up, bias)
        return fused.swiglu(gate_up, bias, backend="triton")

    def bias_dropout_add(x, bias, residual, p, training, *, rng=None, sharded=False):
        if choose_backend("bias_dropout_add", x, other) == "torch":
            return TORCH_KERNELS.bias_dropout_add(
                x, bias, residual, p, training, rng=rng, sharded=sharded
            )
        # The kernel's seed is drawn from the current generator: fork to the stream.
        with dropout.dropout_stream(rng, sharded=sharded and training and p > 0):
            return fused.bias_dropout_add(x, bias, residual, p, training, backend="triton")

    def cross_entropy(logits, target, **kwargs):
        # Overwrites the logits with their gradient: callers pass logits nothing else reads.
        if choose_backend("cross_entropy", logits, other) == "torch":
            return TORCH_KERNELS.cross_entropy(logits, target, **kwargs)
        return fused_vocab_parallel_cross_entropy(logits, target, backend="triton", **kwargs)

    return Kernels(layer_norm, rms_norm, gelu, swiglu, bias_dropout_add, cross_entropy)


def resolve_kernels(name: str) -> Kernels:
    """The kernel set for ``ModelConfig.kernels``.

    - ``auto``: per op, ``choose_backend``'s rule: the fused kernel on CUDA tensors where
      ``layers.kernels.dispatch.MODEL_AUTO`` measured it faster than torch at that width;
      torch otherwise (off CUDA, and below the widths the table gives);
    - ``triton``: always the Triton kernels (on CPU they run under ``TRITON_INTERPRET=1``,
      which is how CI checks them inside a whole model);
    - ``apex``: apex's FusedLayerNorm (it must be importable), ``auto`` for the rest;
    - ``torch``: torch's ops everywhere.
    """
    if name not in BACKENDS:
        raise ValueError(f"model.kernels={name!r} is not one of {', '.join(BACKENDS)}")
    return TORCH_KERNELS if name == "torch" else _fused_kernels(name)


def as_kernels(kernels: str | Kernels) -> Kernels:
    """A kernel set already resolved (a model resolves its one set and hands it to every
    layer), or the name of one, resolved here (a layer built on its own)."""
    return kernels if isinstance(kernels, Kernels) else resolve_kernels(kernels)
