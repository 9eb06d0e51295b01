"""apps.serving: the paged KV cache and the continuous-batching engine.

The references are independent of the engine: ``engine.generate.generate_batch`` (what
``tools/generate.py`` runs) for the tokens, one plain full forward over prompt + tokens
for the log-probabilities.

Tolerance. The models are float32. A row's context is gathered into a window as wide as
the batch's longest and left-padded; the padded keys get probability exactly 0, but the
batch size and window width change how the matmuls and the softmax block their sums, so
the same row's logits move by float32 rounding (a few ulp of values of order 1, measured
~1e-6). Log-probabilities are compared at atol = rtol = 1e-5, ten times that. Tokens are
compared exactly: each test first checks that along the reference the top-1 logit leads
the top-2 by far more than that (> 10 × 1e-5; measured >= 1e-3), so no argmax can flip.
"""

from __future__ import annotations

import math

import pytest
import torch

from apps.serving import PagedKVCache, PoolFull, Refused, Request, ServingEngine
from apps.serving.requests import CANCELLED, LENGTH, STOP
from engine.checkpoint.format import write_checkpoint
from engine.generate import Sampling, generate_batch
from engine.inference import ModelSource, inference_config
from engine.models import build_model
from tests.threads_util import torch_threads
from tests.tiny_configs import serving_config

TOL = dict(atol=1e-5, rtol=1e-5)  # float32, batch-dependent summation order (docstring)
GREEDY = Sampling(greedy=True)
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7], [250, 1, 2, 3], list(range(10, 29)), [1]]
MAX_TOKENS = [10, 14, 6, 9, 12]


@pytest.fixture(autouse=True)
def _one_thread():
    """Hundreds of tiny matmuls: intra-op threads waiting for a shared core only slow them."""
    with torch_threads(1):
        yield


def _model(family: str):
    """A tiny random float32 decoder (tests/tiny_configs.py's serving_config)."""
    torch.manual_seed(0)
    return build_model(inference_config(serving_config(family))).eval()


def _engine(model, *, tokens=512, block_size=4, **kwargs) -> ServingEngine:
    cache = PagedKVCache.for_model(model, tokens=tokens, block_size=block_size)
    return ServingEngine(model, cache, **kwargs)


def _alone(model, prompt, max_tokens, sampling=GREEDY):
    engine = _engine(model)
    rid = engine.submit(Request(prompt, max_tokens, sampling))
    return engine.run_until_idle()[rid]


def _reference_logprobs(model, prompt, tokens) -> tuple[torch.Tensor, float]:
    """Log-probabilities of ``tokens`` after ``prompt`` from one full forward, and the
    smallest top-1 − top-2 logit gap at the positions that chose them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, :, : model.cfg.vocab_size]
    logits = logits[len(prompt) - 1 : -1]  # position i predicts token i + 1
    chosen = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    top = logits.topk(2, dim=-1).values
    return chosen, float((top[:, 0] - top[:, 1]).min())


def _mixed_batch(model, requests, joins=None, **engine_kwargs):
    """Run ``requests`` through one engine, request k submitted before step ``joins[k]``
    (default: step k), so most join a batch already decoding; the completions in order."""
    joins = list(range(len(requests))) if joins is None else joins
    engine = _engine(model, **engine_kwargs)
    ids, step, done = [], 0, {}
    while len(ids) < len(requests) or engine.has_work:
        while len(ids) < len(requests) and joins[len(ids)] <= step:
            ids.append(engine.submit(requests[len(ids)]))
        for event in engine.step():
            done.setdefault(event.request_id, []).append(event)
        step += 1
    assert engine.cache.used_blocks == 0 and not engine.running
    return [_completion(done[rid]) for rid in ids]


def _completion(events):
    tokens = [e.token for e in events if e.token is not None]
    logprobs = [e.logprob for e in events if e.token is not None]
    return tokens, logprobs, events[-1].finish_reason


# Staggered: each joins a batch that is decoding. Together: prompt chunks of different
# lengths share a prefill forward. Both with a budget of 8 tokens a step, which splits the
# 19-token prompt over steps while others decode, and 3 running at most, so later
# requests also wait for a slot.
JOINS = {"staggered": [0, 2, 4, 6, 8], "together": [0] * 5}


@pytest.mark.parametrize("joins", JOINS)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_greedy_tokens_and_logprobs_alone_equal_mixed_batch_and_generate(family, joins):
    model = _model(family)
    requests = [Request(p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    mixed = _mixed_batch(model, requests, JOINS[joins], max_running=3, token_budget=8)
    worst, gap_min = 0.0, math.inf
    for request, (tokens, logprobs, reason) in zip(requests, mixed, strict=True):
        reference = generate_batch(model, [request.prompt], request.max_tokens, GREEDY)[0]
        expected, gap = _reference_logprobs(model, request.prompt, reference)
        assert gap > 10 * TOL["atol"], f"argmax gap {gap} too small to compare tokens"
        gap_min = min(gap_min, gap)
        alone = _alone(model, request.prompt, request.max_tokens)
        assert alone.tokens == tokens == reference and reason == alone.finish_reason == LENGTH
        torch.testing.assert_close(torch.tensor(alone.logprobs), expected, **TOL)
        torch.testing.assert_close(torch.tensor(logprobs), expected, **TOL)
        worst = max(worst, float((torch.tensor(logprobs) - expected).abs().max()))
    print(f"{family}, {joins}: largest |Δ log-prob| {worst:.2e}, smallest argmax gap {gap_min:.1e}")


def test_a_checkpoint_serves_what_generate_batch_gives(tmp_path):
    """The same loading path as tools/generate.py: an export on disk, read back, served."""
    model = _model("gpt")
    write_checkpoint(tmp_path / "export", model.full_state_dict(), model.cfg)
    cfg, state = ModelSource(ckpt=str(tmp_path / "export")).load()
    served = build_model(inference_config(cfg))
    served.load_full_state_dict(state)
    requests = [Request(p, 8) for p in PROMPTS[:3]]
    mixed = _mixed_batch(served, requests)
    batched = generate_batch(model, [r.prompt for r in requests], 8, GREEDY)  # left-padded
    assert [tokens for tokens, _, _ in mixed] == batched


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = _model("llama")
    sampled = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=7)
    target = Request(PROMPTS[0], 16, sampled)
    alone = _alone(model, target.prompt, 16, sampled)
    # generate_batch draws a batch of one from one generator seeded alike: the same tokens.
    assert alone.tokens == generate_batch(model, [target.prompt], 16, sampled)[0]
    others = [
        Request(p, 12, Sampling(temperature=1.0, top_p=0.8, seed=100 + i))
        for i, p in enumerate(PROMPTS[1:])
    ]
    for position in (0, 2, 4):  # first in, joining mid-way, last in
        requests = others[:position] + [target] + others[position:]
        tokens, logprobs, _ = _mixed_batch(model, requests, max_running=4, token_budget=8)[position]
        assert tokens == alone.tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(alone.logprobs), **TOL)
    other_seed = _alone(model, target.prompt, 16, Sampling(**{**sampled.__dict__, "seed": 8}))
    assert other_seed.tokens != alone.tokens  # the seed really drives the draws


def test_stop_token_ends_a_request_and_keeps_the_stop_token():
    model = _model("gpt")
    full = _alone(model, PROMPTS[0], 10).tokens
    engine = _engine(model)
    rid = engine.submit(Request(PROMPTS[0], 10, stop_token_ids=frozenset({full[3]})))
    stopped = engine.run_until_idle()[rid]
    first = full.index(full[3])  # the stop id may occur before position 3
    assert stopped.tokens == full[: first + 1] and stopped.finish_reason == STOP


def test_blocks_return_to_the_pool_after_completion_and_cancellation():
    model = _model("gpt")
    engine = _engine(model, tokens=64, block_size=4, max_running=2)
    ids = [engine.submit(Request(p, 10)) for p in PROMPTS[:4]]
    early = [event for _ in range(3) for event in engine.step()]
    assert [s.request_id for s in engine.running] == ids[:2]
    assert [s.request_id for s in engine.waiting] == ids[2:]
    held = engine.cache.used_blocks
    assert held == sum(engine.cache.blocks_for(s.cached) for s in engine.running) > 0
    assert engine.cancel(ids[0]) and engine.cancel(ids[3])  # one running, one waiting
    assert not engine.cancel(ids[0]) and not engine.cancel("no-such-request")
    assert engine.cache.used_blocks < held
    done = engine.run_until_idle()
    assert done[ids[0]].finish_reason == done[ids[3]].finish_reason == CANCELLED
    assert done[ids[0]].tokens == done[ids[3]].tokens == []  # the end carries no token
    assert sum(e.request_id == ids[0] for e in early) == 3  # one token a step before it
    first = [e.token for e in early if e.request_id == ids[1]] + done[ids[1]].tokens
    assert first == _alone(model, PROMPTS[1], 10).tokens
    assert done[ids[2]].tokens == _alone(model, PROMPTS[2], 10).tokens
    cache = engine.cache
    assert cache.used_blocks == 0 and cache.available_blocks == cache.num_blocks == 16


def test_a_full_pool_refuses_or_queues_and_never_hangs():
    model = _model("gpt")
    # 8 blocks of 4 tokens: one 6 + 10 - 1 = 15-position request reserves 4 blocks, so two
    # fit at once and the third waits for a slot to free.
    engine = _engine(model, tokens=32, block_size=4, max_running=8, max_waiting=3)
    with pytest.raises(Refused, match="exceeds_cache: .* need 10 KV blocks; the whole cache has 8"):
        engine.submit(Request(PROMPTS[3], 20))  # 19 + 20 - 1 = 38 positions: never fits
    for _ in range(3):
        engine.submit(Request(PROMPTS[0], 10))
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1
    assert engine.cache.available_blocks == 0
    engine.submit(Request(PROMPTS[1], 4))
    engine.submit(Request(PROMPTS[1], 4))
    with pytest.raises(Refused) as refused:
        engine.submit(Request(PROMPTS[1], 4))  # three are waiting already
    assert refused.value.code == "queue_full" and "3 requests are already waiting" in str(
        refused.value
    )
    steps = 1
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 100, "the queue did not drain"
    assert engine.cache.used_blocks == 0
    with pytest.raises(PoolFull, match="36 tokens need 9 KV blocks; 8 of 8 are free"):
        engine.cache.reserve(36)  # the pool itself refuses at once as well


def test_malformed_requests_are_refused_with_the_reason():
    engine = _engine(_model("gpt"))
    cases = {
        "too_long": Request(PROMPTS[0], 60),  # 6 + 60 > 64 positions
        "bad_request": Request([], 4),
    }
    for code, request in cases.items():
        with pytest.raises(Refused) as refused:
            engine.submit(request)
        assert refused.value.code == code
    for request, words in [
        (Request([1], 4, Sampling(temperature=float("nan"))), "temperature must be > 0"),
        (Request([1], 4, Sampling(top_p=0.0)), "top_p must be in"),
        (Request([300], 4), "prompt token ids must be in 0 .. 299"),
        (Request([1], -1), "max_tokens must be >= 0"),
    ]:
        with pytest.raises(Refused, match=words):
            engine.submit(request)
    engine.submit(Request([1], 2, request_id="a"))
    with pytest.raises(Refused, match="request id 'a' is already in use"):
        engine.submit(Request([1], 2, request_id="a"))
    zero = engine.submit(Request([1, 2], 0))  # max_tokens 0: ends at once, no token
    done = engine.run_until_idle()
    assert done[zero].tokens == [] and done[zero].finish_reason == LENGTH
    assert len(done["a"].tokens) == 2


def test_paged_cache_layout_and_sizing():
    model = _model("llama")
    by_bytes = PagedKVCache.for_model(model, nbytes=100_000, block_size=8)
    # 2 layers × (keys, values) × 8 tokens × 2 KV heads × 8 dims × 4 bytes = 2048 per block.
    assert by_bytes.num_blocks == 100_000 // 2048 and by_bytes.nbytes == 48 * 2048
    assert "48 blocks × 8 tokens = 384 tokens" in by_bytes.describe()
    cache = PagedKVCache.for_model(model, tokens=10, block_size=4)  # rounded up: 3 blocks
    table = cache.reserve(9)
    assert cache.available_blocks == 0 and cache.used_blocks == 0  # promised, not taken
    cache.grow(table, 5)
    assert table.blocks == [0, 1] and cache.used_blocks == 2
    assert cache.slots(table, 3, 6).tolist() == [3, 4, 5]
    with pytest.raises(PoolFull, match="exceed the table's reservation"):
        cache.grow(table, 13)
    cache.release(table)
    assert cache.available_blocks == cache.free_blocks == 3
    with pytest.raises(ValueError, match="by tokens or by bytes"):
        PagedKVCache.for_model(model)


def test_a_pool_past_the_free_ram_of_this_machines_ranks_is_refused(monkeypatch):
    """2048 bytes a block (as above); with 5000 bytes of free RAM (set here) two blocks fit
    one rank, not the two ranks LOCAL_WORLD_SIZE=2 says share this machine, and three
    blocks fit neither: one line, before any allocation."""
    import engine.preflight

    model = _model("llama")
    monkeypatch.setattr(engine.preflight, "available_ram_bytes", lambda: 5000)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert PagedKVCache.for_model(model, tokens=16, block_size=8).num_blocks == 2
    with pytest.raises(
        ValueError,
        match=r"^a KV cache of 24 tokens takes 0\.006 MiB, and there are 0\.005 MiB of free",
    ):
        PagedKVCache.for_model(model, tokens=24, block_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="of free RAM for this machine's 2 ranks: lower"):
        PagedKVCache.for_model(model, tokens=16, block_size=8)


def test_prompt_scores_and_alternatives_equal_a_full_forward():
    """Prompt log-probabilities (echo, log-likelihood) over chunked prefill, with and without
    new tokens, and the top alternatives, against one plain forward (tolerance: TOL)."""
    model = _model("llama")
    prompt = PROMPTS[3]  # 19 tokens: a budget of 8 splits it over three steps
    engine = _engine(model, max_running=4, token_budget=8)
    scoring = engine.submit(Request(prompt, 0, prompt_logprobs=True, top_logprobs=3))
    both = engine.submit(Request(prompt, 4, prompt_logprobs=True, top_logprobs=2))
    nothing = engine.submit(Request(prompt, 0))  # max_tokens 0 unscored: ends at once
    single = engine.submit(Request([5], 0, prompt_logprobs=True))  # no token to score
    done = engine.run_until_idle()
    assert engine.cache.used_blocks == 0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + done[both].tokens]))[0, :, : model.cfg.vocab_size]
    logprobs = torch.log_softmax(logits, -1)
    expected = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    for rid, top in ((scoring, 3), (both, 2)):
        scored = done[rid].prompt
        assert [s.token for s in scored] == prompt[1:]
        torch.testing.assert_close(torch.tensor([s.logprob for s in scored]), expected, **TOL)
        assert [len(s.top) for s in scored] == [top] * len(scored)
        assert [s.top[0][0] for s in scored] == logprobs[:-1].argmax(-1)[: len(scored)].tolist()
    assert done[scoring].tokens == [] and done[scoring].finish_reason == LENGTH
    generated = logprobs[len(prompt) - 1 : -1].topk(2)
    assert [[t for t, _ in top] for top in done[both].top] == generated.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([[v for _, v in top] for top in done[both].top]), generated.values, **TOL
    )
    assert done[nothing].prompt is None and done[nothing].tokens == []
    assert done[single].prompt == () and done[single].finish_reason == LENGTH


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_decode_lanes_give_what_the_gather_gives_bit_for_bit(family, monkeypatch):
    """The lanes (apps.serving.lanes) hold the same keys in the same left-padded layout as
    the gather out of the blocks, so the logits are equal exactly, not within a tolerance.
    Rows join and leave (the last lane moves into a finished one's), and a growth room of
    2 columns forces rebases (every lane reloaded from the blocks) every few steps."""
    monkeypatch.setattr("apps.serving.lanes.MIN_GROWTH", 2)
    model = _model(family)
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [60, 61]]
    requests = [Request(p, n) for p, n in zip(prompts, MAX_TOKENS + [3, 16], strict=True)]
    joins = [0, 1, 1, 3, 5, 6, 9]
    kwargs = dict(max_running=4, token_budget=8)
    lanes = _mixed_batch(model, requests, joins, **kwargs)
    gathered = _mixed_batch(model, requests, joins, decode_lanes=False, **kwargs)
    assert lanes == gathered
