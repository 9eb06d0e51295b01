"""apps.serve: the OpenAI-compatible server, driven by the real ``openai`` client.

Each server runs in this process (uvicorn on a thread, on a free port) over a tiny random
GPT exported to a temporary directory with a byte-level BPE tokenizer, built by the CLI's
own ``build`` from its arguments. The references are independent of the server:
``engine.generate.generate_batch`` (what ``tools/generate.py`` runs) and the tool itself
for the tokens, one plain forward for the log-probabilities.

Tolerance. Tokens and text are compared exactly: init_std 0.2 gives logits of order 1
whose top-1 leads the top-2 by far more than the float32 rounding a batch can change
(tests/test_serving.py measures both). Log-probabilities against the plain forward:
atol = rtol = 1e-5, as there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine.checkpoint.format import write_checkpoint
from engine.generate import Sampling, generate_batch
from engine.models import build_model
from tests.multiproc import subprocess_env
from tests.threads_util import torch_threads
from tests.torch_reference import tiny_gpt

ROOT = Path(__file__).resolve().parents[1]

TOL = dict(atol=1e-5, rtol=1e-5)  # float32, batch-dependent summation order (docstring)
GREEDY = Sampling(greedy=True)
PROMPTS = ["def add(a, b):", "return", "class Point:\n    x", "import os"]
TIMEOUT = 20  # seconds, for every client call: a failure, never a hang
CHAT = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: intra-op threads waiting for a shared core only slow them."""
    with torch_threads(1):
        yield


def make_export(directory: Path):
    """The tiny GPT exported to ``directory`` with its tokenizer, and a chat template
    beside it: (directory, tokenizer, the model before export)."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = "def add(a, b):\n    return a + b\nclass Point:\n    x = 1\nimport os\n"
    tokenizer.train_from_iterator([text] * 20, trainer)
    cfg = tiny_gpt(tokenizer.get_vocab_size(), max_positions=128, init_std=0.2)
    torch.manual_seed(3)
    model = build_model(cfg).eval()
    write_checkpoint(directory, model.full_state_dict(), cfg)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory.parent / "chat.jinja").write_text(CHAT)
    return directory, tokenizer, model


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(export directory, tokenizer, the model before export)."""
    return make_export(tmp_path_factory.mktemp("serve") / "tiny")


@contextlib.contextmanager
def _serving(directory, *options: str):
    """Serve the export with the CLI's options: (an openai client, the routes' state)."""
    from apps.serve import build, parse_args

    app, _ = build(parse_args(["--weights", str(directory), "--cache-tokens", "1024", *options]))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    client = openai.OpenAI(base_url=url, api_key="none", timeout=TIMEOUT, max_retries=0)
    try:
        yield client, app.state.server
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def served(export):
    """The main server: no chat template, 4 running, 8 waiting."""
    with _serving(export[0], "--max-running", "4", "--max-waiting", "8") as pair:
        yield pair


def _completion(client, prompt, **kwargs):
    return client.completions.create(model="tiny", prompt=prompt, **kwargs)


def _idle(state, deadline_s: float = TIMEOUT) -> None:
    """Wait until the engine holds nothing (what a cancellation must lead to)."""
    deadline = time.monotonic() + deadline_s
    engine = state.engine
    while engine.running or engine.waiting or engine.cache.used_blocks:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.02)


def test_greedy_completion_equals_generate_and_the_tool(served, export, capsys):
    from apps.generate_text import main as generate_main

    client, _ = served
    directory, tokenizer, model = export
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        reference = generate_batch(model, [ids], 12, GREEDY)[0]
        answer = _completion(client, prompt, max_tokens=12, temperature=0)
        choice = answer.choices[0]
        assert choice.text == tokenizer.decode(reference) and choice.finish_reason == "length"
        assert answer.usage.completion_tokens == 12 and answer.usage.prompt_tokens == len(ids)
        by_ids = _completion(client, ids, max_tokens=12, temperature=0)  # a token-list prompt
        assert by_ids.choices[0].text == choice.text
    batch = _completion(client, PROMPTS[:2], max_tokens=12, temperature=0, n=2)  # 2 × 2
    alone = [
        _completion(client, p, max_tokens=12, temperature=0).choices[0].text for p in PROMPTS[:2]
    ]
    assert [(c.index, c.text) for c in batch.choices] == list(
        enumerate(alone[:1] * 2 + alone[1:2] * 2)
    )
    argv = ["--ckpt", str(directory), "--prompt", PROMPTS[0], "--greedy", "--max-new-tokens", "12"]
    assert generate_main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    text = _completion(client, PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    assert printed == ["--- sample 1 ---", *(PROMPTS[0] + text).splitlines()]


def test_echo_and_logprobs_equal_a_full_forward(served, export):
    """echo + logprobs, with max_tokens 0 (log-likelihood) and with new tokens."""
    client, _ = served
    _, tokenizer, model = export
    ids = tokenizer.encode(PROMPTS[2]).ids
    scored = _completion(client, ids, max_tokens=0, echo=True, logprobs=2).choices[0]
    assert scored.text == tokenizer.decode(ids) and scored.finish_reason == "length"
    more = _completion(client, ids, max_tokens=5, echo=True, logprobs=1, temperature=0)
    new = generate_batch(model, [ids], 5, GREEDY)[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids + new]))[0, :-1, : model.cfg.vocab_size]
    expected = torch.log_softmax(logits, -1)[
        torch.arange(len(ids) + 4), torch.tensor(ids + new)[1:]
    ]
    for choice, count in ((scored, len(ids)), (more.choices[0], len(ids) + 5)):
        logprobs = choice.logprobs
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.tokens == [tokenizer.decode([t]) for t in (ids + new)[:count]]
        got = torch.tensor(logprobs.token_logprobs[1:])
        torch.testing.assert_close(got, expected[: count - 1], **TOL)
    tops = more.choices[0].logprobs.top_logprobs[len(ids) :]
    assert [list(top) for top in tops] == [[tokenizer.decode([t])] for t in new]  # greedy
    assert more.choices[0].text == tokenizer.decode(ids) + tokenizer.decode(new)


def test_streamed_chunks_add_up_to_the_answer(served):
    client, _ = served
    cases = [
        dict(prompt=PROMPTS[0], max_tokens=20, temperature=0),
        dict(prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=["= =", "&"]),
        dict(prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=5, n=2, logprobs=1),
        dict(prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True),
    ]
    for case in cases:
        whole = _completion(client, **case)
        texts, reasons = {}, {}
        for chunk in _completion(client, stream=True, **case):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
        assert texts == {c.index: c.text for c in whole.choices}, case
        assert reasons == {c.index: c.finish_reason for c in whole.choices}, case
    stopped = _completion(client, **cases[1]).choices[0]
    plain = _completion(client, **{**cases[1], "stop": None}).choices[0].text
    cut = min(plain.find(s) for s in ("= =", "&") if s in plain)  # present: checked
    assert stopped.text == plain[:cut] and stopped.finish_reason == "stop"


def test_concurrent_requests_each_get_what_they_get_alone(served):
    client, state = served
    jobs = [(p, 8 + 3 * i) for i, p in enumerate(PROMPTS)] * 2  # 8 requests, 4 running
    alone = [_completion(client, p, max_tokens=n, temperature=0).choices[0].text for p, n in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(
            pool.map(
                lambda job: _completion(client, job[0], max_tokens=job[1], temperature=0),
                jobs,
            )
        )
    assert [a.choices[0].text for a in together] == alone
    _idle(state)


def test_seeds_reproduce_and_equal_generate(served, export):
    client, _ = served
    _, tokenizer, model = export
    options = dict(max_tokens=16, temperature=0.9, top_p=0.95, extra_body={"top_k": 40})
    first = _completion(client, PROMPTS[0], seed=123, **options).choices[0].text
    assert _completion(client, PROMPTS[0], seed=123, **options).choices[0].text == first
    assert _completion(client, PROMPTS[0], seed=124, **options).choices[0].text != first
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=123)
    ids = generate_batch(model, [tokenizer.encode(PROMPTS[0]).ids], 16, sampling)[0]
    assert first == tokenizer.decode(ids)
    # A list of prompts numbers its choices' seeds on across the prompts, as n does for
    # one: the same prompt twice gives two samples, seeds 123 and 124 (each prompt drew
    # seed 123, the same sample, until the seeds ran over the whole list).
    twice = _completion(client, [PROMPTS[0]] * 2, seed=123, **options).choices
    prompt = tokenizer.encode(PROMPTS[0]).ids
    second = generate_batch(model, [prompt], 16, dataclasses.replace(sampling, seed=124))[0]
    assert [c.text for c in twice] == [first, tokenizer.decode(second)] and second != ids
    # Without a seed, each request draws a fresh one, and so does each prompt of a list.
    unseeded = {_completion(client, PROMPTS[0], **options).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1
    listed = _completion(client, [PROMPTS[0]] * 3, **options).choices
    assert len({c.text for c in listed}) > 1


@pytest.mark.parametrize(
    "body, words",
    [
        ('{"model": "tiny", "prompt": "x"', "JSON"),
        ({"model": "tiny", "prompt": "x", "colour": 1}, "colour: Extra inputs are not permitted"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature must be >= 0"),
        ('{"model": "tiny", "prompt": "x", "top_p": NaN}', "top_p must be in (0, 1]"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens must be >= 0"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 500}, "the model has 128"),
        ({"model": "tiny", "prompt": [1, 99999]}, "prompt token ids must be in 0 .."),
        ({"model": "tiny", "prompt": ""}, "encodes to no tokens"),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n must be in 1 .. 16"),
        ({"model": "tiny", "prompt": "x", "logprobs": 50}, "logprobs must be in 0 .. 20"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 1}, "presence_penalty is not"),
        ({"prompt": "x"}, "model: Field required"),
    ],
)
def test_bad_requests_get_400_with_one_line_and_the_server_goes_on(served, body, words):
    client, _ = served
    url = f"{client.base_url}completions"
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    answer = httpx.post(url, content=content, headers=headers, timeout=TIMEOUT)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and words in message and "\n" not in message, message
    assert _completion(client, "x", max_tokens=2).choices[0].finish_reason == "length"


def test_unknown_model_is_404_and_chat_without_a_template_is_400(served):
    client, _ = served
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_a_runs_final_export_is_served_under_the_runs_name(export, tmp_path):
    """A run's ``ROOT/final`` (beside its ``latest`` pointer) is called ROOT, not "final";
    a folder outside a run keeps its own name, and --served-model-name wins over both."""
    from apps.serve import build, parse_args

    root = tmp_path / "my_run"
    shutil.copytree(export[0], root / "final")
    (root / "latest").write_text("step_00000001\n")
    alone = shutil.copytree(export[0], tmp_path / "weights")

    def name(*argv):
        app, _ = build(parse_args([*argv, "--cache-tokens", "256"]))
        return app.state.server.model_name

    assert name("--weights", str(root / "final")) == "my_run"
    assert name("--ckpt", str(root / "final")) == "my_run"
    assert name("--weights", str(alone)) == "weights"
    assert name("--weights", str(root / "final"), "--served-model-name", "x") == "x"


def test_a_cache_past_the_free_memory_is_refused_before_it_is_allocated(export):
    """10^12 tokens of the tiny model's keys and values (hundreds of TB) exceed any
    machine's free memory: one line naming the flag, not an allocator's traceback."""
    from apps.serve import build, parse_args

    with pytest.raises(ValueError, match=r"^a KV cache of 1000000000000 tokens takes ") as err:
        build(parse_args(["--weights", str(export[0]), "--cache-tokens", str(10**12)]))
    assert str(err.value).endswith(
        "lower --cache-tokens (by default --max-running × the model's positions)"
    )


def test_chat_completes_and_streams_with_a_template(export):
    """The --chat-template flag; the same reply streamed and whole."""
    directory, tokenizer, model = export
    template = str(directory.parent / "chat.jinja")
    with _serving(directory, "--chat-template", template) as (client, _):
        messages = [{"role": "user", "content": "def add"}]
        answer = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True
        )
        prompt = tokenizer.encode("<user>def add\n<assistant>", add_special_tokens=False).ids
        reference = tokenizer.decode(generate_batch(model, [prompt], 10, GREEDY)[0])
        message = answer.choices[0].message
        assert message.role == "assistant" and message.content == reference
        assert len(answer.choices[0].logprobs.content) == 10
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference
        assert chunks[-1].choices[0].finish_reason == "length"


def test_tokenizer_config_gives_the_template_and_the_end_of_sequence(export, tmp_path):
    """A tokenizer_config.json beside the weights: its chat template serves chat, and its
    eos_token ends a completion (kept as its last token) unless ignore_eos."""
    import shutil

    directory, tokenizer, model = export
    ids = tokenizer.encode(PROMPTS[0]).ids
    reference = generate_batch(model, [ids], 10, GREEDY)[0]
    eos = reference[3]
    end = reference.index(eos) + 1  # the first time it comes
    copy = tmp_path / "tiny"
    shutil.copytree(directory, copy)
    config = {"chat_template": CHAT, "eos_token": tokenizer.id_to_token(eos)}
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with _serving(copy) as (client, _):
        stopped = _completion(client, ids, max_tokens=10, temperature=0).choices[0]
        assert stopped.finish_reason == "stop"
        assert stopped.text == tokenizer.decode(reference[:end])
        further = _completion(
            client, ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert further.choices[0].text == tokenizer.decode(reference)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "x"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason in ("stop", "length")


def _metrics(client) -> dict[str, float]:
    text = httpx.get(f"{client.base_url}".replace("/v1/", "/metrics"), timeout=TIMEOUT).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or sample.name.endswith("_count")
    }


def test_metrics_count_the_tokens_generated(served):
    client, state = served
    _idle(state)
    before = _metrics(client)
    answer = _completion(client, PROMPTS[0], max_tokens=7, n=2, temperature=0)
    after = _metrics(client)
    assert answer.usage.completion_tokens == 14
    assert (
        after["meshtron_generated_tokens_total"] - before["meshtron_generated_tokens_total"] == 14
    )
    ttft = "meshtron_time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == 2
    assert after["meshtron_queue_depth"] == after["meshtron_running_sequences"] == 0
    assert after["meshtron_kv_blocks_in_use"] == 0
    assert after["meshtron_kv_blocks"] == state.engine.cache.num_blocks
    assert httpx.get(f"{client.base_url}".replace("/v1/", "/health")).json() == {"status": "ok"}


def test_a_client_that_disconnects_frees_its_blocks(served, monkeypatch):
    client, state = served
    # Each engine step takes at least 10 ms here, so 100 tokens take over a second: far
    # longer than a client timeout of 0.05 s plus one disconnect poll (DISCONNECT_POLL_S),
    # however fast the machine (idle, the tiny model generated all 100 within one poll).
    step = state.engine.step
    monkeypatch.setattr(state.engine, "step", lambda: (time.sleep(0.01), step())[1])
    _idle(state)
    before = _metrics(client)["meshtron_generated_tokens_total"]
    stream = _completion(client, PROMPTS[0], max_tokens=100, temperature=0, stream=True)
    for _, _ in zip(range(2), stream, strict=False):
        pass
    assert state.engine.cache.used_blocks > 0
    stream.close()
    _idle(state)
    assert _metrics(client)["meshtron_generated_tokens_total"] - before < 100
    # A non-streamed request whose client gives up: cancelled at the next disconnect check.
    before = _metrics(client)["meshtron_generated_tokens_total"]
    impatient = client.with_options(timeout=0.05)
    with pytest.raises(openai.APITimeoutError):
        _completion(impatient, PROMPTS[0], max_tokens=100, temperature=0)
    _idle(state)
    assert _metrics(client)["meshtron_generated_tokens_total"] - before < 100


def test_a_full_queue_answers_429_with_the_reason(export):
    with _serving(export[0], "--max-running", "1", "--max-waiting", "1") as (client, state):
        running = _completion(client, PROMPTS[0], max_tokens=100, stream=True)
        next(iter(running))  # its first token: it holds the one running slot
        waiting = _completion(client, PROMPTS[1], max_tokens=100, stream=True)  # accepted
        with pytest.raises(openai.RateLimitError, match="1 requests are already waiting"):
            _completion(client, PROMPTS[2], max_tokens=4)
        running.close()
        waiting.close()
        _idle(state)
        assert _completion(client, PROMPTS[2], max_tokens=4).choices[0].finish_reason == "length"


@pytest.mark.slow
def test_the_command_prints_the_cache_serves_and_drains_on_sigterm(export):
    """``python -m apps.serve`` as the README runs it, in its own process."""
    directory, tokenizer, model = export
    argv = ["--weights", str(directory), "--port", "0", "--cache-tokens", "256"]
    process = subprocess.Popen(
        [sys.executable, "-m", "apps.serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(ROOT),
        cwd=ROOT,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in process.stdout], daemon=True).start()
    try:
        cache = lines.get(timeout=60)
        # 2 layers × (keys, values) × 256 tokens × 32 wide × 4 bytes = 0.125 MiB
        assert cache.strip() == (
            "KV cache: 16 blocks × 16 tokens = 256 tokens, 0.12 MiB (torch.float32, 4 KV heads × 8)"
        )
        address = lines.get(timeout=TIMEOUT).split()[-1]
        assert lines.empty() and address.startswith("http://127.0.0.1:")
        client = openai.OpenAI(
            base_url=f"{address}/v1", api_key="-", timeout=TIMEOUT, max_retries=0
        )
        # In flight at SIGTERM (its first token is out), answered in full: the server
        # drains, then exits 0.
        stream = _completion(client, PROMPTS[0], max_tokens=100, temperature=0, stream=True)
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        process.send_signal(signal.SIGTERM)
        text += "".join(chunk.choices[0].text for chunk in chunks)
        ids = generate_batch(model, [tokenizer.encode(PROMPTS[0]).ids], 100, GREEDY)[0]
        assert text == tokenizer.decode(ids)
        assert process.wait(timeout=TIMEOUT) == 0, process.stderr.read()
    finally:
        process.kill()
        process.wait(timeout=TIMEOUT)


def test_the_command_refuses_a_bad_tp_and_a_bad_source_in_one_line(export, tmp_path, capsys):
    from apps.serve import main

    assert main(["--weights", str(export[0]), "--tp-size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "serve: model.num_heads=4 is not divisible by --tp-size 3"
    assert main(["--weights", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("serve: ") and str(tmp_path) in err


def test_detokenizer_holds_back_what_a_stop_or_a_split_character_could_change(export):
    from apps.serving.text import Detokenizer, TextCodec

    _, tokenizer, _ = export
    codec = TextCodec(tokenizer)
    ids = tokenizer.encode("é = 1\nx = 2\n").ids  # é: two bytes, maybe two tokens
    pieces, detokenizer = [], Detokenizer(codec, stops=["x ="])
    for token in ids:
        pieces.append(detokenizer.add(token))
        assert "\ufffd" not in pieces[-1]  # never half a character
        if detokenizer.stopped:
            break
    assert "".join(pieces) == detokenizer.text == "é = 1\n" and detokenizer.stopped
    assert codec.decode(ids[: detokenizer.kept_tokens()]) == "é = 1\n"  # the tokens of the text
    plain = Detokenizer(codec)
    assert "".join(plain.add(t) for t in ids) + plain.finish() == "é = 1\nx = 2\n"


def _metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer: its decoder drops the word marker of the first
    token, so a token's text depends on what precedes it."""
    from tokenizers import decoders

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["héllo wörld, 日本語 the end of it"] * 20, trainer)
    return tokenizer


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_incremental_detokenizer_adds_up_to_the_whole_decode(export, kind):
    """The streamed pieces (each token decodes only a short window) concatenate to the
    decode of all the tokens, and a stop string cuts where decoding every prefix whole
    first shows it. Random ids: byte-level ones split UTF-8 characters across tokens."""
    from apps.serving.text import Detokenizer, TextCodec

    tokenizer = export[1] if kind == "byte-level" else _metaspace_tokenizer()
    codec = TextCodec(tokenizer)
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        ids = torch.randint(1, tokenizer.get_vocab_size(), (40,), generator=generator).tolist()
        whole = tokenizer.decode(ids)
        stop = whole[len(whole) // 2 : len(whole) // 2 + 2] if trial % 2 else ""
        detokenizer = Detokenizer(codec, [stop])
        pieces = []
        for token in ids:
            pieces.append(detokenizer.add(token))
            if detokenizer.stopped:
                break
        pieces.append(detokenizer.finish())
        expected = whole
        if stop:  # the reference: decode every prefix whole, cut at the first stop seen
            expected = next(
                text[: text.find(stop)]
                for text in (tokenizer.decode(ids[: k + 1]) for k in range(len(ids)))
                if stop in text
            )
        assert "".join(pieces) == detokenizer.text == expected, (kind, trial)
