"""Logits parity with Hugging Face transformers: a local directory of any family loaded by
transformers against meshtron's import of it (engine/hf_interop.py) at a parallel layout.

Only local ``save_pretrained`` directories are read; nothing is fetched.
"""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import replace
from pathlib import Path

import torch

import parallel_state
from engine.hf_interop import (
    config_from_hf,
    hf_architectures,
    hf_weight_files,
    read_hf_config,
    read_hf_dir,
)
from engine.models import build_model
from engine.models.families import FAMILIES
from layers.mappings import gather_along
from layers.moe import MoEMLP
from layers.norm import NORMS as NORM_CLASSES
from layers.ring_attention import unshard_from_cp
from studies.verification.layouts import DTYPES, Report, VerifySpec, compare, dp_slice, make_batch

# Tolerances on logits against Hugging Face. float32 and float64 are absolute: a
# different summation order (and GeLU-tanh spelled differently) costs ~1e-7 relative per op,
# far below 1e-4 on logits of order 1-10 (observed 3e-7); float64 likewise below 1e-8.
# bfloat16 is relative to max |logit|, since its absolute spacing grows with the logits
# (0.5 at 100): 8 mantissa bits, rounded differently by each implementation in every op,
# give about 1e-2 (observed 0.9% on 4-layer tiny models).
HF_TOLERANCES = {"float64": 1e-8, "float32": 1e-4, "bfloat16": 3e-2}

# transformers' Llama, Mistral and Qwen2 RMSNorm round their input through float32 (then
# back), so a float64 reference would be float32-accurate (~1e-7) at those norms, and every
# directory of theirs would miss the float64 bar. At float64 the reference's norm modules,
# and only those, get a forward that computes the same formula at the input precision (a
# per-instance patch of the loaded model; the class stays as it was), so that float64
# proves the conversion. The verifier says so in its output (hf_reference_note).
_RMSNORMS = {
    name.removesuffix("ForCausalLM") + "RMSNorm"
    for arch in FAMILIES
    for name in hf_architectures(arch)
}


def _rmsnorm_at_input_precision(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm forward without its float32 round trip."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _offset_rmsnorm_at_input_precision(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The same for a norm scaled by ``1 + weight`` (a norm class whose ``scale_offset``
    is 1, ``layers.norm``)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    normed = hidden_states * torch.rsqrt(variance + self.eps)
    return normed * (1.0 + self.weight)


def _keep_norms_in_float64(model: torch.nn.Module, norm: str = "rmsnorm") -> int:
    """Patch the RMSNorm modules of a float64 reference (see ``_RMSNORMS``) with the
    formula of meshtron's ``norm`` (the config's: scaled by the weight, or by 1 + it where
    its class's ``scale_offset`` says so); returns how many."""
    offset = NORM_CLASSES[norm].scale_offset == 1.0
    forward = _offset_rmsnorm_at_input_precision if offset else _rmsnorm_at_input_precision
    norms = [m for m in model.modules() if type(m).__name__ in _RMSNORMS]
    for module in norms:
        module.forward = types.MethodType(forward, module)
    return len(norms)


@contextlib.contextmanager
def _softmax_at_input_precision():
    """While a float64 reference runs: ``F.softmax(x, dtype=torch.float32)`` of a float64
    ``x`` stays float64. transformers' eager attention (Gemma 2's: SDPA has no soft cap)
    asks for float32 probabilities, which would make a float64 reference float32-accurate
    (~1e-7) there, as its RMSNorm would (``_RMSNORMS``)."""
    softmax = torch.nn.functional.softmax

    def wide(x, *args, dtype=None, **kwargs):
        if dtype == torch.float32 and x.dtype == torch.float64:
            dtype = None
        return softmax(x, *args, dtype=dtype, **kwargs)

    torch.nn.functional.softmax = wide
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax


def hf_reference_note(spec: VerifySpec, hf_dir: str | os.PathLike) -> str:
    """One line saying what the transformers reference computes in (for the CLI output)."""
    cfg = config_from_hf(read_hf_config(hf_dir))
    if spec.dtype == "float64" and cfg.norm != "layernorm":
        return (
            "reference: transformers in float64, its RMSNorm computed in float64 "
            "(transformers' own rounds through float32; so is an eager attention's softmax"
            + (", not its routers'" if cfg.mlp == "moe" else "")
            + ")"
        )
    return f"reference: transformers in {spec.dtype}"


def check_hf_layout(spec: VerifySpec, hf_dir: str | os.PathLike) -> VerifySpec:
    """Raise ValueError (or OSError) if :func:`compare_with_hf` cannot run ``hf_dir``'s model
    at ``spec``'s layout: heads, hidden, FFN and batch against TP and DP, experts against
    ep (carved from dp), before any launch. Returns ``spec`` with the directory's family
    and expert count (what the layout checks and the mesh are built from)."""
    cfg = config_from_hf(read_hf_config(hf_dir))
    experts = cfg.moe_num_experts if cfg.mlp == "moe" else 0
    if spec.ep_size > 1 and not experts:
        raise ValueError(
            f"--ep-size {spec.ep_size} splits the experts of an MoE model; {hf_dir} holds a "
            f"dense {cfg.arch}: set --ep-size 1"
        )
    spec = replace(spec, model=cfg.arch, experts=experts)
    replace(spec, seq_len=min(spec.seq_len, cfg.max_positions)).check(cfg)
    missing = [f for f in hf_weight_files(hf_dir) if not (Path(hf_dir) / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{hf_dir}: the weights index names missing files {missing[:3]}")
    return spec


def compare_with_hf(spec: VerifySpec, hf_dir: str) -> Report | None:
    """Logits of ``hf_dir`` loaded by transformers vs meshtron's import of it at ``spec``'s
    layout, on a fixed random batch (BERT: MLM and seq-relationship logits), within
    ``HF_TOLERANCES``; the Report on global rank 0, None elsewhere. Under ep > 1 each rank
    keeps its ep group's share of the experts and routes its own DP slice, as in training."""
    ps, dtype = parallel_state.get(), DTYPES[spec.dtype]
    cfg, state, hf_config = read_hf_dir(hf_dir, tp_group=ps.tp_group)
    cfg = replace(cfg, sequence_parallel=spec.sequence_parallel, recompute=spec.recompute)
    if spec.compile:  # meshtron's side compiled (--compile), transformers' eager
        cfg = replace(cfg, compile=True, compile_backend=spec.compile)
    model = build_model(cfg, ps, dtype=dtype)
    model.load_full_state_dict(state)
    spec = replace(spec, model=cfg.arch, vocab_size=cfg.vocab_size)
    batch = make_batch(replace(spec, seq_len=min(spec.seq_len, cfg.max_positions)))
    local, cp = dp_slice(batch, ps), ps.size("cp")
    if cp > 1:  # this rank's part of every sequence, as training cuts it (global positions)
        local = model.context_shard(local, cp, ps.rank_in("cp"))
    with torch.no_grad():
        ours = model.eval().logits(local)
    full = {}
    for name, logits in ours.items():  # [b, s(/cp), V/tp] vocab-sharded, or [b, 2] replicated
        logits = gather_along(logits, -1 if logits.dim() == 3 else None, ps.tp_group)
        if cp > 1 and logits.dim() == 3:  # the cp ranks' parts back in sequence order
            parts = gather_along(logits, 1, ps.group("cp")).chunk(cp, dim=1)
            logits = unshard_from_cp(parts, dim=1)
        full[name] = gather_along(logits, 0, ps.dp_group)[..., : cfg.vocab_size]
    if ps.rank != 0:
        return None
    theirs = _hf_logits(hf_dir, cfg, hf_config, batch, dtype)
    tol, absolute = HF_TOLERANCES[spec.dtype], spec.dtype != "bfloat16"
    rows = [compare("logits", n, full[n], theirs[n], tol, absolute=absolute) for n in full]
    return Report(spec, tol, rows, absolute=absolute, notes=_expert_note(model, ps))


def _expert_note(model: torch.nn.Module, ps) -> list[str]:
    """One line saying how many of each MoE layer's experts rank 0 held (none: dense)."""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    if not layers:
        return []
    held, total = layers[0].experts.fc1.shape[0], layers[0].num_experts
    return [f"experts: {held} of {total} per MoE layer on each rank (ep={ps.size('expert')})"]


def _hf_logits(hf_dir: str, cfg, hf_config: dict, batch: dict, dtype) -> dict[str, torch.Tensor]:
    import transformers

    arch = (hf_config.get("architectures") or ["?"])[0]
    known = hf_architectures(cfg.arch)
    if arch not in known:
        raise ValueError(
            f"{hf_dir}: architecture {arch!r}; a {cfg.arch} directory compares one of {known}"
        )
    # An MoE model's experts as transformers' per-expert loop: its grouped_mm default takes
    # no float64.
    eager = {"experts_implementation": "eager"} if cfg.mlp == "moe" else {}
    model = getattr(transformers, arch).from_pretrained(hf_dir, local_files_only=True, **eager)
    model = model.to(dtype).eval()
    widen = contextlib.nullcontext()
    if dtype == torch.float64:
        _keep_norms_in_float64(model, cfg.norm)
        # Not under experts: Qwen-MoE routers ask for float32 probabilities too, as ours
        # compute them (moe_router_dtype fp32); widened, the routing weights would differ
        # by ~1e-7 (Mixtral's router casts with .float(), which the widening never saw).
        if cfg.mlp != "moe":
            widen = _softmax_at_input_precision()
    with torch.no_grad(), widen:
        if cfg.causal:  # a decoder's LM logits
            return {"logits": model(input_ids=batch["input_ids"]).logits}
        out = model(
            input_ids=batch["input_ids"],
            token_type_ids=batch["token_type_ids"],
            attention_mask=batch["attention_mask"],
        )
    return {"mlm_logits": out.prediction_logits, "sop_logits": out.seq_relationship_logits}
