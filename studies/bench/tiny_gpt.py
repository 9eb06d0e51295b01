"""The tiny random GPT that the generation and serving benchmarks build when given no
checkpoint: its size flags and its config. Both time a model whose speed does not depend on
its weights, so one definition keeps their defaults and their config the same."""

from __future__ import annotations

import argparse

from engine.tool_args import positive_int


def add_size_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--hidden, --layers, --heads and --vocab on ``p`` (a parser or one of its groups)."""
    for flag, default in (("--hidden", 128), ("--layers", 2), ("--heads", 4), ("--vocab", 8192)):
        p.add_argument(flag, type=positive_int, default=default)


def config(args: argparse.Namespace, *, vocab: int, positions: int, **extra):
    """A ``gpt_tiny`` config at the flags' sizes with ``vocab`` tokens and ``positions``
    positions, dropout off (timed and compared runs must not depend on a dropout draw);
    ``extra`` sets further fields. The model code is imported on this call, not with the
    module, so a benchmark's parse_args stays light."""
    from engine.models.config import preset

    sizes = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads)
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    return preset(
        "gpt_tiny", vocab_size=vocab, max_positions=positions, **sizes, **no_dropout, **extra
    )
