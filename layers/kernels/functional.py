"""The fused ops' public functional forms: each picks Triton or torch (see ``use_triton``).

Each is a drop-in for the torch expression in its docstring, and its ``backend="torch"``
path is exactly that expression. The Triton modules (and triton itself) are imported on
first use of a Triton path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from layers.cross_entropy import vocab_parallel_cross_entropy
from layers.kernels.dispatch import reject_apex, use_triton
from layers.utils import group_size, resolve_tp_group


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
    if backend == "apex":
        return _apex_layer_norm(x, weight, bias, eps)
    if use_triton(x, backend):
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
    reject_apex(backend, "bias_gelu")
    if use_triton(x, backend):
        from layers.kernels.bias_gelu_triton import BiasGeluFunction

        return BiasGeluFunction.apply(x, bias, approximate)
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


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
    reject_apex(backend, "bias_dropout_add")
    if not use_triton(x, backend):
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


def fused_vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
    comm_timer=None,
) -> torch.Tensor:
    """``layers.vocab_parallel_cross_entropy`` with the same arguments and result, fused.

    ``comm_timer`` times the collectives of the torch path only; the Triton path's two
    small all-reduces go untimed (they count as compute).

    Per-token fp32 loss of logits sharded on their last dim across the TP group, equal to
    ``F.cross_entropy(gathered[..., :vocab_size], target, reduction="none")``; ignored
    tokens get loss 0 and gradient 0, and ``vocab_size`` excludes padding columns.

    On the Triton path, when a gradient is needed, **``logits`` is overwritten with its
    gradient** during forward (so no fp32 copy of the logits is ever made): the caller
    must not read ``logits`` after this call. Its autograd version is bumped, so another
    autograd node that saved the same tensor raises in backward rather than reading
    gradients. Under ``torch.no_grad()`` (or for logits that need no grad) the logits are
    left intact. fp64 logits take the torch path under ``backend="auto"``.
    """
    reject_apex(backend, "fused_vocab_parallel_cross_entropy")
    if not use_triton(logits, backend):
        return vocab_parallel_cross_entropy(
            logits,
            target,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            tp_group=tp_group,
            vocab_size=vocab_size,
            comm_timer=comm_timer,
        )
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
            "logits must be target's shape plus a vocabulary dim"
        )
    group = _checked_group(tp_group, label_smoothing, vocab_size, logits.shape[-1])
    from layers.kernels.cross_entropy_triton import FusedCrossEntropyFunction

    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    return FusedCrossEntropyFunction.apply(
        logits, target, ignore_index, label_smoothing, vocab_size, group, compute_grad
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    reduction: str = "mean",
    chunk_tokens: int = 4096,
    backend: str = "auto",
) -> torch.Tensor:
    """Scalar cross-entropy of the LM head ``hidden @ weight^T``, chunked over tokens.

    Equals ``vocab_parallel_cross_entropy(hidden @ weight.t(), target, ...)`` summed, or
    for ``reduction="mean"`` averaged over the tokens that are not ``ignore_index`` (0
    when there are none). ``hidden`` [..., H] is replicated over the TP group and must
    come through ``layers.copy_to_tp`` (its backward all-reduces the gradient of hidden);
    ``weight`` [V_local, H] is this rank's vocabulary shard. On the Triton path only
    ``chunk_tokens`` x V_local logits exist at a time (in the model dtype), and the
    gradients are computed during forward, so backward runs once.
    """
    reject_apex(backend, "fused_linear_cross_entropy")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if (
        hidden.shape[:-1] != target.shape
        or weight.dim() != 2
        or weight.shape[1] != hidden.shape[-1]
    ):
        raise ValueError(
            f"expected hidden [..., H], weight [V_local, H] and target hidden.shape[:-1]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}"
        )
    options = dict(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        tp_group=tp_group,
        vocab_size=vocab_size,
    )
    if not use_triton(hidden, backend):
        loss = vocab_parallel_cross_entropy(hidden @ weight.t(), target, **options).sum()
        if reduction == "sum":
            return loss
        return loss / (target != ignore_index).sum().clamp_min(1)
    group = _checked_group(tp_group, label_smoothing, vocab_size, weight.shape[0])
    from layers.kernels.linear_cross_entropy_triton import LinearCrossEntropyFunction

    del options["tp_group"]
    options.update(group=group, chunk_tokens=chunk_tokens)
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropyFunction.apply(
        hidden, weight, target, options, reduction, compute_grad
    )


def _checked_group(
    tp_group: dist.ProcessGroup | None, label_smoothing: float, vocab_size: int | None, local: int
) -> dist.ProcessGroup | None:
    """The resolved TP group, after the argument checks of vocab_parallel_cross_entropy."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    group = resolve_tp_group(tp_group)
    padded = group_size(group) * local
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size {vocab_size} must be in (0, {padded}] "
            "(the padded vocabulary across the TP group)"
        )
    return group
