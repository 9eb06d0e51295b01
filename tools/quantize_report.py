"""What ``--quantize int8`` costs a model: held-out perplexity, weight memory, greedy tokens.

    python tools/quantize_report.py --ckpt checkpoints/gpt_tiny_stdlib
    python tools/quantize_report.py --ckpt checkpoints/gpt_tiny_stdlib --tp-size 2

* perplexity: ``python -m engine.evaluate`` run twice, ``--quantize none`` and ``int8``, on
  what the run validated on (or ``--data`` / ``--text``), at ``--tp-size`` (each TP shard
  quantizes its own rows or columns);
* weight memory (one process, TP 1): the int8 model's weight bytes (int8 matrices, their
  fp32 scales, the float tensors kept at 2 bytes each) over the same model's in fp16, and
  the same ratio over the quantized tensors only;
* greedy tokens: ``--max-new-tokens`` from each ``--prompt`` (the README's by default),
  float32 and int8, how many leading tokens agree and, where they part, by how much the
  float32 model's top-1 logit led its top-2 there.

One JSON line on stdout; a readable summary on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.generate_text import check_positions  # noqa: E402
from engine.inference import ModelSource  # noqa: E402
from engine.tool_args import ArgumentParser, positive_int  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEFAULT_PROMPTS = ["def ", "import os"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(prog="quantize_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="training checkpoint or model export")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", help="PREFIX of a preprocessed set (default: the run's)")
    data.add_argument("--text", help="a UTF-8 text file to evaluate")
    p.add_argument("--tp-size", type=positive_int, default=1, help="for the perplexity")
    p.add_argument(
        "--prompt",
        action="append",
        help="repeatable (default: the README's 'def ' and 'import os')",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=40)
    return p.parse_args(argv)


def _evaluate(args: argparse.Namespace, quantize: str) -> dict:
    """engine.evaluate's JSON line for ``quantize``, run as its own command."""
    # It runs in this checkout (its cwd), so the paths given here go to it absolute.
    command = [sys.executable, "-m", "engine.evaluate", "--ckpt", os.path.abspath(args.ckpt)]
    command += ["--tp-size", str(args.tp_size), "--quantize", quantize]
    if args.data:
        command += ["--data", os.path.abspath(args.data)]
    if args.text:
        command += ["--text", os.path.abspath(args.text)]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        # Its own error is one line (its last); the command is what the user did not type.
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"evaluating with --quantize {quantize} failed: {why}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _memory_and_tokens(args: argparse.Namespace) -> tuple[dict, dict]:
    import torch
    from tokenizers import Tokenizer

    from engine.generate import Sampling, generate_batch
    from engine.inference import inference_config
    from engine.models import build_model
    from engine.models.quantize import quantize_model_, weight_memory

    source = ModelSource(args.ckpt)
    cfg, state = source.load()
    models = {}
    for mode in ("none", "int8"):
        model = build_model(inference_config(cfg), dtype=torch.float32).eval()
        model.load_full_state_dict(state)
        models[mode] = quantize_model_(model, mode)
    fp16 = weight_memory(models["none"])["total"]
    int8 = weight_memory(models["int8"])
    quantized_fp16 = int8["float_equivalent"] - int8["float"]
    memory = {
        "fp16_bytes": fp16,
        "int8_bytes": int8["total"],
        "ratio": int8["total"] / fp16,
        "quantized_tensors_ratio": int8["int8"] / quantized_fp16,
        "kept_float_bytes_at_fp16": int8["float"],
    }
    tokenizer = Tokenizer.from_file(source.tokenizer_path())
    prompts = args.prompt or DEFAULT_PROMPTS
    ids = [tokenizer.encode(p).ids for p in prompts]
    greedy = Sampling(greedy=True)
    out = {m: generate_batch(models[m], ids, args.max_new_tokens, greedy) for m in models}
    tokens = []
    for prompt, fp32, q in zip(prompts, out["none"], out["int8"], strict=True):
        same = next((i for i, (a, b) in enumerate(zip(fp32, q, strict=True)) if a != b), len(fp32))
        gap = None
        if same < len(fp32):  # how close fp32's own choice was where int8 chose otherwise
            with torch.no_grad():
                context = torch.tensor([tokenizer.encode(prompt).ids + fp32[:same]])
                logits = models["none"](context)[0, -1, : cfg.vocab_size]
            top = logits.topk(2).values
            gap = float(top[0] - top[1])
        tokens.append(
            {
                "prompt": prompt,
                "fp32_top2_logit_gap_where_they_part": gap,
                "identical": fp32 == q,
                "leading_tokens_equal": same,
                "new_tokens": len(fp32),
                "fp32": tokenizer.decode(fp32),
                "int8": tokenizer.decode(q),
            }
        )
    return memory, {"greedy": tokens}


def _check_before_evaluating(args: argparse.Namespace) -> None:
    """A bad --ckpt, a model with no tokenizer recorded, or a --max-new-tokens past the
    model's positions: one line before any evaluation starts (not after both have run)."""
    source = ModelSource(args.ckpt)
    source.kind()  # raises naming the path when it is no checkpoint
    tokenizer = source.tokenizer_path()
    if tokenizer is None:
        raise ValueError(
            f"{args.ckpt} records no tokenizer.json (the greedy comparison needs one); "
            "copy the tokenizer.json the model was trained with into it"
        )
    positions = source.config().max_positions
    check_positions(args.prompt or DEFAULT_PROMPTS, args.max_new_tokens, tokenizer, positions)


def main(argv: list[str] | None = None) -> int:
    """Measure and print; 2 (one line) when a step cannot run."""
    args = parse_args(argv)
    try:
        _check_before_evaluating(args)
        fp32, int8 = _evaluate(args, "none"), _evaluate(args, "int8")
        memory, tokens = _memory_and_tokens(args)
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (OSError, ValueError, RuntimeError) as err:
        print(f"quantize_report: {err}", file=sys.stderr)
        return 2
    report = {
        "perplexity": {
            "fp32": fp32["perplexity"],
            "int8": int8["perplexity"],
            "int8_over_fp32": int8["perplexity"] / fp32["perplexity"],
            "sequences": fp32["sequences"],
            "seq_len": fp32["seq_len"],
            "tp_size": args.tp_size,
        },
        "weight_memory": memory,
        **tokens,
    }
    p, m = report["perplexity"], memory
    print(
        f"perplexity fp32 {p['fp32']:.4f}  int8 {p['int8']:.4f}  "
        f"({p['int8_over_fp32'] - 1:+.2%}, {p['sequences']} × {p['seq_len']} tokens, "
        f"tp {args.tp_size})",
        file=sys.stderr,
    )
    print(
        f"weights fp16 {m['fp16_bytes']} B  int8 {m['int8_bytes']} B  ({m['ratio']:.3f}×; "
        f"quantized tensors alone {m['quantized_tensors_ratio']:.3f}×)",
        file=sys.stderr,
    )
    for t in report["greedy"]:
        print(
            f"greedy {t['prompt']!r}: {t['leading_tokens_equal']}/{t['new_tokens']} leading "
            f"tokens equal{' (identical)' if t['identical'] else ''}"
            + (
                ""
                if t["identical"]
                else f"; there fp32's top-1 led its top-2 by "
                f"{t['fp32_top2_logit_gap_where_they_part']:.4f} logits"
            ),
            file=sys.stderr,
        )
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
