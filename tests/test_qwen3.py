"""Qwen3 and Qwen3-MoE (engine/models/llama/hf.py, moe_hf.py) against transformers' own
models, and ``model.qk_norm`` (per-head RMSNorm on q and k before RoPE) split over TP.

Tiny random models built here (no hub), saved to a temporary directory; CPU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.hf_interop import config_from_hf, config_to_hf, export_hf, import_hf, read_hf_dir
from engine.models import build_model, family
from studies.verification.hf_parity import _keep_norms_in_float64
from tests.multiproc import run_ranks
from tests.test_context_parallel import _assert_equal_to_unsplit, _step_against_unsplit
from tests.test_moe_hf import COMMON as MOE_COMMON
from tests.test_moe_hf import EAGER

transformers = pytest.importorskip("transformers")

# test_moe_hf's tiny sizes (a prime vocabulary, GQA: 2 KV heads of 4, no tying) with a
# head_dim of its own (4 × 12 = 48 ≠ hidden 32), so a projection or norm sized hidden /
# heads fails to load; without its router-loss keys (Qwen3-MoE: transformers' defaults).
COMMON = {
    **{k: v for k, v in MOE_COMMON.items() if "router" not in k},
    "head_dim": 12,
    "intermediate_size": 40,
}
CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "qwen3": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON)),
        # 4 experts, top-2 not renormalised; mlp_only_layers [0] leaves experts on layer 1
        # alone, every 2nd layer: imported as moe_layer_freq 2 (layer 0 dense, width 40).
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **COMMON,
                moe_intermediate_size=24,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                mlp_only_layers=[0],
            )
        ),
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root, dirs = tmp_path_factory.mktemp("qwen3-hf"), {}
    for name, model in _models().items():
        with torch.no_grad():  # std 0.2 weights; random norms, so a swapped q/k norm shows
            for p in model.parameters():
                p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.2)
        dirs[name] = str(root / name)
        model.save_pretrained(dirs[name])
    return dirs


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_equal_transformers(hf_dirs, name, dtype):
    cfg, state, _ = read_hf_dir(hf_dirs[name])
    assert cfg.qk_norm and cfg.head_dim == 12 and cfg.moe_layer_freq == (2 if "moe" in name else 1)
    model = build_model(replace(cfg, kernels="torch"), dtype=dtype)
    model.load_full_state_dict(state)
    ref = getattr(transformers, CLASSES[name]).from_pretrained(hf_dirs[name], **EAGER)
    ref = ref.to(dtype).eval()
    if dtype == torch.float64:  # HF's RMSNorms round through fp32; keep them at fp64
        # Two layer norms and the q and k norms per layer, and the final norm.
        assert _keep_norms_in_float64(ref) == 4 * cfg.num_layers + 1
    ids = torch.randint(0, cfg.vocab_size, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.eval().logits({"input_ids": ids})["logits"][..., : cfg.vocab_size]
        theirs = ref(input_ids=ids).logits
    # Same routing (both routers' probabilities in fp32), only summation order differs:
    # fp32 ~1e-7 per op on logits of O(1) → 1e-4; fp64 ~1e-16 per op → 1e-12. A missing or
    # misplaced QK norm (after RoPE, over the whole width) moves them by O(0.1).
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    err = (ours - theirs).abs().max().item()
    print(f"{name} {dtype}: max abs logit error {err:.2e}")
    assert err <= tol and theirs.abs().max() > 0.5
    if name == "qwen3":  # the dense count: the QK norms, q and o 48 wide
        params = family("llama").costs.params_count(cfg)
        assert params == sum(t.numel() for t in state.values())


@pytest.mark.parametrize("name", list(CLASSES))
def test_export_then_import_is_bitwise(hf_dirs, name, tmp_path):
    hf_dir = hf_dirs[name]
    import_hf(hf_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    before = load_file(str(Path(hf_dir) / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert before.keys() == after.keys() and any(".q_norm." in k for k in before)
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    # transformers reads the export as the class it saved, with the same config: the
    # MoE's mlp_only_layers [0] comes back as decoder_sparse_step 2, the same layers.
    loaded = getattr(transformers, CLASSES[name]).from_pretrained(tmp_path / "hf", **EAGER)
    exported, original = (
        transformers.AutoConfig.from_pretrained(d).to_dict() for d in (tmp_path / "hf", hf_dir)
    )
    for config in (exported, original):
        config.pop("_name_or_path")
    if name == "qwen3_moe":
        original.update(decoder_sparse_step=2, mlp_only_layers=[])
        assert type(loaded.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
    assert exported == original


@pytest.mark.slow
def test_qk_norm_at_tp2_equals_the_unsplit_model():
    """tp 2 (2 ranks), fp64, the trainer's gradient path (``finish_grads`` sums the QK
    norms' partial gradients over TP): loss, every gradient and the weights after one AdamW
    step within 1e-10 of the unsplit model, without and with sequence parallelism. Each
    rank normalizes 2 of the 4 heads, so an unsummed q_norm gradient is off by
    O(1e-3) (seen: 1.2e-3)."""
    for sequence_parallel in (False, True):
        per_rank = run_ranks(_step_against_unsplit, 2, "qwen3", 2, sequence_parallel)
        worst = _assert_equal_to_unsplit(per_rank)
        print(f"qk_norm tp2 sp={sequence_parallel}: max |error| {worst:.1e}")


def _config(hf_dirs, name: str) -> dict:
    return json.loads(Path(hf_dirs[name], "config.json").read_text())


def test_unsupported_configs_are_one_line(hf_dirs):
    dense, moe = _config(hf_dirs, "qwen3"), _config(hf_dirs, "qwen3_moe")
    for config, message in (
        ({**dense, "attention_bias": True}, "attention_bias true is not supported for qwen3"),
        # Layer 1 dense leaves experts on layer 0 alone: no k has every k-th layer so.
        ({**moe, "mlp_only_layers": [1]}, r"leaves experts on layers \[0\]"),
        ({**moe, "num_experts": 8}, "the two expert counts disagree"),  # beside 4 local
    ):
        with pytest.raises(ValueError, match=message) as err:
            config_from_hf(config)
        assert "\n" not in str(err.value)


def test_exports_refuse_what_qwen3_does_not_compute(hf_dirs):
    cfg = config_from_hf(_config(hf_dirs, "qwen3"))
    moe = config_from_hf(_config(hf_dirs, "qwen3_moe"))
    for config, message in (
        (replace(cfg, qkv_bias=True), "exports as Qwen3, which has no biases"),
        (replace(cfg, qk_norm=False), "qwen3 normalizes q and k; set it true"),
        (replace(moe, moe_shared_ffn_hidden_size=8), "Qwen3-MoE, which has no shared expert"),
    ):
        with pytest.raises(ValueError, match=message):
            config_to_hf(config, _config(hf_dirs, "qwen3"))
    # Without an original, the hub's spelling of the expert count.
    assert config_to_hf(moe)["num_experts"] == 4 and config_to_hf(cfg)["head_dim"] == 12
