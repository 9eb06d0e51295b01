"""The kernel benchmark's cases: every fused op of ``layers.kernels`` at a shape sweep, the
implementations to time beside it (torch eager, torch.compile, Liger-Kernel, apex when
importable), and the check of each kernel against torch and an fp64 reference."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import layers.kernels as K  # imports no triton until a kernel runs
from layers.fused_cross_entropy import fused_vocab_parallel_cross_entropy


@dataclass
class Case:
    """One op at one shape: fresh inputs, implementations, and its minimal traffic in bytes."""

    op: str
    shape: str
    make_inputs: Callable[[], tuple]
    impls: dict[str, Callable]
    bytes: dict[str, int]  # per mode


def _optional(module: str, attr: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return None


def _leaf(*shape, dtype, device, grad=True):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def _traffic(e: int, fwd: int, bwd: int) -> dict[str, int]:
    """Minimal traffic per mode: forward moves ``fwd`` tensors of ``e`` bytes, backward
    ``bwd``, and forward + backward their sum."""
    return {"fwd": fwd * e, "bwd": bwd * e, "fwd+bwd": (fwd + bwd) * e}


def _third_party() -> dict[str, Callable | None]:
    """The other libraries' kernels, each None where it does not import here."""
    liger = "liger_kernel.transformers.functional"
    return {
        "liger_ln": _optional(liger, "liger_layer_norm"),
        "liger_rms": _optional(liger, "liger_rms_norm"),
        "liger_swiglu": _optional(liger, "liger_swiglu"),
        "liger_ce": _optional(liger, "liger_cross_entropy"),
        "apex_ln": _optional("apex.normalization.fused_layer_norm", "fused_layer_norm_affine"),
    }


def _hidden_impls(maybe_compile, extra: dict) -> tuple[dict, ...]:
    """The implementations of the [tokens, hidden] ops: layer norm, bias-GeLU,
    bias-dropout-add, RMSNorm and SwiGLU, in that order."""
    ln = {
        "triton": lambda x, w, b: K.layer_norm(x, w, b, backend="triton"),
        "torch": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
    }
    gelu = {
        "triton": lambda x, b: K.bias_gelu(x, b, backend="triton"),
        "torch": lambda x, b: F.gelu(x + b, approximate="tanh"),
    }
    bda = {
        "triton": lambda x, b, r: K.bias_dropout_add(x, b, r, 0.1, True, backend="triton"),
        "torch": lambda x, b, r: r + F.dropout(x + b, 0.1, True),
    }
    rms = {
        "triton": lambda x, w: K.rms_norm(x, w, 1e-5, backend="triton"),
        "torch": lambda x, w: K.rms_norm(x, w, 1e-5, backend="torch"),
    }
    # SwiGLU's input is the interleaved gate/up projection, 2 x ffn wide; ffn = 4h
    # here (Llama's ffn is ~2.7-3.5h, so these are its ffn widths at h 1.4x larger).
    swi = {
        "triton": lambda gu: K.swiglu(gu, backend="triton"),
        "torch": lambda gu: K.swiglu(gu, backend="torch"),
    }
    for impls in (ln, gelu, bda, rms, swi):
        if maybe_compile:
            impls["compile"] = maybe_compile(impls["torch"])
    liger_ln, liger_rms = extra["liger_ln"], extra["liger_rms"]
    liger_swiglu, apex_ln = extra["liger_swiglu"], extra["apex_ln"]
    if liger_ln:
        ln["liger"] = lambda x, w, b: liger_ln(x, w, b, 1e-5)
    if liger_rms:
        rms["liger"] = lambda x, w: liger_rms(x, w, 1e-5, in_place=False)
    if liger_swiglu:  # separate gate and up: its input is de-interleaved (a copy)
        swi["liger"] = lambda gu: liger_swiglu(gu[..., 0::2], gu[..., 1::2])
    if apex_ln:
        ln["apex"] = lambda x, w, b: apex_ln(x, w, b, x.shape[-1:], 1e-5)
    return ln, gelu, bda, rms, swi


def _hidden_cases(t: int, h: int, size: int, dtype, device, maybe_compile, extra) -> list[Case]:
    """The five [tokens, hidden] ops at one shape."""
    ln, gelu, bda, rms, swi = _hidden_impls(maybe_compile, extra)
    e = t * h * size  # bytes of one [tokens, hidden] activation
    mk = lambda t=t, h=h: (_leaf(t, h, dtype=dtype, device=device),)
    vec = lambda h=h: _leaf(h, dtype=dtype, device=device)
    gate_up = lambda t=t, h=h: (_leaf(t, 8 * h, dtype=dtype, device=device),)
    label = f"tokens={t} hidden={h}"
    rows = (  # op, shape, inputs, implementations, tensors moved forward and backward
        ("layer_norm", label, lambda mk=mk, vec=vec: (*mk(), vec(), vec()), ln, 2, 3),
        ("bias_gelu", label, lambda mk=mk, vec=vec: (*mk(), vec()), gelu, 2, 3),
        ("bias_dropout_add", label, lambda mk=mk, vec=vec: (*mk(), vec(), *mk()), bda, 3, 2),
        # Forward reads x, writes y; backward reads x and dy, writes dx.
        ("rms_norm", label, lambda mk=mk, vec=vec: (*mk(), vec()), rms, 2, 3),
        # f = 4h: forward reads gate/up (8e), writes the product (4e); backward
        # reads gate/up and dy (12e), writes d gate/up (8e).
        ("swiglu", f"tokens={t} ffn={4 * h}", gate_up, swi, 12, 20),
    )
    return [
        Case(op, shape, make, impls, _traffic(e, fwd, bwd))
        for op, shape, make, impls, fwd, bwd in rows
    ]


def _cross_entropy_case(t: int, v: int, size: int, dtype, device, maybe_compile, extra) -> Case:
    """The vocab-parallel cross-entropy over one [tokens, vocab shard] logit shard."""
    e = t * v * size  # bytes of the logit shard; minimal: read it once, write its grad
    ce = {
        "triton": lambda lg, tg: fused_vocab_parallel_cross_entropy(lg, tg, backend="triton"),
        "torch": lambda lg, tg: F.cross_entropy(lg.float(), tg, reduction="none"),
        "torch-vp": lambda lg, tg: fused_vocab_parallel_cross_entropy(lg, tg, backend="torch"),
    }
    if maybe_compile:
        ce["compile"] = maybe_compile(ce["torch"])
    liger_ce = extra["liger_ce"]
    if liger_ce:
        ce["liger"] = lambda lg, tg: liger_ce(lg, tg, reduction="none")
    mk = lambda t=t, v=v: (
        _leaf(t, v, dtype=dtype, device=device),
        torch.randint(0, v, (t,), device=device),
    )
    return Case(
        "cross_entropy",
        f"tokens={t} vocab_shard={v}",
        mk,
        ce,
        {"fwd": 2 * e, "bwd": 2 * e, "fwd+bwd": 2 * e},
    )


def build_cases(tokens_list, hidden_list, vocab_list, dtype, device, compile_torch) -> list[Case]:
    """Every op over the shape sweep, with the implementations available on this machine."""
    size = torch.tensor([], dtype=dtype).element_size()
    maybe_compile = (lambda f: torch.compile(f)) if compile_torch else None
    extra = _third_party()
    common = (size, dtype, device, maybe_compile, extra)
    cases = []
    for t in tokens_list:
        for h in hidden_list:
            cases += _hidden_cases(t, h, *common)
        for v in vocab_list:
            cases.append(_cross_entropy_case(t, v, *common))
    return cases


def _reference_impl(case: Case, name: str) -> Callable:
    """The implementation ``name`` of ``case`` as checked: dropout at p = 0 (the backends
    draw different masks) and the cross-entropy without its fp32 upcast (for fp64)."""
    if case.op == "bias_dropout_add":
        return lambda x, b, r: K.bias_dropout_add(x, b, r, 0.0, True, backend=name)
    if case.op == "cross_entropy" and name == "torch":
        return lambda lg, tg: F.cross_entropy(lg, tg, reduction="none")
    return case.impls[name]


def _outputs_and_grads(case: Case, name: str, widen: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    inputs = case.make_inputs()
    if widen:
        inputs = tuple(
            x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x
            for x in inputs
        )
    out = _reference_impl(case, name)(*inputs)
    leaves = [x for x in inputs if x.requires_grad]
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return [out.detach(), *grads]


def check_against_torch(case: Case) -> float:
    """Max |triton - torch| over output and every gradient, after checking both against an
    fp64 reference on the same inputs: per tensor, the kernel's error must be at most twice
    torch's own error in that dtype plus a floor relative to the tensor's magnitude (one
    ulp of its largest value; 1e-5 of it in fp32). Absolute tolerances cannot judge a bias
    gradient summed over 16384 rows (~1e4, where one bf16 ulp is 64). Raises otherwise."""
    got = _outputs_and_grads(case, "triton", widen=False)
    ref = _outputs_and_grads(case, "torch", widen=False)
    exact = _outputs_and_grads(case, "torch", widen=True)
    for i, (g, r, e) in enumerate(zip(got, ref, exact, strict=True)):
        scale = e.abs().max().item() if e.numel() else 0.0
        floor = (
            1e-5 * max(1.0, scale) if g.dtype == torch.float32 else torch.finfo(g.dtype).eps * scale
        )
        err = (g.double() - e).abs().max().item() if e.numel() else 0.0
        torch_err = (r.double() - e).abs().max().item() if e.numel() else 0.0
        if err > 2 * torch_err + floor:
            what = "output" if i == 0 else f"gradient {i}"
            raise AssertionError(
                f"{case.op} {case.shape} {what}: triton error {err:.3e} vs fp64 exceeds "
                f"2 x torch's {torch_err:.3e} + {floor:.3e}"
            )
    return max(
        (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        for a, b in zip(got, ref, strict=True)
    )
