"""Sampling from a GPT whose logits are sharded over the vocabulary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import parallel_state
from engine.generate import generate
from engine.models import build_model
from tests.multiproc import run_ranks
from tests.torch_reference import tiny_gpt

CFG = tiny_gpt(300, max_positions=32)


def _samples(sequence_parallel: bool) -> tuple[list[int], list[int], list[int]]:
    ps = parallel_state.initialize(2)
    ps.seed(9)
    model = build_model(dataclasses.replace(CFG, sequence_parallel=sequence_parallel))
    full = model.full_state_dict()
    single = [dist.new_group([r]) for r in range(ps.world_size)][ps.rank]
    serial = build_model(CFG, tp_group=single)
    serial.load_full_state_dict(full)
    prompt = [5, 17, 42]
    kwargs = dict(temperature=0.7, top_k=20, seed=3)
    # 40 new tokens from a 3-token prompt overflow max_positions=32: the window slides.
    return (
        generate(model, prompt, 40, **kwargs),
        generate(serial, prompt, 40, **kwargs),
        generate(serial, prompt, 40, temperature=0.7, top_k=20, seed=4),
    )


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.slow
def test_tp2_samples_the_same_tokens_as_tp1(sequence_parallel):
    for split, serial, other_seed in run_ranks(_samples, 2, sequence_parallel):
        assert split == serial  # same weights, same seed: the same 43 ids on every TP rank
        assert len(split) == 43 and all(0 <= t < 300 for t in split)  # never a padding id
        assert other_seed != serial  # the seed really drives the sampling


def test_greedy_top1_follows_the_argmax():
    torch.manual_seed(0)
    model = build_model(CFG)
    ids = generate(model, [1, 2, 3], 5, top_k=1)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0, -1, :300]
    assert ids[-1] == int(logits.argmax())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate(model, [1], 1, temperature=0.0)


# --- the KV cache, batches with left padding, tensor parallelism and Hugging Face -----------

from engine.generate import Sampling, generate_batch  # noqa: E402
from engine.hf_interop import read_hf_dir  # noqa: E402
from tests.multiproc import run_ranks as _run_ranks  # noqa: E402

BIG = tiny_gpt(300, max_positions=64)
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7], [250, 1, 2, 3]]


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding runs hundreds of tiny matmuls: on a loaded shared CPU, intra-op threads that
    wait for a core make each one ~50x slower, so these tests use one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _left_padded(prompts, extra):
    width = max(map(len, prompts))
    ids = torch.tensor(
        [[0] * (width - len(p)) + p + e for p, e in zip(prompts, extra, strict=True)]
    )
    valid = torch.tensor(
        [
            [0] * (width - len(p)) + [1] * (len(p) + len(e))
            for p, e in zip(prompts, extra, strict=True)
        ]
    )
    return ids, valid, (valid.cumsum(1) - 1).clamp(min=0), width


def test_cached_logits_equal_full_forward_and_unpadded_prompts():
    torch.manual_seed(0)
    model = build_model(BIG).eval()
    extra = [[11, 12, 13, 14]] * 3
    ids, valid, pos, width = _left_padded(PROMPTS, extra)
    with torch.no_grad():
        full = model(ids, attention_mask=valid, positions=pos)  # one pass, no cache
        cache = model.new_cache(3, ids.shape[1])
        steps = [
            model(
                ids[:, :width],
                attention_mask=valid[:, :width],
                positions=pos[:, :width],
                cache=cache,
            )
        ]
        for i in range(width, ids.shape[1]):  # then one token at a time
            steps.append(
                model(
                    ids[:, i : i + 1],
                    attention_mask=valid[:, : i + 1],
                    positions=pos[:, i : i + 1],
                    cache=cache,
                )
            )
        cached = torch.cat(steps, dim=1)
        real = valid.bool()
        # fp32: the cached path multiplies [1 × past] blocks instead of [s × s], a different
        # summation order; ~1e-7 relative per op on logits of order 1 stays far below 1e-5.
        torch.testing.assert_close(cached[real], full[real], rtol=1e-5, atol=1e-5)
        for row, prompt in enumerate(PROMPTS):  # reference: each sequence alone, unpadded
            alone = model(torch.tensor([prompt + extra[row]]))[0]
            torch.testing.assert_close(full[row][real[row]], alone, rtol=1e-5, atol=1e-5)


def test_batched_generation_equals_one_prompt_at_a_time_with_and_without_cache():
    torch.manual_seed(0)
    model = build_model(BIG).double()  # float64: no argmax near-tie can flip between paths
    greedy = Sampling(greedy=True)
    batched = generate_batch(model, PROMPTS, 10, greedy)
    assert batched == generate_batch(model, PROMPTS, 10, greedy, use_cache=False)
    assert batched == [generate_batch(model, [p], 10, greedy)[0] for p in PROMPTS]
    stop_at_two = generate_batch(
        model, PROMPTS, 10, greedy, stop=lambda row, new: len(new) >= 2 + row
    )
    assert stop_at_two == [b[: 2 + row] for row, b in enumerate(batched)]


def test_a_compiled_model_decodes_eagerly_with_the_same_tokens():
    """A model compiled for training (model.compile, aot_eager here) generates without
    compiling anything (Dynamo captures no graph: each decode step's shapes would compile
    the forward again) and gives the eager model's greedy tokens (the same weights)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = build_model(BIG)
    torch.manual_seed(0)
    compiled = build_model(dataclasses.replace(BIG, compile=True, compile_backend="aot_eager"))
    ids = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-5, atol=1e-5)  # it compiled
    greedy = Sampling(greedy=True)
    counters.clear()
    tokens = generate_batch(compiled, PROMPTS, 6, greedy)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert tokens == generate_batch(eager, PROMPTS, 6, greedy)


def test_top_p_keeps_the_nucleus_only():
    from engine.generate import next_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(next_tokens(logits, Sampling(top_p=0.8), gen)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.8: tokens 2 and 3 are cut
    draws = {int(next_tokens(logits, Sampling(top_k=3), gen)) for _ in range(300)}
    assert draws == {0, 1, 2}
    with pytest.raises(ValueError, match="top_p must be in"):
        generate_batch(build_model(CFG), [[1]], 1, Sampling(top_p=0.0))


def _tokens_at_tp_1_2_4() -> dict:
    ps = parallel_state.initialize(4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    solos = [dist.new_group([r]) for r in range(4)]
    out = {}
    for tp, group in ((1, solos[ps.rank]), (2, pairs[ps.rank // 2]), (4, ps.tp_group)):
        ps.seed(9)  # the same full weights at every TP size
        model = build_model(BIG, tp_group=group, dtype=torch.float64)
        sampled = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=5)
        out[tp] = (
            generate_batch(model, PROMPTS, 12, Sampling(greedy=True)),
            generate_batch(model, PROMPTS, 12, sampled),
            generate_batch(model, PROMPTS, 12, sampled, use_cache=False),
        )
    return out


@pytest.mark.slow
def test_same_tokens_at_tp_1_2_4_greedy_and_seeded_sampling():
    # float64 logits: TP changes only summation order (~1e-16), far from any sampling boundary.
    results = _run_ranks(_tokens_at_tp_1_2_4, 4)
    reference = results[0][1]
    greedy, sampled, sampled_no_cache = reference
    assert sampled == sampled_no_cache and sampled != greedy
    for per_rank in results:
        for tp in (1, 2, 4):
            assert per_rank[tp] == reference, f"tp={tp} differs"


@pytest.mark.slow
def test_greedy_equals_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300, n_positions=64)
    )
    hf.save_pretrained(tmp_path / "hf")
    cfg, state, _ = read_hf_dir(tmp_path / "hf")
    ours = build_model(cfg, dtype=torch.float64)
    ours.load_full_state_dict({k: v.double() for k, v in state.items()})
    hf = hf.double().eval()
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    # eos_token_id=None: HF would otherwise stop a row at id 50256's stand-in and pad it.
    greedy = dict(max_new_tokens=15, do_sample=False, pad_token_id=0, eos_token_id=None)
    theirs = hf.generate(input_ids=ids, attention_mask=mask, **greedy)[:, width:].tolist()
    for use_cache in (True, False):
        got = generate_batch(ours, PROMPTS, 15, Sampling(greedy=True), use_cache=use_cache)
        assert got == theirs  # float64 both sides: the argmax agrees token for token
