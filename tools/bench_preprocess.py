"""Preprocessing throughput: tokens/s of ``preprocess`` for the same documents as text files,
JSONL (plain, .gz, .zst) and Parquet, with 1 and more worker processes.

The documents are the running Python's standard-library sources (the embedded corpus's
text), so the run needs no download. Each encoding process is single-threaded
(``TOKENIZERS_PARALLELISM=false``). Besides wall-clock tokens/s the table gives tokens per
CPU-second (this process and its workers): what one core delivers when it is not shared,
which a machine busy with other jobs cannot show in wall time.

    python tools/bench_preprocess.py --max-bytes 8000000 --workers 1 2 --rounds 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before the tokenizers library starts its thread pool: one thread per worker process.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.data.default_corpus import stdlib_sources  # noqa: E402
from engine.data.preprocess import (  # noqa: E402
    expand_inputs,
    iter_documents,
    preprocess,
    save_tokenizer,
    train_tokenizer,
)
from engine.tool_args import ArgumentParser, bpe_vocab_size, positive_int  # noqa: E402

FORMATS = ("text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet")


def write_corpus(texts: list[str], directory: Path) -> dict[str, tuple[str, str | None]]:
    """The texts in every format: format -> (--input, --text-key)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (directory / "text").mkdir()
    for i, text in enumerate(texts):
        (directory / "text" / f"{i:05d}.txt").write_text(text, encoding="utf-8")
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (directory / "c.jsonl").write_bytes(lines)
    (directory / "c.jsonl.gz").write_bytes(gzip.compress(lines, compresslevel=6))
    (directory / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    pq.write_table(pa.table({"text": texts}), directory / "c.parquet", compression="snappy")
    inputs = {"text": (str(directory / "text" / "*.txt"), None)}
    inputs.update({f: (str(directory / f"c.{f}"), "text") for f in FORMATS[1:]})
    return inputs


def measure(source: tuple[str, str | None], tokenizer: str, workers: int, out: Path) -> dict:
    """One run: wall and CPU seconds (this process and its reaped workers), tokens, and the
    seconds of a read-only pass over the same input."""
    pattern, key = source
    start = time.perf_counter()
    for _ in iter_documents(expand_inputs([pattern]), json_key=key):
        pass
    read_s = time.perf_counter() - start
    cpu0 = _cpu_seconds()
    start = time.perf_counter()
    result = preprocess(
        [pattern],
        str(out),
        json_key=key,
        tokenizer_path=tokenizer,
        workers=workers,
        progress=False,
    )
    wall = time.perf_counter() - start
    return {
        "read_s": read_s,
        "wall": wall,
        "cpu": _cpu_seconds() - cpu0,
        "tokens": result.num_tokens,
        "load": os.getloadavg()[0],
    }


def _cpu_seconds() -> float:
    # Workers count once the pool has reaped them, which it has when preprocess returns.
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _table(runs: dict[tuple[str, int], list[dict]]) -> str:
    rows = [
        "| input | workers | tokens | wall s, median | tokens/s (wall) | tokens/s per worker "
        "(wall) | tokens per CPU-second | read-only pass, s | load average during |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (fmt, workers), done in runs.items():
        tokens = done[0]["tokens"]
        wall = statistics.median(r["wall"] for r in done)
        cpu = statistics.median(r["cpu"] for r in done)
        read_s = statistics.median(r["read_s"] for r in done)
        loads = [r["load"] for r in done]
        rows.append(
            f"| {fmt} | {workers} | {tokens:,} | {wall:.2f} | {tokens / wall:,.0f} | "
            f"{tokens / wall / workers:,.0f} | {tokens / cpu:,.0f} | {read_s:.2f} | "
            f"{min(loads):.1f}–{max(loads):.1f} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-bytes", type=positive_int, default=8_000_000, help="bytes of stdlib sources to use"
    )
    parser.add_argument(
        "--vocab-size",
        type=bpe_vocab_size,
        default=8192,
        help="BPE trained on the first 2 MB (the default corpus's size)",
    )
    parser.add_argument("--workers", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=positive_int, default=3, help="median of this many")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a Markdown table."""
    args = parse_args(argv)
    root, files = stdlib_sources(args.max_bytes)
    texts = [(root / rel).read_text(encoding="utf-8", errors="replace") for rel, _ in files]
    if not any(texts):
        print(
            f"bench_preprocess.py: --max-bytes {args.max_bytes} takes only empty files of "
            f"{root}; give more bytes (the default is 8000000)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        inputs = write_corpus(texts, directory)
        head, size = [], 0
        for text in texts:  # the tokenizer is not what is measured: train it on a part
            head.append(text)
            size += len(text)
            if size > 2_000_000:
                break
        tokenizer = directory / "tok.json"
        save_tokenizer(train_tokenizer(head, args.vocab_size), tokenizer)
        megabytes = sum(len(t.encode()) for t in texts) / 1e6
        print(
            f"{len(texts)} documents, {megabytes:.1f} MB of text, BPE-{args.vocab_size}; "
            f"load average {os.getloadavg()[0]:.1f} at start"
        )
        cases = [(fmt, w) for fmt in args.formats for w in args.workers]
        runs: dict[tuple[str, int], list[dict]] = {case: [] for case in cases}
        # Round-robin, so that a change in the machine's load falls on every case alike.
        for _ in range(args.rounds):
            for fmt, workers in cases:
                runs[fmt, workers].append(
                    measure(inputs[fmt], str(tokenizer), workers, directory / "o")
                )
        counts = {done[0]["tokens"] for done in runs.values()}
        if len(counts) != 1:  # the same documents must give the same tokens in every format
            raise SystemExit(f"bench_preprocess.py: token counts differ by input: {counts}")
        print(_table(runs))
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
