"""Mixtral and Qwen2-MoE (engine/models/llama/moe_hf.py) against transformers' own models:
logits in fp32 and fp64, bitwise HF round trips (the per-expert tensors save_pretrained
writes, and the fused ones its modules hold), the load-balancing loss, one-line refusals.

Tiny random models built here (no hub), saved to a temporary directory; CPU, one process.
"""

from __future__ import annotations

import json
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.hf_interop import (
    config_from_hf,
    config_to_hf,
    export_hf,
    import_hf,
    read_hf_dir,
    write_hf_dir,
)
from engine.hf_interop import state_from_hf as hf_state_from_hf
from engine.models import build_model, preset
from layers.moe import moe_losses
from layers.router import pooled_load_balancing_loss
from studies.verification.hf_parity import _keep_norms_in_float64
from tests.tiny_configs import HF_GQA_UNTIED, hf_tiny
from tests.verify_util import logit_error, verify_in_one_launch

transformers = pytest.importorskip("transformers")

DEVICE = torch.device("cpu")
# transformers' per-expert loop (its grouped_mm default takes no fp64), the reference.
EAGER = dict(experts_implementation="eager")
# Awkward on purpose: a prime vocabulary, GQA (2 KV heads of 4), expert width not 4h.
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.02)
COMMON = hf_tiny(hidden_size=32, rms_norm_eps=1e-6, **HF_GQA_UNTIED, **ROUTER)


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    widths = dict(
        intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=20
    )
    routing = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)  # Qwen2-MoE's
    return {
        # 4 experts, top-2 renormalised, on both layers.
        "mixtral": transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
            )
        ),
        # Experts on layer 1 only (decoder_sparse_step 2; layer 0 dense, width 40), top-2
        # not renormalised, a gated shared expert of width 20, QKV biases.
        "qwen2_moe": transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(**COMMON, **widths, **routing, decoder_sparse_step=2)
        ),
    }


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    root, out = tmp_path_factory.mktemp("moe-hf"), {}
    for name, model in _models().items():
        with torch.no_grad():  # std 0.2 weights: routing varies by token; random norms
            for param_name, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if param_name.endswith("weight") else 0.0, 0.1)
                else:
                    p.normal_(0.0, 0.2)
        # Mixtral saved in shards, so an expert's tensors may sit in different files.
        model.save_pretrained(
            root / name, **({"max_shard_size": "20KB"} if name == "mixtral" else {})
        )
        out[name] = (str(root / name), model)
    return out


def _ours(hf_dir: str, dtype: torch.dtype, **overrides):
    cfg, state, _ = read_hf_dir(hf_dir)
    model = build_model(replace(cfg, kernels="torch", **overrides), dtype=dtype, device=DEVICE)
    model.load_full_state_dict(state)
    return model.eval(), cfg


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 19), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_equal_transformers(hf_models, name, dtype):
    hf_dir, _ = hf_models[name]
    model, cfg = _ours(hf_dir, dtype)
    ids = _ids(cfg.vocab_size)
    ref = getattr(transformers, model_class(name)).from_pretrained(hf_dir, **EAGER)
    ref = ref.to(dtype).eval()
    if dtype == torch.float64:  # HF's RMSNorm rounds through fp32; keep it at fp64
        assert _keep_norms_in_float64(ref) == 2 * cfg.num_layers + 1
    with torch.no_grad():
        ours = model.logits({"input_ids": ids})["logits"][..., : cfg.vocab_size]
        theirs = ref(input_ids=ids).logits
    # Both routers round the probabilities to fp32 (transformers' softmax takes
    # dtype=torch.float; ours at moe_router_dtype=fp32), so routing and weights agree and
    # only summation order differs: fp32 ~1e-7 per op on logits of O(1) → 1e-4; fp64
    # ~1e-16 per op → 1e-10. A misplaced expert or gate/up swap moves them by O(0.1).
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    err = (ours - theirs).abs().max().item()
    print(f"{name} {dtype}: max abs logit error {err:.2e}")
    assert err <= tol and theirs.abs().max() > 0.1


def model_class(name: str) -> str:
    return {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[name]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_export_then_import_is_bitwise(hf_models, name, tmp_path):
    hf_dir, module = hf_models[name]
    import_hf(hf_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    before = {}
    for shard in Path(hf_dir).glob("*.safetensors"):
        before.update(load_file(str(shard)))
    assert (name == "mixtral") == (Path(hf_dir) / "model.safetensors.index.json").is_file()
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert before.keys() == after.keys()  # save_pretrained's per-expert names
    assert any(".experts.3." in key for key in before)
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    original = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    for config in (exported, original):
        config.pop("_name_or_path")
    assert exported == original
    # Our state back from the export, and from transformers' in-memory (fused) tensors.
    cfg, state, _ = read_hf_dir(hf_dir)
    _, again, _ = read_hf_dir(tmp_path / "hf")
    fused = hf_state_from_hf(cfg, module.state_dict())
    assert any(k.endswith("experts.gate_up_proj") for k in module.state_dict())
    for key, tensor in state.items():
        assert torch.equal(tensor, again[key]) and torch.equal(tensor, fused[key]), key


def _router_at_input_precision(self, hidden_states):
    """transformers' MixtralTopKRouter.forward without its fp32 softmax."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    top, experts = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
    return logits, top / top.sum(-1, keepdim=True), experts


def test_aux_loss_equals_transformers_in_fp64(hf_models):
    hf_dir, _ = hf_models["mixtral"]
    # fp64 routers on both sides (HF's patched per instance, as hf_parity patches its
    # RMSNorm), so the layers' inputs and router logits agree to ~1e-15.
    model, cfg = _ours(hf_dir, torch.float64, moe_router_dtype="fp64")
    assert cfg.moe_aux_loss_coeff == 0.02  # output_router_logits: the loss counts
    ref = transformers.MixtralForCausalLM.from_pretrained(hf_dir, **EAGER).double().eval()
    _keep_norms_in_float64(ref)
    for layer in ref.model.layers:
        layer.mlp.gate.forward = types.MethodType(_router_at_input_precision, layer.mlp.gate)
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        model.logits({"input_ids": ids})
        out = ref(input_ids=ids, output_router_logits=True)
    layers = moe_losses(model)
    ours = pooled_load_balancing_loss(layers)
    # transformers' formula (load_balancing_loss_func) at fp64 on its own router logits:
    # it accumulates in fp32, which ~1e-7 would hide; the float64 sum shows the math.
    logits = torch.cat(out.router_logits)  # [layers · T, E]
    probs = logits.softmax(-1)
    chosen = F.one_hot(probs.topk(cfg.moe_top_k).indices, cfg.moe_num_experts).sum(1)
    expected = cfg.moe_num_experts * (chosen.double().mean(0) * probs.mean(0)).sum()
    # fp64, only summation order differs: ~1e-16 on a value ~2.
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    # transformers' own output: its fp32 accumulation, ~1e-7 relative.
    torch.testing.assert_close(ours, out.aux_loss.double(), rtol=2e-6, atol=0)
    for layer, hf_logits in zip(layers, out.router_logits, strict=True):  # same choices
        picks = hf_logits.softmax(-1).topk(cfg.moe_top_k).indices.flatten()
        assert torch.equal(layer.slots_per_expert, torch.bincount(picks, minlength=4))
    print(f"aux loss: ours {ours.item():.15f}, fp64 formula {expected.item():.15f}")


def _config(hf_models, name: str) -> dict:
    return json.loads(Path(hf_models[name][0], "config.json").read_text())


@pytest.mark.parametrize(
    "name, change, message",
    [
        (
            "qwen2_moe",
            dict(use_sliding_window=True, sliding_window=16),
            "sliding_window 16 is not supported for qwen2_moe",
        ),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1 is not supported"),
        ("qwen2_moe", dict(mlp_only_layers=[0]), "mlp_only_layers is not supported"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared expert needs >= 1"),
    ],
)
def test_unsupported_configs_are_one_line(hf_models, name, change, message):
    with pytest.raises(ValueError, match=message) as err:
        config_from_hf({**_config(hf_models, name), **change})
    assert "\n" not in str(err.value)


def test_aux_weight_follows_output_router_logits_and_exports_refuse_other_routers(hf_models):
    config = {**_config(hf_models, "mixtral"), "output_router_logits": False}
    cfg = config_from_hf(config)
    assert cfg.moe_aux_loss_coeff == 0.0  # transformers adds no aux loss then
    assert config_to_hf(cfg, config)["router_aux_loss_coef"] == 0.02  # kept as it was
    for change, message in (
        (dict(moe_router="sigmoid"), "moe_router='sigmoid' has no Hugging Face MoE class"),
        (dict(moe_renormalize=False), "set model.moe_renormalize=true"),
    ):
        with pytest.raises(ValueError, match=message):
            config_to_hf(replace(cfg, **change))


@pytest.mark.slow
def test_moe_tiny_trains_and_exports_as_mixtral(tmp_path):
    # The preset as it is (the CLI run is in docs/MODELS.md): its loss with the routers'
    # losses falls over a few AdamW steps on one batch, and it exports as a Mixtral that
    # transformers reads and computes alike (fp32, 1e-4 as above).
    cfg = replace(preset("moe_tiny"), kernels="torch")
    torch.manual_seed(0)
    model = build_model(cfg, device=DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model.loss(ids) + sum(one.loss for one in moe_losses(model))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    write_hf_dir(tmp_path / "hf", cfg, model.full_state_dict())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    ref = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", **EAGER).eval()
    with torch.no_grad():
        ours = model.eval().logits({"input_ids": ids})["logits"][..., : cfg.vocab_size]
        err = (ours - ref(input_ids=ids).logits).abs().max().item()
    assert err <= 1e-4, err


@pytest.mark.slow
def test_verifier_compares_an_moe_directory_in_fp64(hf_models):
    # tools/verify_equivalence.py --hf-dir at tp 1 (its main on one rank, as a launcher
    # runs it), its default float64: transformers' experts as its per-expert loop (its
    # grouped_mm takes no float64).
    hf_dir, _ = hf_models["mixtral"]
    (report,) = verify_in_one_launch(1, ["--hf-dir", hf_dir, "--tp-size", "1"], timeout=120)
    error = logit_error(report)
    assert error <= 1e-10, error
