"""Tokenize text, JSONL (plain, .gz, .zst) or Parquet files into a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

Examples::

    python tools/preprocess_data.py --input 'docs/*.txt' --output-prefix data/corpus --vocab-size 8192
    python tools/preprocess_data.py --input 'shards/*.jsonl.zst' --text-key text \\
        --tokenizer data/corpus.tokenizer.json --output-prefix data/a --workers 4
    python tools/preprocess_data.py --input fineweb/ --text-key text --format megatron \\
        --tokenizer data/corpus.tokenizer.json --output-prefix data/fw
    python tools/preprocess_data.py convert data/fw --to meshtron --tokenizer data/corpus.tokenizer.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    from engine.data.indexed import INDEX_FORMATS, convert_index
    from engine.data.preprocess import (
        EOD_TOKEN,
        EncodeWorkerDied,
        load_tokenizer,
        preprocess,
    )
    from engine.tool_args import ArgumentParser, bpe_vocab_size, non_negative_int, positive_int
except KeyboardInterrupt:  # Ctrl-C during the imports: nothing started, no traceback
    print("preprocess_data.py: interrupted; nothing was written", file=sys.stderr)
    sys.exit(130)

# More encoding processes than this is a typo, not a machine (each one is a Python process).
MAX_WORKERS = 1024


def worker_count(text: str) -> int:
    """argparse type of --workers: 1 .. MAX_WORKERS."""
    value = positive_int(text)
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{value} must be <= {MAX_WORKERS}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (``convert``'s when the first argument is ``convert``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        return parse_convert_args(argv[1:])
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="preprocess_data.py convert PREFIX --to FORMAT rewrites an index in the other "
        "format over the same .bin (see convert --help)",
    )
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PATH_OR_GLOB",
        help="text file (one document), JSONL file (.jsonl, .jsonl.gz, .jsonl.zst), Parquet "
        "file, or a folder of Parquet files; globs may use **; repeatable",
    )
    parser.add_argument(
        "--text-key",
        "--json-key",
        dest="text_key",
        default=None,
        help="the key of each JSONL line, or the Parquet column, holding a document "
        "(JSONL and Parquet inputs need it; other files are each one text document)",
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="existing tokenizer.json to use")
    tok.add_argument("--vocab-size", type=bpe_vocab_size, help="train a byte-level BPE this big")
    parser.add_argument(
        "--tokenizer-out",
        default=None,
        help="where to save a trained tokenizer (default PREFIX.tokenizer.json)",
    )
    parser.add_argument(
        "--workers",
        type=worker_count,
        default=min(os.cpu_count() or 1, MAX_WORKERS),
        help="encoding processes (1: in-process, on the tokenizer's thread pool)",
    )
    parser.add_argument(
        "--format",
        choices=INDEX_FORMATS,
        default="meshtron",
        help="index format: meshtron (records the id range and the .bin's SHA-256) or "
        "megatron (read by Megatron-LM / Megatron-Core unchanged)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv, argparse.Namespace(command="tokenize"))
    if args.tokenizer is not None and args.tokenizer_out is not None:
        parser.error("--tokenizer-out saves a trained tokenizer: give it with --vocab-size only")
    return args


def parse_convert_args(argv: list[str]) -> argparse.Namespace:
    """Options of ``convert``: rewrite PREFIX.idx in the other format, the .bin untouched."""
    parser = ArgumentParser(
        prog="preprocess_data.py convert",
        description="Rewrite PREFIX.idx in another index format; PREFIX.bin is not written.",
    )
    parser.add_argument("prefix", help="the PREFIX of PREFIX.bin / PREFIX.idx")
    parser.add_argument("--to", choices=INDEX_FORMATS, required=True, help="format to write")
    eod = parser.add_mutually_exclusive_group()
    eod.add_argument(
        "--eod-id", type=non_negative_int, default=None, help="end-of-document id (to meshtron)"
    )
    eod.add_argument(
        "--tokenizer", default=None, help=f"tokenizer.json whose {EOD_TOKEN} is the eod id"
    )
    return parser.parse_args(argv, argparse.Namespace(command="convert"))


def convert(args: argparse.Namespace) -> int:
    """``convert`` subcommand; return the exit status."""
    try:
        eod_id = args.eod_id
        if args.tokenizer is not None:
            eod_id = load_tokenizer(args.tokenizer).token_to_id(EOD_TOKEN)
        was = convert_index(args.prefix, args.to, eod_id=eod_id)
    except (OSError, ValueError) as e:
        print(f"preprocess_data.py convert: error: {e}", file=sys.stderr)
        return 2
    print(f"rewrote {args.prefix}.idx: {was} -> {args.to} ({args.prefix}.bin unchanged)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit status."""
    args = parse_args(argv)
    if args.command == "convert":
        return convert(args)
    # A plain `kill` cleans up as Ctrl-C does: temp files removed, the lock released.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = preprocess(
            args.input,
            args.output_prefix,
            json_key=args.text_key,
            tokenizer_path=args.tokenizer,
            vocab_size=args.vocab_size,
            tokenizer_out=args.tokenizer_out,
            workers=args.workers,
            progress=not args.no_progress,
            index_format=args.format,
        )
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (OSError, ValueError, EncodeWorkerDied) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        how = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        print(f"preprocess_data.py: interrupted{how}; nothing was written", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(
        f"wrote {result.prefix}.bin/.idx: {result.num_docs} document"
        f"{'s' * (result.num_docs != 1)}, {result.num_tokens} token"
        f"{'s' * (result.num_tokens != 1)} ({args.format} index); tokenizer {result.tokenizer_path} "
        f"({result.vocab_size} ids)"
    )
    for note in result.notes:
        print(f"preprocess_data.py: note: {note}", file=sys.stderr)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signum)


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
