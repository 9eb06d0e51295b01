"""Tokenize text or JSONL files into a meshtron ``PREFIX.bin`` / ``PREFIX.idx`` pair.

Examples::

    python tools/preprocess_data.py --input 'docs/*.txt' --output-prefix data/corpus --vocab-size 8192
    python tools/preprocess_data.py --input a.jsonl --json-key text \\
        --tokenizer data/corpus.tokenizer.json --output-prefix data/a --workers 4
"""

from __future__ import annotations

import argparse
import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import ArgumentParser, positive_int  # noqa: E402
from engine.data.preprocess import preprocess  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PATH_OR_GLOB",
        help="text file (one document) or JSONL file; repeatable",
    )
    parser.add_argument(
        "--json-key",
        default=None,
        help="treat inputs as JSONL, one document per line under this key",
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", default=None, help="existing tokenizer.json to use")
    tok.add_argument(
        "--vocab-size", type=positive_int, default=None, help="train a byte-level BPE of this size"
    )
    parser.add_argument(
        "--tokenizer-out",
        default=None,
        help="where to save a trained tokenizer (default PREFIX.tokenizer.json)",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=os.cpu_count() or 1,
        help="encoding processes (1: in-process, on the tokenizer's thread pool)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit status."""
    args = parse_args(argv)
    try:
        result = preprocess(
            args.input,
            args.output_prefix,
            json_key=args.json_key,
            tokenizer_path=args.tokenizer,
            vocab_size=args.vocab_size,
            tokenizer_out=args.tokenizer_out,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except (OSError, ValueError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("preprocess_data.py: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(
        f"wrote {result.prefix}.bin/.idx: {result.num_docs} documents, "
        f"{result.num_tokens} tokens; tokenizer {result.tokenizer_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
