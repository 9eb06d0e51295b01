"""Sample text from a trained meshtron model, an exported model or a Hugging Face directory.

    python -m apps.generate_text --ckpt checkpoints/gpt_tiny_stdlib --prompt "def "
    python tools/generate.py --ckpt checkpoints/gpt_tiny_stdlib --prompt "def " --prompt "class "
    python tools/generate.py --ckpt checkpoints/gpt_tiny_stdlib/final --tp-size 2 --greedy
    python tools/generate.py --hf-dir ./gpt2 --tokenizer ./gpt2/tokenizer.json --prompt "Hello"

Loads the weights at any --tp-size: it starts that many local ranks itself (under torchrun
each process is one rank). Prompts run as one left-padded batch with a KV cache; each
continuation is printed after its prompt, and the speed goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields

from engine.checkpoint.storage import CheckpointError
from engine.config import sized_dims
from engine.data.fsutil import tokenizer_file
from engine.generate import Sampling
from engine.inference import ModelSource
from engine.models.families import FAMILIES, decoders
from engine.tool_args import (
    ArgumentParser,
    add_quantize_flag,
    in_flags,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    seed_int,
)

DTYPES = ("float32", "float64", "bfloat16")
# The families that generate: the decoders (read from the table, not listed here).
CAUSAL = ", ".join(arch for arch, f in FAMILIES.items() if f.causal)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(
        prog="generate",
        description=f"{__doc__.split(chr(10) * 2)[0]} Families: {CAUSAL} (model.arch).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="training checkpoint root (or step dir) or model export dir")
    src.add_argument("--hf-dir", help=f"local Hugging Face directory of a {CAUSAL} model")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one saved with the data)")
    p.add_argument(
        "--prompt",
        action="append",
        type=non_empty,
        required=True,
        help="repeatable: one per sample",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel ranks to start")
    p.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.8,
        help="finite, >= 0; 0: argmax, as --greedy (the server's and OpenAI's meaning)",
    )
    p.add_argument("--top-k", type=non_negative_int, default=40, help="0: no top-k filter")
    p.add_argument(
        "--top-p", type=probability, default=1.0, help="nucleus sampling, (0, 1]; 1: off"
    )
    p.add_argument(
        "--stop",
        action="append",
        type=non_empty,
        default=[],
        help="repeatable: end a sample at this (non-empty) text",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past the end-of-sequence token (the document end of a model trained "
        "here), as the server's ignore_eos does; by default a sample ends there",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="0 .. 2**64 - 1")
    p.add_argument("--no-kv-cache", action="store_true", help="re-encode the context each token")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    add_quantize_flag(
        p,
        "int8: weights as int8 with per-output-channel scales, each TP shard its own "
        "(engine/models/quantize.py)",
    )
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> str:
    """Everything that can be wrong before a rank starts, past what the parser's types
    refuse (each flag's own range); returns the tokenizer path."""
    source = ModelSource(args.ckpt, args.hf_dir)
    cfg = source.config()
    if not cfg.causal:
        raise ValueError(
            f"{args.ckpt or args.hf_dir} holds a {cfg.arch} model; only decoders ({decoders()}) generate"
        )
    cfg.validate(args.tp_size)
    sampling(args).check()
    tokenizer = tokenizer_file(
        args.tokenizer,
        None if args.tokenizer else source.tokenizer_path(),
        args.ckpt or args.hf_dir,
    )
    source.check_weights()  # raises naming the file when there is none or it is damaged
    check_positions(args.prompt, args.max_new_tokens, tokenizer, cfg.max_positions)
    return tokenizer


def check_positions(
    prompts: list[str], max_new_tokens: int, tokenizer_path: str, positions: int
) -> None:
    """Refuse a generation the model cannot finish: the longest prompt plus the new tokens
    must fit its learned positions (past them it has no embedding to give). The message
    names --max-new-tokens and --tokenizer, as generate's and quantize_report's flags."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(tokenizer_path)
        longest = max(len(tokenizer.encode(p).ids) for p in prompts)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises plain Exception
        first = (str(err).splitlines() or [type(err).__name__])[0][:120]
        raise ValueError(
            f"--tokenizer {tokenizer_path} is not a readable tokenizer.json ({first}); pass "
            "the tokenizer.json the model was trained with"
        ) from None
    if longest + max_new_tokens > positions:
        room = positions - longest
        fix = f"pass --max-new-tokens {room} or less" if room > 0 else "shorten the prompt"
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} after a prompt of {longest} tokens needs "
            f"{longest + max_new_tokens} positions, the model has {positions}: {fix}"
        )


def sampling(args: argparse.Namespace) -> Sampling:
    """The sampling options as one value: each of Sampling's fields has its flag, of the same
    name (--greedy, --temperature, --top-k, --top-p, --seed); ``--temperature 0`` is
    argmax, as in the server's requests."""
    chosen = {f.name: getattr(args, f.name) for f in fields(Sampling)}
    if chosen["temperature"] == 0:
        chosen |= {"greedy": True, "temperature": 1.0}
    return Sampling(**chosen)


def worker(args: argparse.Namespace, tokenizer_path: str) -> dict | None:
    """One rank: build the model on this TP shard, generate; rank 0 returns the texts."""
    import torch

    from apps.serving.text import TextCodec
    from engine.bootstrap import bootstrap_rank
    from engine.generate import generate_batch
    from engine.inference import inference_config
    from engine.models import build_model
    from engine.models.quantize import quantize_model_

    def say(ps, line: str) -> None:
        if ps.rank == 0:  # stdout holds the samples alone
            print(line, file=sys.stderr)

    mesh = bootstrap_rank(
        lambda world: sized_dims(args.tp_size, None, world),
        warn=int(os.environ.get("RANK", "0")) == 0,
        say=say,
    )
    with mesh as ps:
        cfg, state = ModelSource(args.ckpt, args.hf_dir).load(ps)
        model = build_model(
            inference_config(cfg),
            ps,
            dtype=getattr(torch, args.dtype),
            device=ps.device,
        )
        model.load_full_state_dict(state)
        del state
        quantize_model_(model, args.quantize)
        # The tokenizer, read once, with the server's end of sequence (tokenizer_config.json's,
        # else the family's): a sample ends there, as a completion does.
        codec = TextCodec.from_files(tokenizer_path, arch=cfg.arch)
        tokenizer = codec.tokenizer
        prompts = [tokenizer.encode(p).ids for p in args.prompt]
        eos = set() if args.ignore_eos else codec.eos_ids

        def stop(row: int, new: list[int]) -> bool:
            ended = bool(new) and new[-1] in eos
            return ended or any(s in tokenizer.decode(new) for s in args.stop)

        start = time.perf_counter()
        new = generate_batch(
            model,
            prompts,
            args.max_new_tokens,
            sampling(args),
            use_cache=not args.no_kv_cache,
            stop=stop,
        )
        seconds = time.perf_counter() - start
        tokens = sum(map(len, new))
        new = [ids[:-1] if ids and ids[-1] in eos else ids for ids in new]  # eos: not text
        texts = [_cut(tokenizer.decode(ids), args.stop) for ids in new]
        return {"texts": texts, "tokens": tokens, "seconds": seconds} if ps.rank == 0 else None


def _cut(text: str, stops: list[str]) -> str:
    """``text`` up to the first stop string (which is dropped)."""
    ends = [text.find(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def main(argv: list[str] | None = None) -> int:
    """Check, start the ranks, print the samples; 2 on a bad argument."""
    args = parse_args(argv)
    try:
        tokenizer = check(args)
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (OSError, ValueError, CheckpointError) as err:
        print(f"generate: {in_flags(str(err), {'--tp-size'})}", file=sys.stderr)
        return 2
    if "RANK" in os.environ or args.tp_size == 1:
        result = worker(args, tokenizer)
    else:
        from engine.launching import launch_workers

        result = launch_workers(worker, args, tokenizer, nproc_per_node=args.tp_size)[0]
    if result is None:  # not rank 0
        return 0
    for i, (prompt, text) in enumerate(zip(args.prompt, result["texts"], strict=True)):
        print(f"--- sample {i + 1} ---")
        print(prompt + text)
    rate = result["tokens"] / result["seconds"]
    print(
        f"{result['tokens']} new tokens in {result['seconds']:.2f} s ({rate:.1f} tokens/s, "
        f"tp={args.tp_size}, KV cache {'off' if args.no_kv_cache else 'on'})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
