"""Fused Triton kernels for the transformer's memory-bound ops, with torch fallbacks.

Each op has four layers (the Liger-Kernel pattern), named after the op:

1. ``_op_fwd_kernel`` / ``_op_bwd_kernel``: ``@triton.jit`` kernels, fp32 accumulation
   (``<op>_triton.py``);
2. ``op_forward`` / ``op_backward``: launchers that reshape to 2-D, pick block sizes and
   warps, allocate outputs and check shapes and dtypes (same files);
3. ``OpFunction``: the ``torch.autograd.Function`` (same files);
4. the functional form here (``functional.py``) and ``LayerNorm`` (``modules.py``).

``fused_linear_cross_entropy`` (LM head + cross-entropy, chunked over tokens) reuses the
cross-entropy kernels; its Function is in ``linear_cross_entropy_triton.py``.

Every public op takes ``backend=``: ``"auto"`` (Triton on CUDA, or on CPU under
``TRITON_INTERPRET=1``; torch otherwise), ``"torch"``, ``"triton"``, or for
``layer_norm`` ``"apex"``. Importing this package does not import triton.
"""

from layers.kernels.dispatch import interpreting, use_triton
from layers.kernels.functional import (
    bias_dropout_add,
    bias_gelu,
    fused_linear_cross_entropy,
    fused_vocab_parallel_cross_entropy,
    layer_norm,
)
from layers.kernels.modules import LayerNorm

__all__ = [
    "LayerNorm",
    "bias_dropout_add",
    "bias_gelu",
    "fused_linear_cross_entropy",
    "fused_vocab_parallel_cross_entropy",
    "interpreting",
    "layer_norm",
    "use_triton",
]
