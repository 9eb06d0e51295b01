"""``python -m apps.serve --tp-size 2``: the server split over two local TP ranks.

One tp 2 server (its own process, which starts the two ranks) serves the tiny export of
tests/test_serve.py; the references are that file's tp 1 server, in this process, and
``engine.generate.generate_batch`` (what ``tools/generate.py`` runs) on the unsplit model.
Without HTTP, the engine and its followers also run on 2 and 4 gloo ranks (gpt, and llama
with 2 KV heads: at tp 4 more ranks than KV heads) against the engine at tp 1.

Tolerance. Tokens and text are compared exactly (the tiny model's top-1 leads by far more
than rounding, as tests/test_serve.py says). Log-probabilities: atol = rtol = 1e-4. At tp
2 each row-parallel linear (attention out, MLP down) sums two fp32 partial products in an
all-reduce, where tp 1 sums them in one matmul: the order changes, so every layer's
output moves by a few ulps (~1e-7 relative), and the log-softmax over the vocabulary
carries that on; measured here: under 1e-5. 1e-4 leaves a decade of margin and is still
far below what a wrong shard or a wrong KV slot would give (order 1e-1).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import torch.distributed as dist

import parallel_state
from apps.serving import PagedKVCache, Request, ServingEngine
from apps.serving.engine import follow
from apps.serving.tp import PlanChannel
from engine.generate import generate_batch
from engine.inference import inference_config
from engine.models import build_model
from tests.multiproc import run_ranks, subprocess_env
from tests.rank_bodies import in_turn
from tests.test_serve import (
    GREEDY,
    PROMPTS,
    ROOT,
    TIMEOUT,
    _completion,
    _serving,
    make_export,
)
from tests.tiny_configs import serving_config

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32 sums over TP in another order (docstring)
START_S = 120  # two ranks importing torch on two busy cores


class _TpServer:
    """``python -m apps.serve ... --tp-size 2`` in its own process: its stdout lines come
    through a queue, its stderr is kept whole."""

    def __init__(self, directory, *options: str) -> None:
        argv = ["--weights", str(directory), "--port", "0", "--cache-tokens", "1024", *options]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.serve", *argv, "--max-running", "4", "--tp-size", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(ROOT),
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read_out, daemon=True).start()
        self._err_reader = threading.Thread(
            target=lambda: self.err.extend(self.process.stderr), daemon=True
        )
        self._err_reader.start()
        self.cache_line = self.lines.get(timeout=START_S).strip()
        self.address = self.lines.get(timeout=TIMEOUT).split()[-1]
        self.client = openai.OpenAI(
            base_url=f"{self.address}/v1", api_key="-", timeout=TIMEOUT, max_retries=0
        )

    def _read_out(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def stderr(self) -> str:
        return "".join(self.err)

    def final_stderr(self) -> str:
        """All of stderr once the server and its ranks have exited (the pipe's end read,
        however late the reader thread gets to it on a busy machine)."""
        self._err_reader.join(TIMEOUT)
        return self.stderr()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """tests/test_serve.py's tiny export: (directory, tokenizer, the model)."""
    return make_export(tmp_path_factory.mktemp("serve_tp") / "tiny")


@pytest.fixture(scope="module")
def tp2(export):
    server = _TpServer(export[0])
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tp2_int8(export):
    """``--tp-size 2 --quantize int8``: its own test reads it, then the killed-rank test
    kills one of its ranks."""
    server = _TpServer(export[0], "--quantize", "int8")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tp1(export):
    with _serving(export[0], "--max-running", "4") as (client, _):
        yield client


def _same(tp2_choice, tp1_choice) -> float:
    """Assert equal text and tokens and close log-probabilities; the largest difference."""
    assert tp2_choice.text == tp1_choice.text
    assert tp2_choice.finish_reason == tp1_choice.finish_reason
    a, b = tp2_choice.logprobs, tp1_choice.logprobs
    if a is None:
        assert b is None
        return 0.0
    assert a.tokens == b.tokens
    assert [None if t is None else list(t) for t in a.top_logprobs] == [
        None if t is None else list(t) for t in b.top_logprobs
    ]
    got = torch.tensor([x for x in a.token_logprobs if x is not None], dtype=torch.float64)
    want = torch.tensor([x for x in b.token_logprobs if x is not None], dtype=torch.float64)
    torch.testing.assert_close(got, want, **TOL)
    return float((got - want).abs().max()) if len(got) else 0.0


@pytest.mark.slow
def test_tp2_greedy_tokens_and_logprobs_equal_tp1_and_generate(tp2, tp1, export):
    _, tokenizer, model = export
    assert tp2.cache_line == (
        "KV cache: 64 blocks × 16 tokens = 1024 tokens, 0.25 MiB (torch.float32, 2 KV heads "
        "× 8) on each of 2 TP ranks"
    )  # 4 heads, 2 a rank
    worst = 0.0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        new = generate_batch(model, [ids], 12, GREEDY)[0]
        options = dict(max_tokens=12, temperature=0, logprobs=2, echo=True)
        answer = _completion(tp2.client, prompt, **options).choices[0]
        assert answer.text == tokenizer.decode(ids) + tokenizer.decode(new)
        worst = max(worst, _same(answer, _completion(tp1, prompt, **options).choices[0]))
        # max_tokens 0: the prompt scored alone (the rows every rank gathers in the forward)
        scored = dict(max_tokens=0, echo=True, logprobs=1)
        worst = max(
            worst,
            _same(
                _completion(tp2.client, ids, **scored).choices[0],
                _completion(tp1, ids, **scored).choices[0],
            ),
        )
    print(f"largest |tp 2 - tp 1| log-probability: {worst:.2e}")


@pytest.mark.slow
def test_tp2_concurrent_and_streamed_requests_equal_tp1(tp2, tp1):
    jobs = [(PROMPTS[0], 10), (PROMPTS[2], 14)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(
            pool.map(
                lambda job: _completion(
                    tp2.client, job[0], max_tokens=job[1], temperature=0, logprobs=1
                ),
                jobs,
            )
        )
    for (prompt, n), answer in zip(jobs, together, strict=True):
        alone = _completion(tp1, prompt, max_tokens=n, temperature=0, logprobs=1)
        _same(answer.choices[0], alone.choices[0])
    stream = _completion(tp2.client, PROMPTS[3], max_tokens=16, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == _completion(tp1, PROMPTS[3], max_tokens=16, temperature=0).choices[0].text


@pytest.mark.slow
def test_tp2_health_and_metrics(tp2):
    base = tp2.address
    assert httpx.get(f"{base}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    _completion(tp2.client, PROMPTS[1], max_tokens=3, temperature=0)
    metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    generated = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("meshtron_generated_tokens_total")
    )
    assert generated >= 3


@pytest.mark.slow
def test_tp2_sigterm_drains_and_every_rank_exits_0(tp2, export):
    """Last of the tp 2 tests: it stops their server."""
    _, tokenizer, model = export
    stream = _completion(tp2.client, PROMPTS[0], max_tokens=60, temperature=0, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    start = time.monotonic()
    tp2.process.send_signal(signal.SIGTERM)
    text += "".join(chunk.choices[0].text for chunk in chunks)
    ids = generate_batch(model, [tokenizer.encode(PROMPTS[0]).ids], 60, GREEDY)[0]
    assert text == tokenizer.decode(ids)
    assert tp2.process.wait(timeout=TIMEOUT) == 0, tp2.stderr()
    # Each rank says so just before it exits 0 itself; the launcher kills what is left
    # only 30 s after passing SIGTERM on, so an end sooner than that is the ranks' own.
    assert time.monotonic() - start < 30
    lines = tp2.final_stderr().splitlines()
    assert "serve: rank 0 stopped" in lines, lines
    assert any(line.startswith("serve: rank 1 stopped after ") for line in lines), lines


def test_tp_size_is_checked_in_one_line_before_a_rank_starts(export, capsys, monkeypatch):
    import engine.launching
    from apps.serve import main

    assert main(["--weights", str(export[0]), "--tp-size", "3"]) == 2
    assert capsys.readouterr().err == ("serve: model.num_heads=4 is not divisible by --tp-size 3\n")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engine.launching, "usable_cores", lambda: 1)
    assert main(["--weights", str(export[0]), "--tp-size", "2"]) == 2
    assert capsys.readouterr().err == (
        "serve: --tp-size 2: this machine has 1 usable CPU cores, one a rank\n"
    )


def _config(family: str):
    """tests/test_serving.py's tiny decoders: gpt (4 heads) and llama (4 heads, 2 KV heads:
    at tp 4 each rank holds one KV head of its own, replicated as the model does)."""
    return serving_config(family)


ENGINE_JOBS = [  # (prompt, max_tokens, prompt_logprobs)
    ([5, 17, 42, 8, 99, 3], 10, False),
    ([7, 7], 14, True),
    (list(range(10, 29)), 9, True),
    ([250, 1, 2, 3], 0, True),  # the prompt scored alone
    ([1], 12, False),
]


def _run(engine) -> list[tuple]:
    ids = [
        engine.submit(Request(prompt, n, top_logprobs=2, prompt_logprobs=scored))
        for prompt, n, scored in ENGINE_JOBS
    ]
    done = engine.run_until_idle()
    out = []
    for rid in ids:
        c = done[rid]
        prompt = [(s.token, s.logprob, s.top) for s in c.prompt or ()]
        out.append((c.tokens, c.logprobs, c.top, prompt, c.finish_reason))
    return out


def _engine_rank(family: str) -> dict:
    """Rank 0 schedules the jobs at tp = world (3 running, 8 tokens a step: prompts are
    chunked), the others follow; rank 0 also runs them on the unsplit model at tp 1."""
    ps = parallel_state.initialize(dist.get_world_size())
    cfg = inference_config(_config(family))
    solo = [dist.new_group([r]) for r in range(ps.world_size)][ps.rank]
    torch.manual_seed(0)
    full = build_model(cfg, tp_group=solo).eval()
    model = build_model(cfg, tp_group=ps.tp_group).eval()
    model.load_full_state_dict(full.full_state_dict())
    cache = PagedKVCache.for_model(model, tokens=512, block_size=4)
    channel = PlanChannel(ps.tp_group)
    if not channel.is_source:
        return {"forwards": follow(model, cache, channel), "kv_heads": cache.keys.shape[3]}
    options = dict(max_running=3, token_budget=8)
    split = _run(ServingEngine(model, cache, channel=channel, **options))
    channel.send(None)
    tp1_cache = PagedKVCache.for_model(full, tokens=512, block_size=4)
    return {"tp": split, "tp1": _run(ServingEngine(full, tp1_cache, **options))}


@pytest.fixture(scope="module")
def engine_at_tp2() -> dict[str, list[dict]]:
    """gpt's and llama's engine runs at tp 2 from one launch of 2 ranks (one rank start and
    one import of the engine for both): {family: per rank}."""
    families = ("gpt", "llama")
    calls = [(_engine_rank, (family,)) for family in families]
    per_rank = run_ranks(in_turn, 2, calls, timeout=300)
    return {family: [rank[i] for rank in per_rank] for i, family in enumerate(families)}


@pytest.mark.slow
@pytest.mark.parametrize("family, tp", [("gpt", 2), ("llama", 2), ("llama", 4)])
def test_the_engine_split_over_tp_ranks_equals_tp1(family, tp, request):
    """No HTTP: the engine and its followers on ``tp`` gloo ranks, prompts chunked over
    steps, requests joining and leaving the batch, prompt scoring on every rank."""
    if tp == 2:  # the tp 2 families share one launch
        results = request.getfixturevalue("engine_at_tp2")[family]
    else:
        results = run_ranks(_engine_rank, tp, family)
    split, whole = results[0]["tp"], results[0]["tp1"]
    for a, b in zip(split, whole, strict=True):
        assert a[0] == b[0] and a[4] == b[4]  # tokens, finish reason
        assert [[t for t, _ in top] for top in a[2]] == [[t for t, _ in top] for top in b[2]]
        torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), **TOL)
        assert [p[0] for p in a[3]] == [p[0] for p in b[3]]
        got, want = [p[1] for p in a[3]], [p[1] for p in b[3]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    assert split[3][0] == [] and len(split[3][3]) == 3  # max_tokens 0: 3 tokens scored
    kv_heads = 2 if family == "gpt" else max(1, 2 // tp)
    forwards = results[1]["forwards"]
    assert forwards > len(ENGINE_JOBS) and all(r["forwards"] == forwards for r in results[1:])
    assert all(r["kv_heads"] == kv_heads for r in results[1:])


def _per_shard_reference(directory):
    """The unsplit float model of the export at ``directory`` (loaded as the server loads
    it) with every weight int8 stores replaced by q · scale as two TP ranks take them: by
    hand, per row; a row-parallel weight's rows per half of its columns (each rank's own
    scales over its shard), every other weight's rows whole."""
    from engine.inference import ModelSource
    from layers.linear import RowParallelLinear
    from tests.test_quantize import QUANTIZED, _by_hand

    cfg, out = ModelSource(str(directory)).load(None)
    model = build_model(inference_config(cfg)).eval()
    rows_split = {
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RowParallelLinear)
    }
    for name, w in list(out.items()):
        if not QUANTIZED.search(name):
            continue
        parts = w.chunk(2, dim=1) if name in rows_split else (w,)
        out[name] = torch.cat([q * scale.unsqueeze(1) for q, scale in map(_by_hand, parts)], 1)
    model.load_full_state_dict(out)
    return model


@pytest.mark.slow
def test_tp2_int8_server_equals_tp1_int8_and_the_per_shard_reference(export, tp2_int8):
    """``--tp-size 2 --quantize int8``. A row-parallel shard takes its per-row scales over
    its own half of the columns (tests/test_quantize.py), so tp 2 int8 is a slightly
    different quantization from tp 1 int8. Its reference is the unsplit float model with
    each weight replaced by q · scale as the two shards take them (built by hand here):
    greedy tokens exact, log-probabilities within TOL (float32 sums in another order: the
    scale applied to the output, not the weight, and the all-reduce; the docstring's
    argument). Against the tp 1 int8 server: the same text (the tiny model's
    top-1 leads by far more than the two quantizations differ); the largest log-probability
    difference is printed, not bounded (a quantization change, not rounding)."""
    directory, tokenizer, _ = export
    reference = _per_shard_reference(directory)
    server = tp2_int8
    worst = 0.0
    with _serving(directory, "--max-running", "4", "--quantize", "int8") as (tp1, _):
        for prompt in PROMPTS[:2]:
            ids = tokenizer.encode(prompt).ids
            new = generate_batch(reference, [ids], 12, GREEDY)[0]
            options = dict(max_tokens=12, temperature=0, logprobs=1)
            split = _completion(server.client, ids, **options).choices[0]
            whole = _completion(tp1, ids, **options).choices[0]
            assert split.text == tokenizer.decode(new) == whole.text
            got = torch.tensor(split.logprobs.token_logprobs, dtype=torch.float64)
            with torch.no_grad():  # the reference's log-probabilities of the new tokens
                logits = reference(torch.tensor([ids + new]))[0, len(ids) - 1 : -1]
            logits = logits[:, : reference.cfg.vocab_size].double().log_softmax(-1)
            expected = logits[torch.arange(len(new)), torch.tensor(new)]
            torch.testing.assert_close(got, expected, **TOL)
            want = torch.tensor(whole.logprobs.token_logprobs, dtype=torch.float64)
            worst = max(worst, float((got - want).abs().max()))
    print(f"largest |tp 2 int8 - tp 1 int8| log-probability: {worst:.2e}")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _rank_pids(pid: int) -> list[int]:
    """The rank processes of the server ``pid``: its spawned children, or the children of
    the forkserver it started (ranks fork from it; see engine.launching)."""
    ranks = []
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline:
            ranks.append(child)
        elif b"forkserver" in cmdline:
            ranks.extend(_children(child))
    return sorted(ranks)


@pytest.mark.slow
@pytest.mark.parametrize("which", [min, max], ids=["first", "last"])
def test_a_killed_rank_stops_every_rank_with_one_line(export, which, request):
    """SIGKILL to the rank started first (rank 0, HTTP) or last (rank 1, following). The
    first is the int8 server, done with its own test (one launch for both: how ranks stop
    does not depend on how the weights are stored); the last a server of its own."""
    server = request.getfixturevalue("tp2_int8") if which is min else _TpServer(export[0])
    try:
        ranks = _rank_pids(server.process.pid)
        assert len(ranks) == 2, ranks
        os.kill(which(ranks), signal.SIGKILL)
        assert server.process.wait(timeout=TIMEOUT) == 1
        lines = [ln for ln in server.final_stderr().splitlines() if not ln.startswith("threads: ")]
        ours = [ln for ln in lines if ln.startswith("serve: ")]
        assert len(ours) == 1, server.stderr()
        assert ours[0].startswith("serve: rank ") and ours[0].endswith("every rank stopped")
        assert "SIGKILL" in ours[0] or "exit code" in ours[0]
    finally:
        server.kill()
