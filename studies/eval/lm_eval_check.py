"""lm-eval's log-likelihoods from the server against the engine's own per-token losses.

    python -m studies.eval.lm_eval_check --ckpt weights-hf/ --samples /tmp/lm-eval-out

``lm_eval --model local-completions`` against ``python -m apps.serve`` scores each
(context, continuation) pair of a log-likelihood task as the sum of the continuation's
token log-probabilities, read from the server's ``echo`` + ``logprobs`` answer. The
reference here never goes near the server: the same model loaded from the same directory,
one plain forward over ``context + continuation`` through the training loss
(``model(input_ids, labels)``: the per-token cross-entropy whose mean ``engine.evaluate``
reports), and minus the sum of the continuation tokens' losses. The tokens are split as
lm-eval splits them (``_encode_pair``: the whole text encoded once, the context's tokens
cut off the front, trailing spaces of the context moved to the continuation).

Tolerance: both sides are float32 log-softmaxes of the same weights; the server's forward
differs only in its summation order (a left-padded batch over the paged KV cache, and its
log-softmax over the gathered logits rather than the fused cross-entropy's). Per token that
is tests/test_serve.py's bound against a plain forward, ``1e-5 + 1e-5·|logprob|``; summed
over a continuation's n tokens, all log-probabilities being <= 0, it is
``1e-5·(n + |ll|)``. Measured on the quick start's model: at most 1.4e-6 (8 samples,
|ll| up to 84), hundreds of times inside it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ATOL, RTOL = 1e-5, 1e-5  # per token: float32, a different summation order (docstring)


def read_samples(path: str, task: str) -> list[tuple[str, str, float]]:
    """``(context, continuation, log-likelihood)`` of every sample lm-eval logged for
    ``task`` (``--log_samples``): ``path`` is the samples JSONL or a folder holding it
    (``--output_path``; lm-eval writes it one level down, under the model's name)."""
    if os.path.isdir(path):
        found = sorted(
            glob.glob(os.path.join(path, "**", f"samples_{task}_*.jsonl"), recursive=True)
        )
        if not found:
            raise FileNotFoundError(
                f"no samples_{task}_*.jsonl under {path}: run with --log_samples"
            )
        path = found[-1]
    rows = []
    with open(path) as f:
        for line in f:
            sample = json.loads(line)
            context, continuation = (
                sample["arguments"]["gen_args_0"][k] for k in ("arg_0", "arg_1")
            )
            loglikelihood, _greedy = sample["filtered_resps"][0]
            rows.append((context, continuation, float(loglikelihood)))
    return rows


def split_tokens(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's token ids, cut as lm-eval cuts them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head) :]


def reference_loglikelihoods(model, encode, pairs) -> list[tuple[float, int]]:
    """Minus the summed per-token training losses of each pair's continuation tokens, and
    how many tokens that is."""
    import torch

    out = []
    for context, continuation in pairs:
        head, tail = split_tokens(encode, context, continuation)
        ids = torch.tensor([head + tail])
        with torch.no_grad():
            losses = model(ids[:, :-1], ids[:, 1:])[0]  # [len - 1]: token i+1's loss
        out.append((-losses[-len(tail) :].double().sum().item(), len(tail)))
    return out


def load(directory: str, tokenizer: str | None):
    """The float32 model in ``directory`` (a checkpoint, an export or a Hugging Face
    directory) and its tokenizer's ``encode`` (no special tokens added, as lm-eval)."""
    from tokenizers import Tokenizer

    from engine.inference import ModelSource, inference_config
    from engine.models import build_model

    hf = os.path.isfile(os.path.join(directory, "config.json"))
    source = ModelSource(None if hf else directory, directory if hf else None)
    cfg, state = source.load()
    model = build_model(inference_config(cfg))
    model.load_full_state_dict(state)
    codec = Tokenizer.from_file(tokenizer or source.tokenizer_path())
    return model.eval(), lambda text: codec.encode(text, add_special_tokens=False).ids


def within(got: float, want: float, tokens: int) -> bool:
    """Whether a summed log-likelihood of ``tokens`` tokens is within the tolerance."""
    return abs(got - want) <= ATOL * tokens + RTOL * abs(want)


def compare(rows, reference) -> tuple[float, bool]:
    """Print one line a sample; the largest difference, and whether all are in tolerance."""
    worst, ok = 0.0, True
    for (context, continuation, got), (want, tokens) in zip(rows, reference, strict=True):
        diff = abs(got - want)
        worst, ok = max(worst, diff), ok and within(got, want, tokens)
        print(f"{got:14.6f} {want:14.6f} {diff:9.2e}  {(context + continuation)[-32:]!r}")
    return worst, ok


def main(argv: list[str] | None = None) -> int:
    """Compare, print the max difference; 1 when a sample is past the tolerance."""
    p = argparse.ArgumentParser(prog="python -m studies.eval.lm_eval_check", description=__doc__)
    p.add_argument("--ckpt", required=True, help="the model the server served (any source)")
    p.add_argument("--samples", required=True, help="lm-eval's --output_path (or the JSONL)")
    p.add_argument("--task", default="meshtron_ll", help="the log-likelihood task's name")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the model's own)")
    args = p.parse_args(argv)
    rows = read_samples(args.samples, args.task)
    model, encode = load(args.ckpt, args.tokenizer)
    reference = reference_loglikelihoods(model, encode, [(c, t) for c, t, _ in rows])
    print(f"{'lm-eval':>14} {'engine':>14} {'|diff|':>9}  text (tail)")
    worst, ok = compare(rows, reference)
    print(
        f"{len(rows)} samples, max |diff| {worst:.3e} (tolerance {ATOL:g}·tokens + {RTOL:g}·|ll|)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
