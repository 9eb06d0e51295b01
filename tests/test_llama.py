"""The Llama family (engine/models/llama) against transformers' own models: logits, HF
round trips, gradients under TP past the KV heads, and the one-line config errors.

Tiny random models are built with transformers in the test (no hub)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import parallel_state
from engine.hf_interop import config_from_hf, export_hf, import_hf, read_hf_dir, state_from_hf
from engine.models import ModelConfig, build_model
from layers.rotary import inverse_frequencies
from studies.verification.hf_parity import HF_TOLERANCES, compare_with_hf
from studies.verification.layouts import VerifySpec
from tests.multiproc import run_ranks
from tests.tiny_configs import LLAMA, SWIGLU, hf_tiny, tiny_config

transformers = pytest.importorskip("transformers")

# Awkward on purpose: a prime vocabulary, intermediate size not 4h, rms eps 1e-6, a
# non-default rope_theta, fewer KV heads than TP ranks at tp 4 (llama: 2, mistral: 1).
COMMON = hf_tiny(intermediate_size=80, rms_norm_eps=1e-6)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "llama": transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                **COMMON,
                num_key_value_heads=2,
                tie_word_embeddings=False,
                rope_parameters=LLAMA3_ROPE,
            )
        ),
        "qwen2": transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                **COMMON,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            )
        ),
        "mistral": transformers.MistralForCausalLM(
            transformers.MistralConfig(
                **COMMON, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False
            )
        ),
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root, dirs = tmp_path_factory.mktemp("llama-hf"), {}
    for name, model in _models().items():
        with torch.no_grad():  # random norm weights and biases: a swapped one shows up
            for param_name, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if param_name.endswith("weight") else 0.0, 0.1)
        dirs[name] = str(root / name)
        # Mistral saved in shards, so the index path is read too.
        shards = {"max_shard_size": "40KB"} if name == "mistral" else {}
        model.save_pretrained(dirs[name], **shards)
    return dirs


def test_sharded_save_and_round_trip_are_bitwise(hf_dirs, tmp_path):
    assert (Path(hf_dirs["mistral"]) / "model.safetensors.index.json").is_file()
    for name, hf_dir in hf_dirs.items():
        import_hf(hf_dir, tmp_path / f"{name}-ckpt")
        export_hf(tmp_path / f"{name}-ckpt", tmp_path / f"{name}-hf")
        before = {}
        for shard in Path(hf_dir).glob("*.safetensors"):
            before.update(load_file(str(shard)))
        after = load_file(str(tmp_path / f"{name}-hf" / "model.safetensors"))
        assert before.keys() == after.keys(), name
        for key in before:
            assert torch.equal(before[key], after[key]), (name, key)
        exported = transformers.AutoConfig.from_pretrained(tmp_path / f"{name}-hf").to_dict()
        original = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
        for config in (exported, original):
            config.pop("_name_or_path")  # the directory it was read from
        assert exported == original, name


def _parity(hf_dirs: dict[str, str]) -> list[tuple[str, float, bool]]:
    results = []
    for tp, dp, sp in ((1, 4, False), (2, 2, True), (4, 1, False), (4, 1, True)):
        parallel_state.initialize(tp, dp)
        for name, hf_dir in hf_dirs.items():
            spec = VerifySpec(tp_size=tp, dp_size=dp, sequence_parallel=sp, dtype="float32")
            report = compare_with_hf(spec, hf_dir)
            if report is not None:
                results += [
                    (f"{name} tp={tp} dp={dp} sp={sp}", r.max_abs, r.ok) for r in report.rows
                ]
        parallel_state.destroy()
    return results


@pytest.mark.slow
def test_logits_match_transformers_at_tp_1_2_4(hf_dirs):
    results = run_ranks(_parity, 4, hf_dirs, timeout=600)[0]
    for label, err, _ in results:
        print(f"{label:32s} max abs logit error {err:.2e}")
    # fp32 1e-4 absolute (HF_TOLERANCES): ~1e-7 per op in another summation order on
    # logits of order 1; a misplaced weight or a wrong rotation gives O(0.1-1).
    assert len(results) == 12
    for label, err, ok in results:
        assert ok and err <= HF_TOLERANCES["float32"], (label, err)


def _fp64_rmsnorm(self, x):
    # HF's RMSNorm rounds through fp32 even for fp64 inputs; the reference here keeps the
    # input precision (as meshtron does), so fp64 differences measure the layout alone.
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _gradients(hf_dir: str, tp: int) -> tuple[float, float, int]:
    """(max |grad error|, max |grad|, parameters compared) of meshtron at ``tp`` vs HF, fp64."""
    transformers.models.llama.modeling_llama.LlamaRMSNorm.forward = _fp64_rmsnorm
    parallel_state.initialize(tp, 1)
    cfg, state, _ = read_hf_dir(hf_dir)
    model = build_model(cfg, tp_group=parallel_state.get().tp_group, dtype=torch.float64)
    model.load_full_state_dict(state)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
    model.loss(ids).backward()
    ours = model.full_grad_dict()
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir).double()
    logits = ref(input_ids=ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    theirs = state_from_hf(cfg, {n: p.grad for n, p in ref.named_parameters()})
    parallel_state.destroy()
    worst = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
    return worst, max(t.abs().max().item() for t in theirs.values()), len(theirs)


@pytest.mark.slow
def test_gqa_gradients_past_the_kv_heads_match_transformers(hf_dirs):
    # llama: 2 KV heads at tp 4, so each is replicated on 2 ranks and its weight gradient
    # must be the sum over exactly those 2 (a missing sum halves it, a TP-wide sum doubles).
    results = run_ranks(_gradients, 4, hf_dirs["llama"], 4, timeout=300)
    worst, scale, count = results[0]
    # fp64 1e-10 absolute on gradients of order 1e-1: only summation order differs.
    assert count == len(read_hf_dir(hf_dirs["llama"])[1]) and scale > 1e-3
    assert worst <= 1e-10, worst


def test_llama3_frequencies_match_transformers():
    rope = dict(LLAMA3_ROPE)
    config = transformers.LlamaConfig(**COMMON, rope_parameters=rope)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(16, 5e5, (8.0, 1.0, 4.0, 16))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # same fp32 ops, bit for bit


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_kv_heads=5), "model.num_kv_heads=5 must be >= 1 and divide model.num_heads=12"),
        (dict(num_kv_heads=4), "model.num_kv_heads=4 and tp_size=6"),
        (dict(norm="layernorn"), "model.norm='layernorn' is not one of"),
        (dict(rope_scaling="yarn"), "model.rope_scaling='yarn' is not one of"),
    ],
)
def test_bad_family_configs_are_one_line(overrides, message):
    tp = 6 if "tp_size=6" in message else 1
    cfg = ModelConfig(**{"num_heads": 12, **overrides})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        cfg.validate(tp)


def test_unbuilt_rope_scaling_from_hf_is_one_line(hf_dirs, tmp_path):
    config = json.loads(Path(hf_dirs["llama"], "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        config_from_hf(config)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (  # both spellings (a config edited by hand, or converted twice): yarn must not vanish
            {
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            },
            "rope_parameters.rope_type='default' and rope_scaling's 'yarn' disagree",
        ),
        (  # a factor with nothing saying how it scales
            {"rope_scaling": {"factor": 2.0}},
            "rope_scaling.factor=2.0 scales RoPE but no rope_type says how",
        ),
    ],
)
def test_a_rope_scaling_that_would_be_dropped_is_refused(hf_dirs, rope, message):
    config = json.loads(Path(hf_dirs["llama"], "config.json").read_text())
    config.pop("rope_parameters", None)
    config.pop("rope_scaling", None)
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_hf({**config, **rope})


def test_flops_match_torchs_flop_counter():
    # Same method as tests/test_flops.py: torch's FlopCounterMode counts every matmul at 2
    # FLOPs per MAC, SDPA on its math backend; integers, tolerance 0. GQA (2 of 4 heads)
    # and an intermediate size not 4h (80) make a wrong K/V or SwiGLU term show; vocab
    # 101 pads to 128, which the formula must be given.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from engine.flops import model_flops, params_count

    shape = dict(vocab_size=101, hidden_size=64, num_kv_heads=2, ffn_hidden_size=80)
    cfg = tiny_config(**LLAMA, **SWIGLU, **shape)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.loss(ids).backward()
    assert counter.get_total_flops() == model_flops(cfg, 2, 32)
    # The parameter count against the model's own tensors, untied and Qwen2-style (biases
    # on q/k/v only, tied head), each term showing in one of the two.
    for variant in (cfg, replace(cfg, qkv_bias=True, tie_embeddings=True)):
        state = build_model(variant).full_state_dict()
        assert params_count(variant) == sum(t.numel() for t in state.values())


def test_greedy_generation_with_kv_cache_equals_transformers(hf_dirs, monkeypatch):
    # fp64 on both sides (HF's RMSNorm kept at input precision, see _fp64_rmsnorm) so no
    # near-tie can flip an argmax; GQA with 2 KV heads, llama3-scaled rotary positions.
    from engine.generate import Sampling, generate_batch

    monkeypatch.setattr(
        transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _fp64_rmsnorm
    )
    cfg, state, _ = read_hf_dir(hf_dirs["llama"])
    model = build_model(cfg, dtype=torch.float64)
    model.load_full_state_dict(state)
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dirs["llama"]).double().eval()
    prompt = [5, 17, 99, 3, 42]
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    for use_cache in (True, False):
        got = generate_batch(model, [prompt], 20, Sampling(greedy=True), use_cache=use_cache)
        assert got == [expected], use_cache
