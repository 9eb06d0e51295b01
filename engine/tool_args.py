"""Shared command-line plumbing of the tools: argument errors as one line, exit status 2."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Collection
from typing import NoReturn

# A tool whose reader left (``tool ... | head``) exits as a C tool killed by SIGPIPE does.
BROKEN_PIPE_STATUS = 128 + 13


# The flags the tools give for what the model config and the layouts call by key: a check
# shared with the trainer names ``model.num_heads=5``; a tool says ``--heads 5`` instead
# (the first of the flags it has).
CONFIG_FLAGS = {
    "hidden_size": ("--hidden",),
    "num_heads": ("--heads",),
    "num_layers": ("--layers",),
    "vocab_size": ("--vocab",),
    "ffn_hidden_size": ("--ffn",),
    "max_positions": ("--max-positions",),
    "seq_len": ("--seq", "--seq-len"),
    "batch_size": ("--batch",),
    "micro_batch": ("--micro-batch",),
    "global_batch": ("--global-batch",),
    "tp_size": ("--tp-size", "--tp"),
    "dp_size": ("--dp-size", "--dp"),
    "pp_size": ("--pp-size", "--pp"),
    "cp_size": ("--cp-size", "--cp"),
    "ep_size": ("--ep-size", "--ep"),
    "microbatches": ("--microbatches",),
    "virtual_stages": ("--virtual-stages",),
    "dp_replicate": ("--dp-replicate",),
    "dp_shard": ("--dp-shard",),
    "offload": ("--offload",),
    "capacity_factor": ("--capacity-factor",),
    "experts": ("--experts",),
    "schedule": ("--schedule",),
    "steps": ("--steps",),
}
_WORDS = {"experts", "schedule", "offload", "steps"}  # also plain words: read only as ``key=``
_CONFIG_KEY = re.compile(
    r"(?<![-\w.])(?:model\.|parallel\.|pipeline\.|data\.|trainer\.)?"
    r"(" + "|".join(CONFIG_FLAGS) + r")\b(=?)"
)


def in_flags(message: str, flags: Collection[str] | None = None) -> str:
    """``message`` with the config keys of :data:`CONFIG_FLAGS` (``model.num_heads=4``,
    ``dp_size``) written as the flags that set them (``--heads 4``, ``--dp-size``): only
    those in ``flags`` (a parser's option strings; None: every first flag)."""

    def flag(match: re.Match) -> str:
        key, equals = match.groups()
        if key in _WORDS and not equals:  # a plain word ("experts") in a sentence
            return match.group(0)
        have = [f for f in CONFIG_FLAGS[key] if flags is None or f in flags][:1]
        if not have:
            return match.group(0)
        return have[0] + (" " if equals else "")

    return _CONFIG_KEY.sub(flag, message)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument prints ``PROG: error: MESSAGE`` alone (no usage block),
    naming the tool's flags where the message names config keys (:func:`in_flags`)."""

    def error(self, message: str) -> NoReturn:
        """Print the one line and exit 2 (argparse's status for a usage error)."""
        message = in_flags(message, self._option_string_actions)
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def run_tool(main: Callable[[], int | None]) -> NoReturn:
    """Run a tool's ``main`` and exit with its status. When whatever reads stdout stops
    reading (``tool ... | head``), the tool stops quietly, with no traceback, and exits
    :data:`BROKEN_PIPE_STATUS`. A launcher's variable that is no number (MASTER_PORT=abc)
    is one line before ``main`` runs, where a rank it started gave a traceback."""
    from parallel_state.launcher import launch_env_problem

    if problem := launch_env_problem():
        print(f"{os.path.basename(sys.argv[0])}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    try:
        status = main()
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        # Python flushes stdout once more at exit; point it at nothing so that is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(BROKEN_PIPE_STATUS) from None
    raise SystemExit(status)


def add_quantize_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--quantize none|int8`` (default none), the modes of ``engine.models.quantize`` (not
    imported: it loads torch); ``help`` says what int8 quantizes for the tool at hand."""
    parser.add_argument("--quantize", choices=("none", "int8"), default="none", help=help)


def add_batching_flags(parser: argparse.ArgumentParser) -> None:
    """``--block-size`` and ``--token-budget``, the paged KV cache's block and the tokens
    ``apps.serving.ServingEngine`` feeds a step (not imported: it loads torch): the server
    and its benchmark take them alike, so their defaults cannot drift apart."""
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--token-budget", type=positive_int, default=256, help="tokens fed per step"
    )


def add_model_size_flags(
    parser: argparse.ArgumentParser,
    *,
    layers: int,
    hidden: int,
    vocab: int,
    seq: int,
    heads: int | None = None,
    batch: int | None = None,
    notes: dict[str, str] | None = None,
) -> None:
    """``--layers --hidden [--heads] --vocab --seq [--batch]``, the sizes of a tool's toy
    model, each a positive integer with the tool's own default (``heads``/``batch`` None:
    the tool has no such flag). ``notes`` adds the tool's constraint to a flag's help,
    e.g. ``{"seq": "divisible by tp-size"}``."""
    helps = {
        "layers": "transformer layers",
        "hidden": "hidden size",
        "heads": "attention heads",
        "vocab": "vocabulary size",
        "seq": "tokens per sequence",
        "batch": "sequences per step",
    }
    values = dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, batch=batch)
    for name, default in values.items():
        if default is None:
            continue
        note = (notes or {}).get(name)
        text = f"{helps[name]} ({note})" if note else helps[name]
        parser.add_argument(f"--{name}", type=positive_int, default=default, help=text)


# The flags a tool adds over a model preset, and the ModelConfig field each overrides.
PRESET_OVERRIDES = {
    "hidden": "hidden_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "ffn": "ffn_hidden_size",
    "vocab": "vocab_size",
    "max_positions": "max_positions",
    "kv_heads": "num_kv_heads",
    "experts": "moe_num_experts",
    "moe_ffn": "moe_ffn_hidden_size",
}


def add_preset_overrides(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """``--hidden --layers ...`` (``names``, keys of :data:`PRESET_OVERRIDES`), each a
    positive integer overriding the preset's field, unset by default."""
    for name in names:
        field = PRESET_OVERRIDES[name]
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=positive_int,
            default=None,
            help=f"override the preset's {field}",
        )


def preset_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The preset fields the flags of :func:`add_preset_overrides` set, by field name."""
    given = {field: getattr(args, name, None) for name, field in PRESET_OVERRIDES.items()}
    return {field: value for field, value in given.items() if value is not None}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def int_list(least: int = 1):
    """argparse type: a comma list of integers, each >= ``least`` ("1,2,4"), as a list."""

    def parse(text: str) -> list[int]:
        values = []
        for item in text.split(","):
            try:
                values.append(_int_at_least(item, least))
            except argparse.ArgumentTypeError as err:
                where = f" (in the comma list {text[:40]!r})" if "," in text else ""
                raise argparse.ArgumentTypeError(f"{err}{where}") from None
        return values

    return parse


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 .. 65535 (0: any free one)."""
    value = _int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} must be in 0 .. 65535 (0: any free port)")
    return value


def seed_int(text: str) -> int:
    """argparse type: a random seed, an integer in 0 .. 2**64 - 1 (what torch.manual_seed takes)."""
    value = _int_at_least(text, 0)
    if value > SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} must be in 0 .. 2**64 - 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (not nan, not inf)."""
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (not nan, not inf)."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def probability(text: str) -> float:
    """argparse type: a number in (0, 1] (not nan)."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def bpe_vocab_size(text: str) -> int:
    """argparse type of a --vocab-size a byte-level BPE is trained to: at least its 256
    bytes and special tokens (checked before any text is read, not after the corpus is)."""
    from engine.data.preprocess import MIN_VOCAB_SIZE  # loads tokenizers: only when given

    value = positive_int(text)
    if value < MIN_VOCAB_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value} is too small: a byte-level BPE needs at least {MIN_VOCAB_SIZE} ids "
            f"(256 bytes + {MIN_VOCAB_SIZE - 256} special tokens)"
        )
    return value


def non_empty(text: str) -> str:
    """argparse type: a string of at least one character."""
    if not text:
        raise argparse.ArgumentTypeError("'' must not be empty")
    return text


def output_file(text: str) -> str:
    """argparse type: a file a tool writes (often after a long run): its folder must be an
    existing, writable directory and the path itself not a directory. Checked with
    ``engine.preflight.probe_writable``, which leaves the disk as it found it."""
    return _writable(text, directory=False)


def output_dir(text: str) -> str:
    """argparse type: a directory a tool writes into: an existing writable one, or one that
    can be created (missing parents included), not a file. Tested as ``output_file``."""
    return _writable(text, directory=True)


def _writable(text: str, *, directory: bool) -> str:
    from pathlib import Path

    from engine.preflight import probe_writable  # loads torch: only when the flag is given

    if not text:
        raise argparse.ArgumentTypeError("'' must not be empty")
    path = Path(text)
    if path.exists() and path.is_dir() != directory:
        kind = "a file; give a directory" if directory else "a directory; give a file path"
        raise argparse.ArgumentTypeError(f"{text} is {kind}")
    if not directory and not path.parent.is_dir():
        what = "is not a directory" if path.parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(
            f"{text}: its folder {path.parent} {what}; create it or give another path"
        )
    problem = probe_writable(path, directory=directory)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}; give a writable path")
    return text


SEED_MAX = 2**64 - 1


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:  # also a literal too long for int() (sys.get_int_max_str_digits)
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
    return value
