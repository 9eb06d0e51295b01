"""Fused Triton kernels for the transformer's memory-bound ops, with torch fallbacks.

A leaf: nothing here imports from ``layers`` outside ``layers/kernels``, and nothing here
communicates. Each op has four layers (the Liger-Kernel pattern), named after the op:

1. ``_op_fwd_kernel`` / ``_op_bwd_kernel``: ``@triton.jit`` kernels, fp32 accumulation
   (``<op>_triton.py``);
2. ``op_forward`` / ``op_backward``: launchers that reshape to 2-D, pick block sizes and
   warps, allocate outputs and check shapes and dtypes (same files);
3. ``OpFunction``: the ``torch.autograd.Function`` (same files);
4. the functional form (``functional.py``) and ``LayerNorm``, ``RMSNorm`` (``modules.py``).

The cross-entropy kernels (``cross_entropy_triton.py``) stop at the launchers: the
vocab-parallel layer that reduces their statistics over the TP group between the two
launches, its Functions and the chunked LM head are ``layers.fused_cross_entropy``.

Every public op takes ``backend=``: ``"auto"`` (the per-op measured choice of
``dispatch.MODEL_AUTO`` on CUDA tensors, torch otherwise and for the ops not measured on
a GPU yet, RMSNorm and SwiGLU: ``dispatch.choose_backend``),
``"torch"``, ``"triton"`` (on CPU it needs ``TRITON_INTERPRET=1``), or for ``layer_norm``
``"apex"``. Importing this package does not import triton.
"""

from layers.kernels.dispatch import choose_backend, interpreting, use_triton
from layers.kernels.functional import bias_dropout_add, bias_gelu, layer_norm, rms_norm, swiglu
from layers.kernels.modules import LayerNorm, RMSNorm

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "bias_dropout_add",
    "bias_gelu",
    "choose_backend",
    "interpreting",
    "layer_norm",
    "rms_norm",
    "swiglu",
    "use_triton",
]
