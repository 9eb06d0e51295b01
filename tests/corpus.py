"""A small fixed text corpus for the training tests, built the way the real pipeline builds one.

The product's default corpus is the running Python's standard library, which changes with
the Python version (on 3.12 a split of it came out empty). Tests need data that is the same
on every machine, so this module writes its documents from a fixed word list and a
self-contained linear congruential generator (not ``random``, whose algorithms may change),
then trains the BPE tokenizer and writes ``.bin/.idx`` with ``engine.data.preprocess``.
"""

from __future__ import annotations

from pathlib import Path

from engine.data.preprocess import encode_to_indexed, save_tokenizer, train_tokenizer

_NAMES = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "value",
    "index",
    "count",
    "total",
    "items",
    "result",
    "buffer",
    "offset",
    "limit",
    "start",
    "stop",
    "step",
    "width",
    "height",
    "layer",
    "token",
    "batch",
    "shard",
    "rank",
    "group",
    "scale",
    "weight",
    "bias",
]
_OPS = ("+", "-", "*", "//", "%")
_WORDS = [
    "the",
    "model",
    "reads",
    "each",
    "batch",
    "and",
    "returns",
    "the",
    "loss",
    "of",
    "every",
    "token",
    "while",
    "the",
    "optimizer",
    "updates",
    "the",
    "weights",
    "from",
    "their",
    "gradients",
    "and",
    "the",
    "scheduler",
    "lowers",
    "the",
    "learning",
    "rate",
]


class _Lcg:
    """Numerical Recipes' 32-bit LCG: the same numbers on every platform and Python."""

    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFF

    def below(self, n: int) -> int:
        self.state = (1664525 * self.state + 1013904223) & 0xFFFFFFFF
        return (self.state >> 8) % n


def _function(rng: _Lcg) -> str:
    name, args = _NAMES[rng.below(len(_NAMES))], rng.below(3) + 1
    params = [_NAMES[rng.below(len(_NAMES))] for _ in range(args)]
    doc = " ".join(_WORDS[rng.below(len(_WORDS))] for _ in range(4 + rng.below(8)))
    lines = [f"def {name}_{rng.below(100)}({', '.join(params)}):", f'    """{doc}."""']
    for _ in range(1 + rng.below(5)):
        left, right = params[rng.below(args)], params[rng.below(args)]
        lines.append(f"    {left} = {right} {_OPS[rng.below(len(_OPS))]} {rng.below(1000)}")
    lines.append(f"    return {params[0]}\n")
    return "\n".join(lines)


def documents(num_docs: int = 160, seed: int = 2024) -> list[str]:
    """``num_docs`` Python-like documents of 2 to 20 functions each, fixed by ``seed``."""
    rng = _Lcg(seed)
    return ["\n".join(_function(rng) for _ in range(2 + rng.below(19))) for _ in range(num_docs)]


def build_test_corpus(directory: str | Path, vocab_size: int = 512) -> tuple[str, str]:
    """Write the corpus into ``directory``; return ``(data prefix, tokenizer.json path)``."""
    directory = Path(directory)
    docs = documents()
    tokenizer = train_tokenizer(docs, vocab_size)
    tokenizer_path = directory / "tokenizer.json"
    save_tokenizer(tokenizer, tokenizer_path)
    prefix = directory / "corpus"
    encoded = [(text, len(text.encode())) for text in docs]
    encode_to_indexed(encoded, tokenizer, prefix, progress=False)
    return str(prefix), str(tokenizer_path)
