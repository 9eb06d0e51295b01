"""Generation speed: tokens/s with the KV cache on and off, and per-token time vs context.

One process, one model (random weights: speed does not depend on them), cache on and off
measured side by side for each (batch, new tokens) case. Prints a markdown table of
tokens/s (new tokens of the whole batch ÷ wall time, prompt encoding included) and, for
the longest batch-1 run, the mean time per token over each quarter of the generated
tokens, which stays flat with the cache and grows with the context without it.

    python tools/bench_generate.py --batches 1 16 --new-tokens 128 512 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.generate import Sampling, generate_batch  # noqa: E402
from engine.models import build_model  # noqa: E402
from engine.tool_args import ArgumentParser, positive_int  # noqa: E402
from studies.bench import tiny_gpt  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=positive_int, nargs="+", default=[128, 512])
    p.add_argument("--prompt-len", type=positive_int, default=16)
    tiny_gpt.add_size_flags(p)
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda where a CUDA device is visible, else cpu",
    )
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but no CUDA device is visible; pass --device cpu (or auto)")
    try:  # e.g. --hidden not divisible by --heads, named by its flags
        model_config(args).validate()
    except ValueError as err:
        p.error(str(err))
    return args


def model_config(args: argparse.Namespace):
    """The tiny GPT of the flags, with positions for the longest prompt + generation."""
    longest = max(args.new_tokens) + args.prompt_len
    return tiny_gpt.config(args, vocab=args.vocab, positions=longest)


def timed(model, prompts, new_tokens: int, use_cache: bool) -> tuple[float, list[float]]:
    """(wall seconds, time of each generated token) of one greedy generation."""
    stamps: list[float] = []
    # The stop callback runs once per row after every step: row 0's call timestamps the step.
    record = lambda row, new: (row == 0 and stamps.append(time.perf_counter())) and False  # noqa: E731
    if model.parameters().__next__().is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    generate_batch(
        model, prompts, new_tokens, Sampling(greedy=True), use_cache=use_cache, stop=record
    )
    wall = time.perf_counter() - start
    steps = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)]
    return wall, steps


def main(argv: list[str] | None = None) -> int:
    """Run every case and print the tables."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = model_config(args)
    torch.manual_seed(0)
    model = build_model(cfg, device=args.device).eval()
    gen = torch.Generator().manual_seed(1)
    print(
        f"model: h={args.hidden} l={args.layers} heads={args.heads} V={args.vocab}, prompt "
        f"{args.prompt_len} tokens, {args.device}, {args.threads} thread(s)"
    )
    print("\n| batch | new tokens | cache on (tokens/s) | cache off (tokens/s) | speedup |")
    print("|---:|---:|---:|---:|---:|")
    curves = {}
    timed(model, [[1] * args.prompt_len], 8, True)  # warm up
    for batch in args.batches:
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=gen).tolist()
        for new in args.new_tokens:
            on, on_steps = timed(model, prompts, new, True)
            off, off_steps = timed(model, prompts, new, False)
            rate_on, rate_off = batch * new / on, batch * new / off
            print(
                f"| {batch} | {new} | {rate_on:.0f} | {rate_off:.0f} | {off / on:.1f}x |",
                flush=True,
            )
            if batch == min(args.batches) and new == max(args.new_tokens):
                curves = {"on": on_steps, "off": off_steps}
    if curves:
        n = len(curves["on"])
        print(
            f"\nbatch {min(args.batches)}, {n} new tokens: mean ms per token by quarter of the run"
        )
        print("\n| tokens | cache on (ms) | cache off (ms) |\n|---|---:|---:|")
        for q in range(4):
            lo, hi = q * n // 4, (q + 1) * n // 4
            on = statistics.mean(curves["on"][lo:hi]) * 1e3
            off = statistics.mean(curves["off"][lo:hi]) * 1e3
            print(f"| {lo + 1}-{hi} | {on:.2f} | {off:.2f} |")
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
