"""Choosing between the Triton kernels and their torch references, without importing triton.

Triton is imported only when a Triton path actually runs (see ``use_triton``), so a CPU
machine that never asks for the kernels never imports it. That matters for the
interpreter: triton reads ``TRITON_INTERPRET`` once, when it is first imported, to decide
whether ``@triton.jit`` builds compiled kernels or interpreted ones.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton", "apex")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter (kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether a Triton kernel can run on ``x`` (what ``choose_backend`` asks).

    ``"auto"``: whether it can, without raising: a CUDA tensor, or a CPU tensor under
    ``TRITON_INTERPRET=1`` (the interpreter), triton installed and a kernel dtype (fp32,
    bf16, fp16). ``"triton"``: True, or an error saying why it cannot run. ``"torch"`` and
    ``"apex"``: False.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("torch", "apex"):
        return False
    runnable = (x.is_cuda or interpreting()) and _triton_available()
    if backend == "auto":
        return runnable and x.dtype in KERNEL_DTYPES
    if not runnable:
        raise RuntimeError(
            f"backend='triton' needs triton and a CUDA tensor, or TRITON_INTERPRET=1 in the "
            f"environment to interpret the kernels on CPU; got a {x.device.type} tensor"
            + ("" if _triton_available() else " and triton is not installed")
        )
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"the Triton kernels take fp32, bf16 or fp16 tensors, got {x.dtype}; "
            "use backend='torch' (or 'auto', which falls back to torch)"
        )
    return True


def reject_apex(backend: str, op: str) -> None:
    """Raise for ``backend='apex'`` on an op apex has no fused kernel for here."""
    if backend == "apex":
        raise ValueError(f"backend='apex' is only available for layer_norm, not {op}")


def choose_backend(op: str, x: torch.Tensor, backend: str = "auto") -> str:
    """The backend that runs ``op`` (a key of ``MODEL_AUTO``) on ``x``: "triton", "torch"
    or "apex". The one "auto" rule, for the functional ops and a model's kernel set alike.

    ``"auto"``: "triton" where ``MODEL_AUTO`` measured the fused kernel faster than torch
    and it runs compiled on ``x`` (a CUDA tensor of a kernel dtype, triton installed);
    "torch" otherwise. The interpreter is for tests: they ask for ``"triton"``.
    ``"triton"`` raises when it cannot run on ``x``; ``"apex"`` exists for layer_norm only.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if op != "layer_norm":
        reject_apex(backend, op)
    if backend == "auto":
        fast = MODEL_AUTO[op] == "triton" and x.is_cuda
        return "triton" if fast and use_triton(x, "auto") else "torch"
    if backend == "triton":
        use_triton(x, "triton")  # raises, naming the fix, when it cannot run
    return backend


# What ``backend="auto"`` (and ``model.kernels=auto``) runs on CUDA tensors, per op:
# "triton" (the fused kernel) or "torch". From the issue-16 report's H100 measurements (its reporter's, bf16, 16384
# tokens, fwd+bwd against torch eager): LayerNorm 0.52x (h 2048) and 0.67x (h 4096),
# bias-GeLU 0.48x, bias-dropout-add 0.51x, so those stay on torch; the fused cross-entropy
# was 4.4x faster than eager with 1 MB instead of 9.4 GB peak, so it is used. Re-measure
# with tools/bench_kernels.py on the target GPU and update this table (docs/BENCHMARKS.md).
MODEL_AUTO: dict[str, str] = {
    "layer_norm": "torch",
    "bias_gelu": "torch",
    "bias_dropout_add": "torch",
    "cross_entropy": "triton",
}
