"""Model FLOPs per iteration, parameter counts, GPU peak FLOP/s and MFU (formulas stated in docs/PERFMODEL.md).

FLOPs count matrix multiplications only, 2 per multiply-accumulate. Per transformer layer
and per token, the forward pass multiplies by the QKV (h×3h), output (h×h), fc1 (h×f) and
fc2 (f×h) weights, and forms QKᵀ and attention·V against all s positions::

    per-layer forward = 2·B·s·(3h² + h² + 2·h·f) + 2·2·B·s²·h      (f = ffn width, 4h by default)
                      = 24·B·s·h² + 4·B·s²·h                      (f = 4h)

Backward costs twice the forward (one matmul for the input gradient, one for the weight
gradient), so forward + backward is 3× the forward; full activation recomputation runs
the layers' forward once more (4×), but not the LM head's. The LM head adds 2·B·s·h·V
forward. Summed over l layers this is exactly the usual model-FLOPs formula
F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)), or 96 and V/(16·l·h) with recomputation.

Attention FLOPs count all s×s scores, causal or not: a kernel that skips masked blocks does
less work, but model FLOPs (and so MFU) are defined on the dense count. Bias adds,
LayerNorm, softmax, GeLU, dropout and embedding lookups are not matmuls and are not counted.

A mixture-of-experts layer (``model.mlp=moe``) counts its active parameters in place of the
dense MLP: per token the router (h×E), the top-k experts' MLPs and any shared expert and its
gate (``engine.formulas.moe_mlp_forward_flops``, applied in ``engine.models.cost_terms``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.formulas import (  # noqa: F401  (public API of this module)
    bert_flops_per_iteration,
    gpt_flops_per_iteration,
)
from engine.models.config import ModelConfig
from engine.models.families import family

if TYPE_CHECKING:
    from engine.config import Config

# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets (SXM parts). Matched as case-insensitive
# substrings of the CUDA device name, first match wins. The PCIe/NVL variants of the
# same chips have lower, different peaks that this table does not list: they map to None
# (no MFU printed) rather than to the SXM figure (a wrong MFU).
PEAK_FLOPS_BF16: tuple[tuple[str, float | None], ...] = (
    ("V100-PCIE", None),
    ("H100 PCIE", None),
    ("H100 NVL", None),
    ("H200 NVL", None),
    ("V100", 125e12),
    ("A100", 312e12),  # 40GB and 80GB, SXM and PCIe share this peak
    ("H100", 989e12),
    ("H200", 989e12),
)
_PEAK_DTYPES = (torch.bfloat16, torch.float16)


def model_flops(
    cfg: ModelConfig, batch: int, seq: int, *, tp_size: int = 1, recompute: bool = False
) -> int:
    """Forward + backward FLOPs of ``cfg`` on ``batch`` sequences, with the padded vocabulary
    (the family's formula: ``engine/models/<arch>/costs.py``).

    ``batch`` is the global batch for a whole step (all DP ranks); ``tp_size`` only sets the
    vocabulary padding. Model FLOPs for MFU leave ``recompute`` False (recomputation is not model work).
    """
    vocab = cfg.padded_vocab_size(tp_size)
    return family(cfg.arch).costs.model_flops(cfg, batch, seq, vocab=vocab, recompute=recompute)


def model_flops_per_step(cfg: Config) -> int:
    """Model FLOPs of one optimizer step of a training run (global batch × data.seq_len)."""
    return model_flops(cfg.model, cfg.trainer.global_batch, cfg.data.seq_len, tp_size=cfg.tp_size)


def params_count(cfg: ModelConfig) -> int:
    """Parameters of the full model, unpadded vocabulary (what ``full_state_dict`` holds),
    by the family's count (``engine/models/<arch>/costs.py``)."""
    return family(cfg.arch).costs.params_count(cfg)


def peak_flops_for_name(name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of the GPU called ``name`` at ``dtype``; None when not in the table.

    Only bf16/fp16 peaks are tabulated: fp32 or TF32 training gets None, not a wrong MFU.
    """
    if dtype not in _PEAK_DTYPES:
        return None
    upper = name.upper()
    for key, peak in PEAK_FLOPS_BF16:
        if key.upper() in upper:
            return peak
    return None


def peak_flops(
    device: torch.device | str | int | None, dtype: torch.dtype = torch.bfloat16
) -> float | None:
    """Dense peak FLOP/s of ``device`` at ``dtype``, or None on CPU and unknown devices.

    None means "print no MFU": a CPU has no entry because its peak depends on the part,
    the core count and the vector units, none of which torch reports.
    """
    if device is None:
        return None
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype)


def mfu(model_flops_per_s: float, peak: float | None, num_gpus: int) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s ÷ (peak × GPUs); None without a peak."""
    if peak is None or peak <= 0:
        return None
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} must be >= 1")
    return model_flops_per_s / (peak * num_gpus)
