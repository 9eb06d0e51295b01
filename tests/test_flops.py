"""engine/flops.py against an independent count: torch's FlopCounterMode on real models.

FlopCounterMode counts every matmul op dispatched (mm, addmm, bmm, ...) at 2 FLOPs per
multiply-accumulate, exactly as the formulas do, and likewise ignores bias adds,
LayerNorm, softmax, GeLU, dropout and embedding lookups. So the counts must agree exactly
(integers, tolerance 0), provided that:

- attention runs on SDPA's math backend. On CPU the default backend is
  ``_scaled_dot_product_flash_attention_for_cpu``, for which torch 2.13 registers no FLOP
  formula (it counts 0); the math backend decomposes into bmm's that it does count: QKᵀ
  and scores·V forward, 4 bmm's backward, i.e. the formula's 3× forward. (On CUDA the
  flash/efficient formulas count 5 bmm's backward, one more than a model FLOP, because
  those kernels recompute the scores.)
- the formula is given the vocabulary the LM head really multiplies by: the padded one.
  The configs below use vocab_size=200, padded to 256, so a formula fed the unpadded
  vocabulary would be off by 2·3·B·s·h·56 and fail.
- with full recomputation, the formula (its 96) counts one whole extra forward of
  every layer. torch's non-reentrant checkpoint stops recomputing as soon as the last
  tensor saved for backward is regenerated. A pre-LN (GPT) layer ends with fc2 and a
  residual add that saves nothing, so its fc2 forward is not redone: the hardware does
  2·B·s·f·h·l fewer FLOPs, added back explicitly below. A post-LN (BERT) layer ends with
  a LayerNorm that saves its input, so there everything is recomputed.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from engine import flops
from engine.models import BertModel, GPTModel, ModelConfig

B, S, L, H, V = 2, 32, 2, 64, 200  # V pads to 256: the test must account for it


def _cfg(arch: str, **overrides) -> ModelConfig:
    values = dict(
        arch=arch,
        vocab_size=V,
        hidden_size=H,
        num_layers=L,
        num_heads=4,
        max_positions=S,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return ModelConfig(**{**values, **overrides})


def _skipped_by_checkpoint(cfg: ModelConfig) -> int:
    """The fc2 forward per layer that torch's checkpoint does not recompute (see above)."""
    if cfg.recompute != "full" or not cfg.pre_layernorm:
        return 0
    return 2 * B * S * cfg.ffn_size * cfg.hidden_size * cfg.num_layers


def _count(step) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def _gpt_step(model: GPTModel):
    ids = torch.randint(0, V, (B, S))
    return lambda: model(ids, labels=torch.roll(ids, -1, dims=1)).mean().backward()


def _bert_step(model: BertModel):
    ids = torch.randint(0, V, (B, S))
    types = (torch.arange(S) >= S // 2).long().expand(B, S)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 5 :] = 0  # padding in one sequence: the kernel still computes every score
    labels = torch.full((B, S), -100).masked_scatter_(torch.rand(B, S) < 0.15, ids)
    sop = torch.tensor([0, 1])
    return lambda: model(ids, types, mask, labels, sop)["loss"].backward()


@pytest.mark.parametrize("recompute,ffn", [("none", None), ("full", 96)])
def test_gpt_flops_match_flop_counter(recompute, ffn):
    cfg = _cfg("gpt", recompute=recompute, ffn_hidden_size=ffn)
    model = GPTModel(cfg)
    assert cfg.padded_vocab_size(1) == 256
    counted = _count(_gpt_step(model)) + _skipped_by_checkpoint(cfg)
    expected = flops.gpt_flops_per_iteration(
        B, S, L, H, cfg.padded_vocab_size(1), recompute=recompute == "full", ffn_hidden=ffn
    )
    assert counted == expected, f"FlopCounterMode {counted} vs formula {expected}"
    assert flops.model_flops(cfg, B, S, recompute=recompute == "full") == expected


@pytest.mark.parametrize("recompute,ffn", [("none", None), ("full", 96)])
def test_bert_flops_match_flop_counter(recompute, ffn):
    cfg = _cfg("bert", recompute=recompute, ffn_hidden_size=ffn)
    model = BertModel(cfg)
    counted = _count(_bert_step(model)) + _skipped_by_checkpoint(cfg)
    expected = flops.bert_flops_per_iteration(
        B, S, L, H, cfg.padded_vocab_size(1), recompute=recompute == "full", ffn_hidden=ffn
    )
    assert counted == expected, f"FlopCounterMode {counted} vs formula {expected}"
    assert flops.model_flops(cfg, B, S, recompute=recompute == "full") == expected


@pytest.mark.parametrize("b,s,n,h,v", [(1, 7, 1, 32, 97), (8, 2048, 24, 2048, 50304)])
def test_closed_forms_of_reference(b, s, n, h, v):
    # The model-FLOPs formula 72·B·s·n·h²·(1 + s/(6h) + V/(12·n·h)) (n = layers), evaluated in floats; rel 1e-12 is float rounding of a ~1e16 count.
    ref = 72 * b * s * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    ref_recompute = 96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))
    bert = 72 * b * s * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h) + 1 / (12 * n))
    bert += 6 * b * h**2 + 12 * b * h
    for got, want in (
        (flops.gpt_flops_per_iteration(b, s, n, h, v), ref),
        (flops.gpt_flops_per_iteration(b, s, n, h, v, recompute=True), ref_recompute),
        (flops.bert_flops_per_iteration(b, s, n, h, v), bert),
    ):
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg("gpt"),
        _cfg("gpt", tie_embeddings=False, ffn_hidden_size=96),
        _cfg("bert"),
        _cfg("bert", tie_embeddings=False, num_token_types=3),
    ],
    ids=["gpt", "gpt-untied-ffn96", "bert", "bert-untied-3types"],
)
def test_params_count_is_exact(cfg):
    model = GPTModel(cfg) if cfg.arch == "gpt" else BertModel(cfg)
    actual = sum(t.numel() for t in model.full_state_dict().values())
    assert flops.params_count(cfg) == actual


def test_params_count_matches_reference_approximation():
    # That formula omits the final LayerNorm (2h); everything else is exact for GPT-2 small.
    cfg = ModelConfig()
    n, h, v, s = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.max_positions
    ref = 12 * n * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * n * h))
    assert flops.params_count(cfg) - 2 * h == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_no_peak_on_cpu(device):
    assert flops.peak_flops(device) is None
    assert flops.mfu(1e12, flops.peak_flops(device), 1) is None


@pytest.mark.parametrize(
    "name,peak",
    [
        ("Tesla V100-SXM2-32GB", 125e12),
        ("Tesla V100-PCIE-16GB", None),  # a lower peak that the table does not list
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table(name, peak):
    assert flops.peak_flops_for_name(name) == peak
    assert flops.peak_flops_for_name(name, torch.float32) is None  # only bf16/fp16 peaks


def test_mfu():
    assert flops.mfu(989e12, 989e12, 8) == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match="num_gpus"):
        flops.mfu(1.0, 1.0, 0)
