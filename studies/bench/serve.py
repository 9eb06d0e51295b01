"""Serving under load: continuous batching against static batching, on the same requests.

One run, one model, one request list, four ways (each checked against the first):

1. **sequential**: every request alone, greedy, through ``engine.generate.generate_batch``
   (what ``tools/generate.py`` runs): the reference tokens, and batch-1 throughput.
2. **server, continuous**: ``python -m apps.serve`` started as a subprocess on the model
   with ``--max-running B``; ``--clients`` asyncio + httpx clients send the requests over
   HTTP (``/v1/completions``, token-id prompts, ``temperature`` 0, ``ignore_eos``,
   streamed), each client one request at a time until the list is used up. Time to first
   token is each request's, from its send to its first streamed chunk.
   **server, static**: then the same server is sent the same requests in fixed batches of
   B, each asking for its batch's longest max_tokens, the next batch sent when the last
   answer is back: static batching with the same HTTP path and streaming, so the two
   server rows differ only in the scheduling. Its answers are checked to start with the
   sequential text; its throughput counts each request's own max_tokens.
3. **engine, continuous**: the same ``ServingEngine`` in this process, every request
   queued at t0 (``max_running`` B): the scheduler without HTTP.
4. **engine, static**: the same engine over the same paged KV cache and model forward, but
   the requests go in fixed batches of B, in order; every member of a batch runs to the
   batch's longest ``max_tokens`` (then is cut to its own) and the next batch starts when
   it ends: no joining, no early leaving. Only the scheduling differs from 3.
5. **generate_batch, static**: the same fixed batches through ``generate_batch`` (a
   contiguous KV cache, no paged gathers): static batching on tools/generate.py's path.
6. **transformers generate, static**: the model exported to a Hugging Face directory
   (``engine.hf_interop.export_hf``), loaded with ``AutoModelForCausalLM``, and the same
   fixed batches left-padded through ``model.generate`` (greedy, end of sequence off, each
   batch to its longest max_tokens, cut to each one's); its token ids are checked too.

For 3 to 6 time to first token counts from t0, when every request is already queued.
``--rounds N`` runs 3 to 6 in turn N times and reports each one's median round: the load
of a shared machine drifts over minutes, so rows measured one after the other differ by
more than the schedulers do.
Throughput is generated tokens (the sum of the requests' ``max_tokens``: end of sequence
is ignored) ÷ wall time.

Checks, for every request: answered exactly once (by the client's index; the server's
completion ids all distinct), the server's text equal to the decoded sequential tokens and
its completion_tokens to max_tokens; the engine runs' token ids equal to sequential's.

The model is ``--ckpt`` (a training checkpoint or an export; default the quick start's
``checkpoints/gpt_tiny_stdlib/final`` where it exists). Without one, a tiny GPT with random
weights is exported to a temporary folder with a byte-level BPE trained on the embedded
corpus (the standard library's sources); its init std 0.2 gives logits whose top-1 leads
the top-2 by far more than a batch's float32 rounding (tests/test_serve.py's argument).
The prompts are token windows of that corpus text, of mixed lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.tool_args import (
    ArgumentParser,
    add_batching_flags,
    output_dir,
    output_file,
    positive_int,
)
from studies.bench import tiny_gpt

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = ROOT / "checkpoints" / "gpt_tiny_stdlib" / "final"  # its exported model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(
        prog="bench_serve.py",
        description="Serving under load: continuous against static batching, checked "
        "against sequential generation.",
    )
    p.add_argument(
        "--ckpt",
        help="checkpoint or export (default: the quick start's, else "
        "a tiny random GPT built on the fly)",
    )
    p.add_argument("--clients", type=positive_int, default=64, help="concurrent HTTP clients")
    p.add_argument("--requests", type=positive_int, default=512, help="requests in all")
    add_batching_flags(p)  # the engine's; --batch below is its --max-running
    p.add_argument(
        "--batch",
        type=positive_int,
        default=16,
        help="static batch size, and the server's and engine's --max-running",
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="prompt lengths, uniform in MIN..MAX tokens (default 8 96, the MAX lowered to "
        "fit the model's positions with the longest max_tokens)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        nargs="+",
        help="each request's max_tokens is one of these, uniformly (default 8 16 32 64 128, "
        "those over half the model's positions left out)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the request mix")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads, each process")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the in-process batched rows in turn this many times; report each one's "
        "median round",
    )
    p.add_argument("--skip-http", action="store_true", help="no server: the engine rows only")
    built = p.add_argument_group("the model built when there is no checkpoint")
    tiny_gpt.add_size_flags(built)
    built.add_argument("--positions", type=positive_int, default=256)
    built.add_argument(
        "--keep-model", type=output_dir, help="build the model into this folder (kept)"
    )
    p.add_argument("--json", type=output_file, help="write the results and every check here")
    args = p.parse_args(argv)
    if args.prompt_tokens and args.prompt_tokens[0] > args.prompt_tokens[1]:
        p.error(f"--prompt-tokens: MIN {args.prompt_tokens[0]} > MAX {args.prompt_tokens[1]}")
    return args


def fit_mix(args: argparse.Namespace, positions: int) -> None:
    """Fill in the request mix left at its defaults, within the model's ``positions``."""
    if args.max_tokens is None:
        args.max_tokens = [n for n in (8, 16, 32, 64, 128) if 2 * n <= positions] or [1]
    if args.prompt_tokens is None:
        hi = min(96, positions - max(args.max_tokens))
        args.prompt_tokens = [min(8, hi), hi]


# --- the model and the requests -------------------------------------------------------


def corpus_text(max_bytes: int) -> str:
    """The embedded corpus's first ``max_bytes`` of standard-library source, joined."""
    from engine.data.default_corpus import stdlib_sources

    root, files = stdlib_sources(max_bytes)
    return "\n".join((root / rel).read_text(errors="replace") for rel, _ in files)


def build_tiny(directory: Path, args: argparse.Namespace) -> Path:
    """A random GPT exported to ``directory`` with a BPE trained on the corpus."""
    import torch

    from engine.checkpoint.format import write_checkpoint
    from engine.data.preprocess import save_tokenizer, train_tokenizer
    from engine.models import build_model

    text = corpus_text(1_000_000)
    tokenizer = train_tokenizer([text[i : i + 4096] for i in range(0, len(text), 4096)], args.vocab)
    vocab = tokenizer.get_vocab_size()
    cfg = tiny_gpt.config(args, vocab=vocab, positions=args.positions, init_std=0.2)
    cfg.validate()
    torch.manual_seed(3)
    model = build_model(cfg).eval()
    directory.mkdir(parents=True, exist_ok=True)
    write_checkpoint(directory, model.full_state_dict(), cfg)
    save_tokenizer(tokenizer, directory / "tokenizer.json")
    return directory


@dataclass(frozen=True)
class Work:
    """One request of the list: its index, prompt ids and max_tokens."""

    index: int
    prompt: list[int]
    max_tokens: int


def make_requests(codec, args: argparse.Namespace, positions: int) -> list[Work]:
    """``--requests`` token windows of the corpus text, mixed lengths and max_tokens."""
    rng = random.Random(args.seed)
    ids = codec.encode(corpus_text(400_000), special_tokens=False)
    lo, hi = args.prompt_tokens
    out = []
    for i in range(args.requests):
        new = rng.choice(args.max_tokens)
        n = min(rng.randint(lo, hi), positions - new)
        if n < 1:
            raise ValueError(
                f"--max-tokens {new} leaves no room for a prompt in the model's {positions} "
                "positions: pass smaller --max-tokens"
            )
        start = rng.randrange(0, len(ids) - n)
        out.append(Work(i, ids[start : start + n], new))
    return out


# --- the runs -----------------------------------------------------------------------------


@dataclass
class Run:
    """One way of running the list: tokens (or text) per index, times, what went wrong."""

    name: str
    wall: float = 0.0
    generated: int = 0
    ttft: list[float] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)  # every round's, when alternated

    @property
    def rate(self) -> float:
        return self.generated / self.wall if self.wall else 0.0


def _stamper(stamps: list[float]):
    """A generate_batch stop callback that never stops and notes when the first token
    came (the callback runs after every step)."""

    def stop(row: int, new: list[int]) -> bool:
        if not stamps:
            stamps.append(time.perf_counter())
        return False

    return stop


def sequential(model, work: list[Work]) -> Run:
    """Each request alone through generate_batch (tools/generate.py's function)."""
    from engine.generate import Sampling, generate_batch

    run = Run("sequential, batch 1 (generate_batch)")
    greedy = Sampling(greedy=True)
    start = time.perf_counter()
    for w in work:
        t0 = time.perf_counter()
        first: list[float] = []
        run.tokens[w.index] = generate_batch(
            model, [w.prompt], w.max_tokens, greedy, stop=_stamper(first)
        )[0]
        run.ttft.append(first[0] - t0)  # from its own start: alone, it waits for nothing
    run.wall = time.perf_counter() - start
    run.generated = sum(len(t) for t in run.tokens.values())
    return run


def _engine(model, cache, args, waiting: int):
    from apps.serving import ServingEngine

    return ServingEngine(
        model,
        cache,
        max_running=args.batch,
        max_waiting=waiting,
        token_budget=max(args.token_budget, args.batch),
    )


def _drive(engine, run: Run, start: float, want: dict[str, int], seen: set) -> None:
    """Step ``engine`` until idle, recording ``want``'s (request id → index) tokens."""
    while engine.has_work:
        for event in engine.step():
            index = want[event.request_id]
            if event.token is not None:
                if index not in seen:
                    seen.add(index)
                    run.ttft.append(time.perf_counter() - start)
                run.tokens.setdefault(index, []).append(event.token)


def continuous_engine(model, cache, args, work: list[Work]) -> Run:
    """Every request queued at t0 in one engine: requests join and leave at any step."""
    from apps.serving import Request

    run = Run(f"engine, continuous (max running {args.batch})")
    engine = _engine(model, cache, args, len(work))
    start = time.perf_counter()
    want = {
        engine.submit(Request(w.prompt, w.max_tokens, request_id=f"r{w.index}")): w.index
        for w in work
    }
    _drive(engine, run, start, want, set())
    run.wall = time.perf_counter() - start
    run.generated = sum(len(t) for t in run.tokens.values())
    return run


def static_engine(model, cache, args, work: list[Work]) -> Run:
    """Fixed batches of ``--batch`` in the same engine, each member run to the batch's
    longest max_tokens and cut to its own; the next batch starts when one ends."""
    from apps.serving import Request

    run = Run(f"engine, static (batches of {args.batch})")
    engine = _engine(model, cache, args, args.batch)
    seen: set[int] = set()
    start = time.perf_counter()
    for lo in range(0, len(work), args.batch):
        batch = work[lo : lo + args.batch]
        longest = max(w.max_tokens for w in batch)
        want = {
            engine.submit(Request(w.prompt, longest, request_id=f"r{w.index}")): w.index
            for w in batch
        }
        _drive(engine, run, start, want, seen)
    run.wall = time.perf_counter() - start
    for w in work:
        run.tokens[w.index] = run.tokens.get(w.index, [])[: w.max_tokens]
    run.generated = sum(len(t) for t in run.tokens.values())
    return run


def _static(name: str, args, work: list[Work], generate) -> Run:
    """Fixed batches of ``--batch``, each through ``generate(prompts, longest)`` → (each
    prompt's new tokens, when the first came); every member cut to its own max_tokens."""
    run = Run(f"{name}, static (batches of {args.batch})")
    start = time.perf_counter()
    for lo in range(0, len(work), args.batch):
        batch = work[lo : lo + args.batch]
        out, first = generate([w.prompt for w in batch], max(w.max_tokens for w in batch))
        run.ttft += [first - start] * len(batch)
        for w, tokens in zip(batch, out, strict=True):
            run.tokens[w.index] = tokens[: w.max_tokens]
    run.wall = time.perf_counter() - start
    run.generated = sum(len(t) for t in run.tokens.values())
    return run


def static_generate(model, args, work: list[Work]) -> Run:
    """The same fixed batches through generate_batch: left-padded, a contiguous cache."""
    from engine.generate import Sampling, generate_batch

    def generate(prompts, longest):
        stamped: list[float] = []
        greedy = Sampling(greedy=True)
        out = generate_batch(model, prompts, longest, stop=_stamper(stamped), sampling=greedy)
        return out, stamped[0]

    return _static("generate_batch", args, work, generate)


class _FirstToken:
    """A transformers streamer that notes when the first generated token came (its first
    ``put`` is the prompt, the second the first new token)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, _value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def load_hf(ckpt: str, folder: Path):
    """The checkpoint exported to ``folder`` and loaded with transformers (float32, eval);
    a training checkpoint is first exported as a model beside it."""
    from transformers import AutoModelForCausalLM

    from engine.checkpoint.convert import export_model
    from engine.checkpoint.format import META_FILE
    from engine.hf_interop import export_hf

    if not (Path(ckpt) / META_FILE).is_file():  # a training checkpoint (root or step)
        export_model(ckpt, folder.parent / "model")
        ckpt = str(folder.parent / "model")
    export_hf(ckpt, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype="float32").eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as every other row
    model.generation_config.pad_token_id = 0
    return model


def static_transformers(hf_model, args, work: list[Work]) -> Run:
    """The same fixed batches through transformers' ``generate``, left-padded, greedy."""
    import torch

    def generate(prompts, longest):
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        first = _FirstToken()
        with torch.inference_mode():
            out = hf_model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, streamer=first
            )
        return out[:, width:].tolist(), first.at

    return _static("transformers generate", args, work, generate)


# --- the server and its clients -----------------------------------------------------------


def start_server(model_dir: str, args: argparse.Namespace, waiting: int):
    """``python -m apps.serve`` on a free port: (the process, its base URL)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "apps.serve",
        "--ckpt",
        os.path.abspath(model_dir),  # the server runs in the checkout, not where this was run
        "--port",
        "0",
        "--max-running",
        str(args.batch),
        "--max-waiting",
        str(waiting),
        "--block-size",
        str(args.block_size),
        "--token-budget",
        str(args.token_budget),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("serving "):
            return proc, line.split(" on ")[-1].strip()
    proc.wait()
    raise RuntimeError(f"the server exited with {proc.returncode} before serving")


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _client(http, url, model, queue, answers, ttft, problems):
    """One client: take the next request, stream its answer, until the list is empty."""
    while queue:
        w = queue.pop()
        body = {
            "model": model,
            "prompt": w.prompt,
            "max_tokens": w.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.perf_counter()
        first, text, ids, finish = None, [], set(), None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                problems.append(f"request {w.index}: HTTP {resp.status_code}")
                continue
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    problems.append(f"request {w.index}: {chunk['error']}")
                    break
                if first is None:
                    first = time.perf_counter() - sent
                ids.add(chunk["id"])
                for choice in chunk["choices"]:
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        if first is not None:
            ttft.append(first)
        answers.setdefault(w.index, []).append(("".join(text), ids, finish))


async def _load(url: str, work: list[Work], clients: int):
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        # Warm up: one request of the list, not counted (it is asked again below).
        await _client(http, url, model, [work[0]], {}, [], [])
        queue = list(reversed(work))
        answers: dict[int, list] = {}
        ttft: list[float] = []
        problems: list[str] = []
        start = time.perf_counter()
        await asyncio.gather(
            *(_client(http, url, model, queue, answers, ttft, problems) for _ in range(clients))
        )
        wall = time.perf_counter() - start
    return answers, ttft, problems, wall


async def _static_load(url: str, work: list[Work], batch: int):
    """Static batching through the same server: ``batch`` requests sent together, each
    asking for the batch's longest max_tokens, and the next batch sent when all are back
    (the server then never has a request to add to a running batch)."""
    import httpx

    limits = httpx.Limits(max_connections=batch, max_keepalive_connections=batch)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        answers: dict[int, list] = {}
        ttft: list[float] = []
        problems: list[str] = []
        start = time.perf_counter()
        for lo in range(0, len(work), batch):
            group = work[lo : lo + batch]
            longest = max(w.max_tokens for w in group)
            await asyncio.gather(
                *(
                    _client(
                        http, url, model, [replace(w, max_tokens=longest)], answers, ttft, problems
                    )
                    for w in group
                )
            )
        wall = time.perf_counter() - start
    return answers, ttft, problems, wall


def http_load(model_dir: str, args, work: list[Work], codec, reference: Run) -> list[Run]:
    """The server under ``--clients`` concurrent streaming clients (text checked), then
    the same server sent the same requests in static batches of ``--batch``."""
    run = Run(f"server, continuous ({args.clients} clients, max running {args.batch})")
    static = Run(f"server, static (batches of {args.batch})")
    proc, url = start_server(model_dir, args, max(64, args.clients))
    try:
        answers, run.ttft, run.problems, run.wall = asyncio.run(_load(url, work, args.clients))
        print(f"done: {run.name}", flush=True)
        got, static.ttft, static.problems, static.wall = asyncio.run(
            _static_load(url, work, args.batch)
        )
    finally:
        stop_server(proc)
    _check_answers(run, answers, work, codec, reference, exact=True)
    _check_answers(static, got, work, codec, reference, exact=False)
    return [run, static]


def _check_answers(run: Run, answers, work, codec, reference: Run, *, exact: bool) -> None:
    """Each request answered once, to its length, with the sequential tokens' text (a
    static batch's longer answer: starting with it, a cut UTF-8 character aside)."""
    completion_ids: list[str] = []
    for w in work:
        got = answers.get(w.index, [])
        if len(got) != 1:
            run.problems.append(f"request {w.index}: answered {len(got)} times")
            continue
        text, ids, finish = got[0]
        completion_ids += sorted(ids)
        if len(ids) != 1:
            run.problems.append(f"request {w.index}: {len(ids)} completion ids in one stream")
        if finish != "length":
            run.problems.append(f"request {w.index}: finish_reason {finish!r}")
        want = codec.decode(reference.tokens[w.index])
        if text != want if exact else not text.startswith(want.rstrip("\ufffd")):
            run.problems.append(f"request {w.index}: text differs from sequential")
    if len(set(completion_ids)) != len(completion_ids):
        run.problems.append("two requests share a completion id")
    # The tokens asked for (ignore_eos: max_tokens of each answered one; a static batch's
    # extra tokens past a request's own max_tokens are not counted).
    run.generated = sum(w.max_tokens for w in work if len(answers.get(w.index, ())) == 1)


# --- the report ---------------------------------------------------------------------------


def alternate(model, cache, args, work: list[Work], reference: Run, hf_model) -> list[Run]:
    """The four batched in-process runs, in turn, ``--rounds`` times (so a shared machine's
    load drifts over all alike); each one's median round by wall time, its tokens checked
    in every round and its round walls kept."""
    ways = (
        lambda: continuous_engine(model, cache, args, work),
        lambda: static_engine(model, cache, args, work),
        lambda: static_generate(model, args, work),
        lambda: static_transformers(hf_model, args, work),
    )
    rounds: list[list[Run]] = [[] for _ in ways]
    for i in range(args.rounds):
        for way, done in zip(ways, rounds, strict=True):
            run = way()
            check(run, work, reference)
            done.append(run)
            print(f"done: {run.name}, round {i + 1}: {run.wall:.2f} s", flush=True)
    chosen = []
    for done in rounds:
        median = sorted(done, key=lambda r: r.wall)[len(done) // 2]
        median.walls = [r.wall for r in done]
        median.problems = [p for r in done for p in r.problems]
        chosen.append(median)
    return chosen


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def check(run: Run, work: list[Work], reference: Run) -> None:
    """Token ids of every request equal to sequential's (runs that have ids)."""
    if not run.tokens:
        return
    for w in work:
        got = run.tokens.get(w.index)
        if got is None:
            run.problems.append(f"request {w.index}: no tokens")
        elif got != reference.tokens[w.index]:
            run.problems.append(f"request {w.index}: tokens differ from sequential")


def table(runs: list[Run], static: Run) -> str:
    lines = [
        "| run | requests | generated tokens | wall (s) | tokens/s | ÷ engine static | "
        "TTFT p50 (ms) | TTFT p99 (ms) | problems |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {len(r.ttft)} | {r.generated} | {r.wall:.2f} | {r.rate:.0f} | "
            f"{r.rate / static.rate:.2f}x | {_pct(r.ttft, 0.5) * 1e3:.0f} | "
            f"{_pct(r.ttft, 0.99) * 1e3:.0f} | {len(r.problems)} |"
        )
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> dict:
    """Every run and check; returns the results (what --json writes)."""
    import torch

    from apps.serve import build
    from apps.serve import parse_args as serve_args
    from engine.checkpoint.storage import CheckpointError
    from engine.inference import ModelSource

    torch.set_num_threads(args.threads)
    ckpt = args.ckpt or (str(QUICK_START) if QUICK_START.exists() else None)
    with tempfile.TemporaryDirectory() as tmp:
        if ckpt is None:
            folder = Path(args.keep_model) if args.keep_model else Path(tmp) / "tiny_gpt"
            ckpt = str(build_tiny(folder, args))
            origin = f"a random GPT (init std 0.2) built into {folder}"
        else:
            origin = ckpt
        try:
            positions = ModelSource(ckpt).config().max_positions
        except CheckpointError as err:  # neither a checkpoint nor an export: main's one line
            raise ValueError(
                f"--ckpt: {err}; give a training checkpoint (its root or a step directory) "
                "or a model export"
            ) from None
        fit_mix(args, positions)
        cache_tokens = args.batch * (args.prompt_tokens[1] + max(args.max_tokens) + args.block_size)
        app, _ = build(
            serve_args(
                [
                    "--ckpt",
                    ckpt,
                    "--max-running",
                    str(args.batch),
                    "--block-size",
                    str(args.block_size),
                    "--cache-tokens",
                    str(cache_tokens),
                ]
            )
        )
        server = app.state.server
        model, cache, codec = server.engine.model, server.engine.cache, server.codec
        cfg = model.cfg
        work = make_requests(codec, args, cfg.max_positions)
        print(
            f"model: {origin}: {cfg.arch} h={cfg.hidden_size} l={cfg.num_layers} "
            f"heads={cfg.num_heads} V={cfg.vocab_size} positions={cfg.max_positions}, "
            f"{args.threads} torch thread(s) a process",
            flush=True,
        )
        print(
            f"{len(work)} requests: prompts {args.prompt_tokens[0]}..{args.prompt_tokens[1]} "
            f"tokens (mean {statistics.mean(len(w.prompt) for w in work):.1f}), max_tokens "
            f"from {args.max_tokens} (sum {sum(w.max_tokens for w in work)}), greedy",
            flush=True,
        )
        hf_model = load_hf(ckpt, Path(tmp) / "hf")
        # Warm up every path once on a few requests.
        few = work[: min(len(work), 4)]
        sequential(model, few[:1])
        continuous_engine(model, cache, args, few)
        static_transformers(hf_model, args, few)
        reference = sequential(model, work)
        print(f"done: {reference.name}", flush=True)
        runs = []
        if not args.skip_http:
            runs += http_load(ckpt, args, work, codec, reference)
            print(f"done: {runs[-1].name}", flush=True)
        runs += alternate(model, cache, args, work, reference, hf_model)
        runs.append(reference)
    for r in runs:
        if not r.walls:  # the alternated runs checked every round already
            check(r, work, reference)
    static = next(r for r in runs if r.name.startswith("engine, static"))
    print()
    print(table(runs, static))
    served = {r.name.split(" (")[0]: r for r in runs if r.name.startswith("server")}
    if len(served) == 2:
        ratio = served["server, continuous"].rate / served["server, static"].rate
        print(f"over HTTP, continuous ÷ static batching: {ratio:.2f}x")
    for r in runs:
        if len(r.walls) > 1:
            print(f"{r.name}: wall per round " + ", ".join(f"{w:.2f}" for w in r.walls) + " s")
    for r in runs:
        for line in r.problems[:10]:
            print(f"{r.name}: {line}")
    return {
        "model": origin,
        "requests": len(work),
        "runs": [
            {
                "name": r.name,
                "answered": len(r.ttft),
                "generated": r.generated,
                "wall_s": r.wall,
                "tokens_per_s": r.rate,
                "ttft_p50_s": _pct(r.ttft, 0.5),
                "ttft_p99_s": _pct(r.ttft, 0.99),
                "round_walls_s": r.walls,
                "problems": r.problems,
            }
            for r in runs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print the table; 1 when a check failed."""
    args = parse_args(argv)
    try:
        results = run_all(args)
    except ValueError as err:  # a request mix the model cannot hold, a --ckpt no model
        print(f"bench_serve.py: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["problems"] for r in results["runs"]) else 0
