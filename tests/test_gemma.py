"""The Gemma 2 family (``model.arch=gemma``) and the sliding-window attention every causal
family may use (``model.sliding_window``): the window's mask against a hand-built one
through torch's SDPA, the alternating layers, a KV cache decoding inside the window,
logits parity with transformers' Gemma2ForCausalLM (a tiny random model built here,
nothing fetched) in process and through ``tools/verify_equivalence.py --hf-dir`` at TP 1
and TP 2, HF export then import bitwise, the one-line refusals, and the tiny preset
training.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.hf_interop import export_hf, import_hf, read_hf_dir
from engine.models import build_model, preset
from layers.attention import CoreAttention, sliding_window_mask
from layers.spec import spec_for
from tests.multiproc import run_ranks
from tests.tiny_configs import HF_GQA_UNTIED, hf_tiny
from tests.verify_util import logit_error, verify_in_one_launch

transformers = pytest.importorskip("transformers")
VOCAB = 101
# A tiny Gemma 2 whose window (5) is shorter than the verifier's sequence (12) and the
# in-process one (16); caps low enough that they bend the scores and logits.
SOFTCAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
GEMMA = hf_tiny(vocab_size=VOCAB, intermediate_size=80, num_hidden_layers=3, head_dim=16)
GEMMA.update(num_key_value_heads=2, sliding_window=5, query_pre_attn_scalar=24, **SOFTCAPS)


def _hand_mask(queries: int, keys: int, window: int) -> torch.Tensor:
    """The window's pattern written out element by element."""
    mask = torch.zeros(queries, keys, dtype=torch.bool)
    for i in range(queries):
        at = keys - queries + i  # the query's position: the past comes first
        for j in range(keys):
            mask[i, j] = at - window < j <= at
    return mask


@pytest.mark.parametrize("queries,keys,window", [(7, 7, 3), (7, 7, 1), (7, 7, 9), (2, 9, 4)])
def test_sliding_window_mask_is_the_hand_built_one_through_sdpa(queries, keys, window):
    """The mask itself, and the core attention with ``window`` against torch's SDPA given
    the hand-built mask (grouped-query heads, a KV cache's past when keys > queries)."""
    hand = _hand_mask(queries, keys, window)
    assert torch.equal(sliding_window_mask(queries, keys, window), hand)
    torch.manual_seed(0)
    q = torch.randn(2, 4, queries, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, keys, 8, dtype=torch.float64) for _ in range(2))
    core = CoreAttention(0.0, causal=True, recompute=False, rng=None, window=window)
    ours = core(q, k, v, None)  # [s, b, heads · d]
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    reference = F.scaled_dot_product_attention(q, k4, v4, attn_mask=hand)
    assert torch.allclose(ours, reference.permute(2, 0, 1, 3).reshape(queries, 2, 32))
    if window < keys:  # the window changes the result: it is not plain causal attention
        causal = CoreAttention(0.0, causal=True, recompute=False, rng=None)
        assert not torch.allclose(causal(q, k, v, None), ours)


def test_the_window_also_limits_a_given_mask_and_the_soft_capped_scores():
    """A padding mask given with the window is intersected with it; the soft-capped, scaled
    scores are c·tanh(s·q·kᵀ/c) under the same mask."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    padding = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    padding[..., 0] = False  # the first key is padding
    hand = _hand_mask(6, 6, 3) & padding
    hand[..., 0, 0] = True  # the padded query still sees itself (no NaN row)
    core = CoreAttention(0.0, causal=True, recompute=False, rng=None, window=3, scale=0.3)
    core.softcap = 1.5
    scores = torch.tanh(q @ k.transpose(-2, -1) * 0.3 / 1.5) * 1.5
    probs = scores.masked_fill(~hand, float("-inf")).softmax(-1)
    reference = (probs @ v).permute(2, 0, 1, 3).reshape(6, 1, 8)
    assert torch.allclose(core(q, k, v, hand), reference)


def test_windowed_layers_alternate_and_any_family_takes_the_window():
    """Gemma 2: the window on layers 0, 2, ... (``full_attention_every=2``); a Llama given
    ``model.sliding_window`` keeps it on every layer; BERT refuses it in one line."""
    cfg = preset("gemma_tiny", num_layers=4)
    assert [spec_for(cfg, i).window for i in range(4)] == [32, None, 32, None]
    model = build_model(cfg)
    assert [layer.attention.core.window for layer in model.layers] == [32, None, 32, None]
    llama = build_model(preset("llama_tiny", sliding_window=8, num_layers=3))
    assert [layer.attention.core.window for layer in llama.layers] == [8, 8, 8]
    with pytest.raises(ValueError, match=r"^model.sliding_window limits causal attention;"):
        preset("bert_tiny", sliding_window=8).validate()
    with pytest.raises(ValueError, match=r"^model.sliding_window=0 must be >= 1"):
        preset("llama_tiny", sliding_window=0).validate()
    with pytest.raises(ValueError, match=r"^model.attn_logit_softcapping=-1.0 must be > 0"):
        preset("gemma_tiny", attn_logit_softcapping=-1.0).validate()


def test_context_parallel_takes_the_window_scale_and_cap():
    """Ring attention applies Gemma's window, score scale and cap (tests/test_ring_attention.py,
    tests/test_context_parallel.py): cp_size>1 no longer refuses them."""
    from engine.config import Config, parallel_dims, validate

    cfg = Config(cp_size=2, tp_size=1, dp_size=1)
    cfg.model = preset("gemma_tiny")
    assert not [p for p in validate(cfg, parallel_dims(cfg, None)) if "ring attention" in p]


def test_decoding_with_a_kv_cache_keeps_the_window():
    """Token-by-token decoding through the KV cache gives the full forward's logits: each
    new query sees only its last W keys of the cache."""
    torch.manual_seed(0)
    cfg = preset("gemma_tiny", sliding_window=3, vocab_size=64, hidden_size=32, ffn_hidden_size=64)
    model = build_model(cfg, dtype=torch.float64).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 8)
        steps = [model(ids[:, :4], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(4, 8)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-12)


def test_the_gemma_norm_starts_as_the_identity_scale_and_the_embedding_is_scaled():
    cfg = preset("gemma_tiny", vocab_size=64)
    model = build_model(cfg)
    norm = model.layers[0].post_attention_norm
    assert torch.equal(norm.weight, torch.zeros(cfg.hidden_size))
    x = torch.randn(3, cfg.hidden_size)
    assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    ids = torch.tensor([[1, 2, 3]])
    words = model.embedding.word.weight[ids.t()]
    assert torch.allclose(model.embedding(ids), words * cfg.hidden_size**0.5)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """A tiny random Gemma2ForCausalLM saved locally, its norm weights away from zero and
    its query and key weights 10× the init's, so that the scores reach the soft cap."""
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
    path = tmp_path_factory.mktemp("gemma") / "gemma2"
    model.save_pretrained(path)
    return path


def _logits(hf_dir: Path, dtype: torch.dtype, *changes: dict) -> list[float]:
    """Max abs error of meshtron's logits (TP 1, in process) against transformers' on a
    fixed batch of 16 tokens: the import as it is, then with each of ``changes``."""
    reference = transformers.Gemma2ForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = reference.to(dtype).eval()(input_ids=ids).logits
    cfg, state, _ = read_hf_dir(hf_dir)
    errors = []
    for change in ({}, *changes):
        model = build_model(dataclasses.replace(cfg, **change), dtype=dtype).eval()
        model.load_full_state_dict(state)
        with torch.no_grad():
            errors.append((model(ids)[..., :VOCAB] - theirs).abs().max().item())
    return errors


def test_import_maps_the_config_and_the_logits_match_transformers(gemma_dir):
    """Float32 at TP 1 within 1e-4; the same model without its window, a cap or its query
    scale is far off, so the parity shows that each is applied as transformers applies it."""
    cfg, _, _ = read_hf_dir(gemma_dir)
    assert (cfg.arch, cfg.sliding_window, cfg.full_attention_every) == ("gemma", 5, 2)
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping) == (24.0, 2.0)
    assert (cfg.final_logit_softcapping, cfg.norm, cfg.activation) == (
        3.0,
        "gemma_rmsnorm",
        "geglu",
    )
    changes = (
        dict(sliding_window=None),
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=None),
    )
    error, *without = _logits(gemma_dir, torch.float32, *changes)
    print(f"gemma tp=1 float32 max abs logit error {error:.2e}; without each part {without}")
    assert error <= 1e-4
    assert all(e > 1e-3 for e in without), without


def test_a_head_dim_of_its_own_matches_transformers(tmp_path):
    """Gemma 2's released sizes have heads · head_dim ≠ hidden (8 × 256 on 2304): a tiny
    one (4 heads of 24 on 64) imports with ``attention_head_dim=24``, its fp32 logits
    within 1e-4 of transformers' at TP 1, the parameter count exact, the export bitwise."""
    from engine.models.families import family

    torch.manual_seed(0)
    reference = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**{**GEMMA, "head_dim": 24})
    )
    reference.save_pretrained(tmp_path / "hf")
    cfg, state, _ = read_hf_dir(tmp_path / "hf")
    assert (cfg.attention_head_dim, cfg.head_dim) == (24, 24)
    assert family("gemma").costs.params_count(cfg) == sum(t.numel() for t in state.values())
    model = build_model(cfg).eval()
    model.load_full_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        error = (model(ids)[..., :VOCAB] - reference.eval()(input_ids=ids).logits).abs().max()
    print(f"gemma head_dim 24 tp=1 float32 max abs logit error {error:.2e}")
    assert error <= 1e-4
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_export_then_import_is_bitwise(gemma_dir, tmp_path):
    """HF → meshtron checkpoint → HF gives the same tensors and config.json; importing the
    export again gives the same checkpoint tensors."""
    import_hf(gemma_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    before = load_file(str(gemma_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    original = json.loads((gemma_dir / "config.json").read_text())
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: exported.get(k) for k in original} == original
    first, _, _ = read_hf_dir(gemma_dir)
    again, state, _ = read_hf_dir(tmp_path / "hf")
    assert again == first
    _, original_state, _ = read_hf_dir(gemma_dir)
    assert all(torch.equal(state[k], original_state[k]) for k in original_state)


def test_an_export_of_the_preset_loads_in_transformers_with_the_same_logits(tmp_path):
    """A gemma_tiny model made here (never imported: its query_pre_attn_scalar is the
    config's float 32.0) exported to Hugging Face: transformers' Gemma2Config takes it
    (it refused the float 32.0 the export once wrote, wanting an int), and
    Gemma2ForCausalLM's logits are ours. float32 both, eager attention: atol 1e-5 (the
    two stacks differ by reassociation, ~1e-6 here)."""
    from engine.checkpoint.format import write_checkpoint

    cfg = preset("gemma_tiny", vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
    assert cfg.query_pre_attn_scalar == 32.0
    torch.manual_seed(2)
    model = build_model(cfg).eval()
    write_checkpoint(tmp_path / "ckpt", model.full_state_dict(), cfg)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.Gemma2ForCausalLM.from_pretrained(
        tmp_path / "hf", local_files_only=True, attn_implementation="eager"
    ).eval()
    assert hf.config.query_pre_attn_scalar == 32
    ids = torch.randint(64, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(ids)[..., :64], hf(ids).logits  # ours: padded to 128 rows
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_config_round_trips_and_import_refuses_what_is_not_built_in_one_line():
    """config.json of the preset reads back as the preset (no transformers model needed);
    a head_dim below 1, another activation, biases and a layer pattern that is not "all but
    each k-th" are one line each."""
    from engine.hf_interop import config_from_hf, config_to_hf

    cfg = preset("gemma_tiny")
    base = config_to_hf(cfg)
    assert base["layer_types"] == ["sliding_attention", "full_attention"]
    assert config_from_hf(base) == cfg
    layers = ["full_attention", "sliding_attention"]
    for change, message in (
        (dict(head_dim=0), "model.attention_head_dim=0 must be >= 1"),
        (dict(hidden_activation="silu"), "hidden_activation 'silu' is not supported"),
        (dict(attention_bias=True), "attention_bias=true is not supported"),
        (dict(layer_types=layers), "config.json layer_types: only the window on every layer"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            config_from_hf({**base, **change})


@pytest.fixture(scope="module")
def verified(gemma_dir) -> dict[str, float]:
    """``tools/verify_equivalence.py --hf-dir`` (its ``main``, as a launcher's ranks run it)
    at TP 2 in float32, then at its default float64 with sequence parallelism: the max abs
    logit error of each, both from one start of the two ranks."""
    hf_dir = str(gemma_dir)
    runs = {
        "tp=2 float32": ["--hf-dir", hf_dir, "--tp-size", "2", "--dtype", "float32"],
        "tp=2 sp float64": ["--hf-dir", hf_dir, "--sequence-parallel"],
        "cp=2 float64": ["--hf-dir", hf_dir, "--tp-size", "1", "--cp-size", "2"],
    }
    reports = verify_in_one_launch(2, *runs.values(), timeout=300)
    return {run: logit_error(report) for run, report in zip(runs, reports, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2])  # tp 1: the in-process parity tests above
def test_verifier_passes_at_float32_on_tp_1_and_2(verified, tp):
    """The verifier's sequence (12 tokens) is longer than the window (5)."""
    error = verified[f"tp={tp} float32"]
    print(f"gemma verify_equivalence tp={tp} float32 max abs logit error {error:.2e}")
    assert error <= 1e-4


@pytest.mark.slow
def test_verifier_passes_at_cp_2_against_transformers(verified):
    """cp 2, float64: each rank a part of every sequence at its global positions, the ring
    keeping the window (5) across the parts; the logits joined back in order. Before
    2026-11-28 each rank took the whole rows as its part and positions from 0."""
    error = verified["cp=2 float64"]
    print(f"gemma verify_equivalence cp=2 float64 max abs logit error {error:.2e}")
    assert error <= 1e-8


@pytest.mark.slow
def test_verifier_passes_at_its_default_float64_with_sequence_parallelism(verified):
    """TP 2, float64, sequence parallel: the reference's (1 + w) norms computed in float64."""
    error = verified["tp=2 sp float64"]
    print(f"gemma verify_equivalence tp=2 sp float64 max abs logit error {error:.2e}")
    assert error <= 1e-8


def test_a_mistral_window_imports_and_matches_transformers(tmp_path):
    """The window is every causal family's: a Mistral with a 4-token window shorter than
    the 12-token batch imports with ``sliding_window=4`` on every layer, its fp32 logits
    within 1e-4 of transformers' (off by > 1e-3 without the window), its config.json
    exported as it was."""
    from engine.hf_interop import config_to_hf

    torch.manual_seed(0)
    mistral = hf_tiny(vocab_size=VOCAB, intermediate_size=80, sliding_window=4, **HF_GQA_UNTIED)
    config = transformers.MistralConfig(**mistral)
    reference = transformers.MistralForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "mistral")
    cfg, state, hf_config = read_hf_dir(tmp_path / "mistral")
    assert (cfg.arch, cfg.sliding_window, cfg.full_attention_every) == ("llama", 4, 0)
    exported = config_to_hf(cfg, hf_config)
    assert {k: exported[k] for k in hf_config} == hf_config
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits
    errors = []
    for window in (4, None):
        model = build_model(dataclasses.replace(cfg, sliding_window=window)).eval()
        model.load_full_state_dict(state)
        with torch.no_grad():
            errors.append((model(ids)[..., :VOCAB] - theirs).abs().max().item())
    print(f"mistral window 4 tp=1 float32 max abs logit error {errors[0]:.2e}")
    assert errors[0] <= 1e-4 and errors[1] > 1e-3, errors


@pytest.mark.slow
def test_the_tiny_preset_trains(tmp_path, monkeypatch):
    """``model=gemma_tiny`` composed by Hydra from configs/, checked by ``prepare`` and
    trained by the worker, as ``python -m engine.pretrain model=gemma_tiny`` does at world
    1 (on a forkserver rank, without a fresh interpreter's imports: the CLI's own start is
    tests/test_engine.py's), on a slice of the embedded corpus (300 kB, a 512-token
    vocabulary: the whole corpus's preprocessing would be most of the test's time),
    64-token sequences so that the 32-token window cuts: the loss falls."""
    from engine.data import build_default_corpus
    from engine.pretrain import prepare
    from tests.test_engine import _train, compose_config

    prefix, tokenizer = build_default_corpus(
        tmp_path / "corpus", vocab_size=512, max_bytes=300_000, progress=False
    )
    monkeypatch.chdir(tmp_path)  # the default checkpoint.dir is relative: not in the repo
    cfg = compose_config(
        "model=gemma_tiny",
        "model.vocab_size=512",
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        "trainer.max_steps=12",
        "trainer.log_every=2",
        "trainer.eval_every=0",
        "trainer.sample_tokens=0",
        "trainer.global_batch=8",
        "trainer.micro_batch=4",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "tp_size=1",
        "dp_size=1",
        f"run_dir={tmp_path}",
    )
    summary = run_ranks(_train, 1, prepare(cfg), timeout=600)[0]
    losses = [loss for _, loss in summary["history"]]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
