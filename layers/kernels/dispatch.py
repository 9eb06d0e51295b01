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

# The kernel choices: the functional ops' ``backend=`` and ``model.kernels`` alike (the one list).
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


def auto_fused(op: str, x: torch.Tensor) -> bool:
    """Whether ``MODEL_AUTO`` picks the fused kernel for ``op`` on ``x`` (CUDA tensors only)."""
    smallest = MODEL_AUTO[op]
    return x.is_cuda and smallest is not None and x.dim() > 0 and x.shape[-1] >= smallest


def choose_backend(op: str, x: torch.Tensor, backend: str = "auto") -> str:
    """The backend that runs ``op`` (a key of ``MODEL_AUTO``) on ``x``: "triton", "torch"
    or "apex". The one "auto" rule, for the functional ops and a model's kernel set alike.

    ``"auto"``: "triton" where ``MODEL_AUTO`` measured the fused kernel faster than torch
    at ``x``'s last dimension and it runs compiled on ``x`` (a CUDA tensor of a kernel dtype, triton installed);
    "torch" otherwise. The interpreter is for tests: they ask for ``"triton"``.
    ``"triton"`` raises when it cannot run on ``x``; ``"apex"`` exists for layer_norm only.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if op != "layer_norm":
        reject_apex(backend, op)
    if backend == "auto":
        return "triton" if auto_fused(op, x) and use_triton(x, "auto") else "torch"
    if backend == "triton":
        use_triton(x, "triton")  # raises, naming the fix, when it cannot run
    return backend


# What ``backend="auto"`` (and ``model.kernels=auto``) runs on CUDA tensors, per op: the
# fused kernel when the tensor's last dimension is at least this size, torch below it
# (None: never). Measured on an H100, 2026-11-23 (bf16; docs/BENCHMARKS.md):
# - per op (16384 tokens, h 1024/2048/4096, fwd+bwd GPU time from the profiler, gradient
#   accumulation included), each fused kernel is below torch eager or within 3 %: LayerNorm
#   0.20/0.29/0.45 ms vs 0.19/0.29/0.56, bias-GeLU 0.13/0.24/0.45 vs 0.17/0.31/0.59,
#   bias-dropout-add 0.23/0.43/0.81 vs 0.24/0.46/0.88; but each call costs more host time
#   (0.5-0.9 ms vs 0.2-0.35 ms, Triton's launch path), which a step pays where its GEMMs
#   are too short to hide it;
# - in the model: GPT 1.3B (h 2048, ffn 8192) steps in 191.4 ms with the fused kernels and
#   209.0 ms with torch's; GPT 350M (h 1024, ffn 4096) in 95.1 ms with them and 82.2 ms
#   without. So the element-wise kernels start at h 2048 (bias-GeLU's input is the 4h-wide
#   MLP activation: 8192). The fused cross-entropy was level with torch.compile at
#   V = 50304 and used 1 MB where F.cross_entropy took 9.4 GB: always.
# The Llama family's kernels, measured on an H200, 2026-11-26 and again 2026-11-27
# (tools/gpu_check.py, bf16, 16384 tokens, fwd+bwd do_bench medians; docs/BENCHMARKS.md,
# GPU check): RMSNorm at h 2048 0.309 and 0.293 ms against torch's 1.416 and 1.419 (4.58x
# and 4.85x; 1.41x and 1.24x torch.compile's), SwiGLU at ffn 8192 (its input, the
# interleaved gate/up, 16384 wide) 1.005 and 1.006 ms against 3.053 (3.04x; 0.68x
# compile's). So both run fused from the widths measured; narrower ones keep torch until a
# run measures them. The same runs timed LayerNorm, bias-GeLU and bias-dropout-add at h
# 2048 alone at 0.31/0.30x, 0.32/0.53x and 0.83/0.46x eager (host-bound launches, as on
# the H100): their thresholds stay with the in-model H100 measurement above, which
# gpu_check's kernels_1.3b item re-measured on the H200, 2026-11-27 at 147bf0f: an eager
# GPT 1.3B step in 171.5 ms with this table against 189.3 ms with kernels=torch (1.10x;
# the H100's 1.09x). The same run timed RMSNorm alone at 0.746 ms (1.90x eager, 0.78x
# compile's), its launches host-bound on that machine: no change to the table. The H200
# window of 2026-11-28 (1bfd923) timed the six alone again: SwiGLU 3.04x, cross-entropy
# 4.23x, RMSNorm 1.83x eager, LayerNorm, bias-GeLU and bias-dropout-add 0.28-0.46x (all
# four norms and element-wise kernels 0.67-0.78 ms, the same host floor): no change.
MODEL_AUTO: dict[str, int | None] = {
    "layer_norm": 2048,
    "bias_gelu": 8192,
    "bias_dropout_add": 2048,
    "cross_entropy": 0,
    "rms_norm": 2048,
    "swiglu": 16384,
}
