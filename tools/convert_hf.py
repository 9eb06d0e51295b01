"""Convert between Hugging Face directories (GPT-2, BERT, Llama, Mistral, Qwen2) and meshtron
checkpoints.

    python tools/convert_hf.py import --hf-dir ./gpt2 --out checkpoints/gpt2
    python tools/convert_hf.py export --ckpt checkpoints/gpt2 --out ./gpt2-again

Import reads a local ``save_pretrained`` directory (config.json + safetensors weights) of
a GPT2LMHeadModel or BertForPreTraining; the checkpoint loads at any TP size. Export
writes config.json + model.safetensors that transformers' from_pretrained reads, into a
new or empty directory, with the tokenizer (tokenizer.json, tokenizer_config.json,
special_tokens_map.json: AutoTokenizer opens it) when the checkpoint carries one; an import
followed by an export reproduces every tensor bit for bit. A bad input ends in one ``convert_hf.py: error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.checkpoint.convert import announce_large  # noqa: E402
from engine.checkpoint.storage import CheckpointError  # noqa: E402
from engine.checkpoint.tokenizer import TOKENIZER_FILE  # noqa: E402
from engine.hf_interop import export_hf, import_hf, read_hf_config  # noqa: E402
from engine.tool_args import ArgumentParser  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> meshtron checkpoint")
    imp.add_argument("--hf-dir", required=True, help="local save_pretrained directory")
    imp.add_argument("--out", required=True, help="meshtron checkpoint directory to write")
    exp = sub.add_parser("export", help="meshtron checkpoint -> Hugging Face directory")
    exp.add_argument(
        "--ckpt",
        required=True,
        help="a model export (ROOT/final, export-model's) or a training checkpoint root or step",
    )
    exp.add_argument("--out", required=True, help="Hugging Face directory to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen conversion and print what was converted; exit 2 on a bad input."""
    args = parse_args(argv)
    announce_large(args.hf_dir if args.command == "import" else args.ckpt)
    try:
        if args.command == "import":
            cfg = import_hf(args.hf_dir, args.out)
        else:
            cfg = export_hf(args.ckpt, args.out)
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (OSError, ValueError, KeyError, CheckpointError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"convert_hf.py: error: {message}", file=sys.stderr)
        return 2
    tokenizer = "with tokenizer" if (Path(args.out) / TOKENIZER_FILE).is_file() else "no tokenizer"
    hf_dir = args.hf_dir if args.command == "import" else args.out
    hf_class = read_hf_config(hf_dir).get("architectures", ["?"])[0]
    experts = f", {cfg.moe_num_experts} experts top-{cfg.moe_top_k}" if cfg.mlp == "moe" else ""
    print(
        f"{args.command}ed {cfg.arch} ({hf_class}): {cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_heads} heads{experts}, vocab {cfg.vocab_size}, "
        f"{tokenizer} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
