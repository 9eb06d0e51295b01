"""Preprocessing throughput: tokens/s of ``preprocess`` for the same documents as text files,
JSONL (plain, .gz, .zst) and Parquet, with 1 and more worker processes.

The documents are the running Python's standard-library sources (the embedded corpus's
text), so the run needs no download. Each encoding process is single-threaded
(``TOKENIZERS_PARALLELISM=false``), so tokens/s divided by the workers is per core.

    python tools/bench_preprocess.py --max-bytes 8000000 --workers 1 2 --rounds 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before the tokenizers library starts its thread pool: one thread per worker process.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import ArgumentParser, positive_int  # noqa: E402
from engine.data.default_corpus import stdlib_sources  # noqa: E402
from engine.data.preprocess import (  # noqa: E402
    expand_inputs,
    iter_documents,
    preprocess,
    save_tokenizer,
    train_tokenizer,
)

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
    """One run: read-only pass seconds, then preprocess seconds and tokens."""
    pattern, key = source
    start = time.perf_counter()
    for _ in iter_documents(expand_inputs([pattern]), json_key=key):
        pass
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    result = preprocess(
        [pattern], str(out), json_key=key, tokenizer_path=tokenizer, workers=workers, progress=False
    )
    return {"read_s": read_s, "seconds": time.perf_counter() - start, "tokens": result.num_tokens}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-bytes", type=positive_int, default=8_000_000, help="bytes of stdlib sources to use"
    )
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
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
        print(
            "| input | workers | tokens | seconds (median) | tokens/s | tokens/s per worker "
            "| read-only pass, s |\n|---|---|---|---|---|---|---|"
        )
        for fmt in args.formats:
            for workers in args.workers:
                runs = [
                    measure(inputs[fmt], str(tokenizer), workers, directory / "o")
                    for _ in range(args.rounds)
                ]
                seconds = statistics.median(r["seconds"] for r in runs)
                read_s = statistics.median(r["read_s"] for r in runs)
                tokens = runs[0]["tokens"]
                print(
                    f"| {fmt} | {workers} | {tokens:,} | {seconds:.2f} | {tokens / seconds:,.0f} "
                    f"| {tokens / seconds / workers:,.0f} | {read_s:.2f} |",
                    flush=True,
                )
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
