"""Loss and perplexity of a model on held-out data, at any layout; one JSON line out.

    python -m engine.evaluate --ckpt checkpoints/gpt_tiny_stdlib
    python -m engine.evaluate --ckpt weights/ --text notes.txt --tp-size 2 --dp-size 2
    python -m engine.evaluate --ckpt checkpoints/gpt_tiny_stdlib --data data/mycorpus --split test

The model is a training checkpoint (root or step directory), a model export or a Hugging
Face directory, loaded at ``--tp-size`` whatever layout wrote it (each rank reads the full
tensors and keeps its shard, as ``tools/checkpoint.py convert`` does). With no data option
it reads what the run validated on: the recorded data prefixes, split, sequence length,
micro-batch and ``trainer.eval_batches``, so the number is the trainer's last validation
loss. ``--data PREFIX`` picks another preprocessed set and ``--text FILE`` a plain text file
(tokenized into a temporary directory with the model's tokenizer, all of it in the split,
every full micro-batch read; a text shorter than the run's sequences is one sequence). The
loss is the trainer's: the mean over micro-batches, each on DP rank j mod dp_size, so it
does not depend on dp_size.

Before any rank starts, the data's ids are checked against the model's vocabulary (and its
index against its ``.bin``), and ``--batches`` may ask for no more micro-batches than the
split holds (only the recorded ``trainer.eval_batches`` reads on into a reshuffled second
epoch, as the trainer's validation did). With no recorded run, ``--seq-len`` defaults to
the data config's, capped at the model's positions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.checkpoint.storage import CheckpointError
from engine.config import Config, ParallelConfig, PipelineConfig
from engine.data.fsutil import tokenizer_file
from engine.inference import ModelSource, inference_config
from engine.models.families import FAMILIES
from engine.tool_args import ArgumentParser, add_quantize_flag, in_flags, positive_int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(prog="python -m engine.evaluate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="training checkpoint root (or step dir) or model export dir")
    src.add_argument("--hf-dir", help=f"local Hugging Face {', '.join(FAMILIES)} directory")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", help="PREFIX of a preprocessed .bin/.idx (default: the run's)")
    data.add_argument("--text", help="a UTF-8 text file, evaluated whole")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the model's own)")
    p.add_argument(
        "--split",
        choices=("train", "valid", "test"),
        default="valid",
        help="part of the data's document split to read (default: valid)",
    )
    p.add_argument(
        "--batches",
        type=positive_int,
        help="micro-batches to read (default: the run's "
        "trainer.eval_batches; with --text every full one)",
    )
    p.add_argument(
        "--micro-batch", type=positive_int, help="sequences per micro-batch (default: the run's)"
    )
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the run's)")
    add_quantize_flag(
        p,
        "int8: evaluate with the weights as int8, per-output-channel scales, each TP "
        "shard its own (engine/models/quantize.py; what apps.serve --quantize int8 runs)",
    )
    p.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel ranks")
    p.add_argument("--dp-size", type=positive_int, default=1, help="data-parallel ranks")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        help="where the ranks run (default: the run's trainer.device, else auto)",
    )
    return p.parse_args(argv)


def _recorded_config(source: ModelSource, recorded: dict) -> Config:
    """The training run's config ``recorded`` (``ModelSource.recorded_run_config``: a
    training checkpoint's, or a run's final export's beside it) with the model's config,
    else the defaults with it."""
    from omegaconf import OmegaConf

    model = source.config()
    if not recorded:
        return Config(model=model)
    merged = OmegaConf.merge(OmegaConf.structured(Config), recorded)
    return dataclasses.replace(OmegaConf.to_object(merged), model=model)


def evaluation_config(args: argparse.Namespace, text_prefix: str | None = None) -> Config:
    """The run config the ranks evaluate with: the recorded one, overridden by the flags."""
    source = ModelSource(args.ckpt, args.hf_dir)
    recorded = source.recorded_run_config()  # read once: the index can be large
    cfg = _recorded_config(source, recorded)
    tokenizer = args.tokenizer or source.tokenizer_path() or cfg.data.tokenizer
    data, trainer = cfg.data, cfg.trainer
    prefix = text_prefix or args.data
    if prefix:  # one set, all of it in the chosen split when it is a text file
        split = {"train": "1,0,0", "valid": "0,1,0", "test": "0,0,1"}[args.split]
        data = dataclasses.replace(
            data, prefixes=[prefix], weights=[], split=split if text_prefix else data.split
        )
    elif not data.prefixes and not args.text:
        raise ValueError(
            f"{args.ckpt or args.hf_dir} records no training data: pass --data or --text"
        )
    seq_len = args.seq_len or (
        data.seq_len if recorded else min(data.seq_len, cfg.model.max_positions)
    )
    mb = args.micro_batch or trainer.micro_batch
    if text_prefix:  # a text shorter than the run's sequences is read as one, whole
        seq_len, mb = _text_shape(args, text_prefix, seq_len, mb)
    data = dataclasses.replace(data, tokenizer=tokenizer, seq_len=seq_len)
    trainer = dataclasses.replace(
        trainer,
        device=args.device or trainer.device,
        micro_batch=mb,
        global_batch=mb,
        eval_batches=args.batches or (0 if text_prefix else trainer.eval_batches),
    )
    model = inference_config(dataclasses.replace(cfg.model, sequence_parallel=False))
    # The layout is the flags' alone: the run's pipeline stages, context-parallel ranks,
    # expert split and DP sharding are how it trained, not how this reads the weights.
    return dataclasses.replace(
        cfg,
        data=data,
        trainer=trainer,
        model=model,
        parallel=ParallelConfig(),
        pipeline=PipelineConfig(),
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        pp_size=1,
        cp_size=1,
        ep_size=1,
    )


def _text_shape(args: argparse.Namespace, prefix: str, seq_len: int, mb: int) -> tuple[int, int]:
    """(sequence length, micro-batch) for the tokenized ``--text`` at ``prefix``: a text of
    n tokens (its document end included) has n - 1 to predict; where that is fewer than the
    run's sequence length the text is one sequence of n - 1, and the micro-batch is no
    larger than the sequences the text holds. An explicit --seq-len it cannot fill is
    refused, naming the longest it can."""
    from engine.data.indexed import IndexedDataset

    tokens = int(IndexedDataset(prefix).doc_offsets[-1])
    longest = tokens - 1
    if longest < 1:
        raise ValueError(f"--text {args.text} holds no token to predict")
    if args.seq_len is not None and args.seq_len > longest:
        raise ValueError(
            f"--text {args.text} holds {tokens} tokens with its document end: --seq-len "
            f"{args.seq_len} needs {args.seq_len + 1}; pass --seq-len {longest} or less (or "
            "none: a text shorter than the run's sequences is read as one)"
        )
    seq_len = min(seq_len, longest)
    sequences = longest // seq_len
    return seq_len, mb if args.micro_batch is not None else min(mb, sequences)


def check(args: argparse.Namespace, cfg: Config) -> Config:
    """What can be wrong before a rank starts (ValueError, one line); returns ``cfg`` with
    the number of micro-batches to read settled."""
    from engine.data.indexed import check_token_ids
    from engine.data.preprocess import EOD_TOKEN
    from engine.data.run_data import EmptySplit, eval_iterator

    ModelSource(args.ckpt, args.hf_dir).check_weights()  # not in every rank, with a traceback
    tokenizer_file(args.tokenizer, cfg.data.tokenizer, args.ckpt or args.hf_dir)
    cfg.model.validate(args.tp_size)
    if getattr(args, "quantize", "none") != "none" and not cfg.model.causal:
        raise ValueError(f"--quantize {args.quantize} is for decoders, not {cfg.model.arch}")
    if cfg.data.seq_len > cfg.model.max_positions:
        raise ValueError(
            f"--seq-len {cfg.data.seq_len}: the model has {cfg.model.max_positions} positions; "
            f"pass --seq-len {cfg.model.max_positions} or less"
        )
    tokenizer = _readable_tokenizer(cfg.data.tokenizer)
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(
            f"{cfg.data.tokenizer} has {tokenizer.get_vocab_size()} ids, more than "
            f"the model's vocabulary ({cfg.model.vocab_size}): not its tokenizer"
        )
    for prefix in cfg.data.prefixes:  # ids past the vocabulary: a traceback or a wrong loss
        check_token_ids(prefix, cfg.model.vocab_size, eod_id=tokenizer.token_to_id(EOD_TOKEN))
    try:
        valid, _ = eval_iterator(cfg, args.split, tokenizer)
    except EmptySplit as err:  # the split holds too few tokens for one sequence
        raise ValueError(
            f"{err}; read another --split (data.split={cfg.data.split} shares the "
            "documents out) or a shorter --seq-len"
        ) from None
    return _settle_batches(args, cfg, len(valid.dataset))


def _readable_tokenizer(path: str):
    """The tokenizer at ``path``; ValueError (one line) when it is not a tokenizer.json."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises plain Exception
        first = (str(err).splitlines() or [type(err).__name__])[0][:120]
        raise ValueError(f"--tokenizer {path} is not a tokenizer.json ({first})") from None


def _settle_batches(args: argparse.Namespace, cfg: Config, sequences: int) -> Config:
    """``cfg`` with the micro-batches to read settled, refusing work the split cannot give."""
    mb = cfg.trainer.micro_batch
    held = sequences // mb
    if held < 1:
        raise ValueError(
            f"the {args.split} split holds {sequences} sequences of {cfg.data.seq_len} tokens, "
            f"fewer than one micro-batch of {mb}: lower --micro-batch or --seq-len"
        )
    if args.batches is not None and args.batches > held:
        raise ValueError(
            f"--batches {args.batches}: the {args.split} split holds {held} micro-batches of "
            f"{mb} sequences; pass --batches {held} or fewer"
        )
    # The recorded eval_batches may read on into the split's next epoch (reshuffled), as the
    # trainer's validation did: the same numbers, so the same rule.
    batches = cfg.trainer.eval_batches or held
    if args.dp_size > batches:
        raise ValueError(
            f"--dp-size {args.dp_size}: more data-parallel ranks than the {batches} "
            f"micro-batches read; pass --dp-size {batches} or fewer"
        )
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, eval_batches=batches))


def worker(cfg: Config, source: ModelSource, split: str, quantize: str = "none") -> dict | None:
    """One rank: load this TP shard of the model (quantized by ``quantize``: "none" or
    "int8"), read its micro-batches, agree on the mean."""
    from engine.bootstrap import bootstrap_rank
    from engine.config import parallel_dims, resolve_precision
    from engine.data.run_data import eval_iterator, load_tokenizer
    from engine.models import build_model
    from engine.models.quantize import quantize_model_
    from engine.observe import perplexity
    from engine.runner import autocast_for, fixed_set_loss

    def say(ps, line: str) -> None:
        if ps.rank == 0:  # stdout holds the JSON line alone
            print(line, file=sys.stderr)

    mesh = bootstrap_rank(
        lambda world: parallel_dims(cfg, world), device=cfg.trainer.device, say=say
    )
    with mesh as ps:
        _, state = source.load(ps)
        model = build_model(cfg.model, ps, device=ps.device)
        model.load_full_state_dict(state)
        del state
        quantize_model_(model, quantize)
        valid, _ = eval_iterator(cfg, split, load_tokenizer(cfg.data))
        precision = resolve_precision(cfg.trainer.precision, ps.device.type)
        autocast = lambda: autocast_for(precision, ps.device.type)  # noqa: E731
        batches = cfg.trainer.eval_batches
        forwards = -(-batches // ps.size("batch"))  # each rank's (fixed_set_loss)
        with _forwards_bar(ps.rank == 0, forwards) as advance:
            loss = fixed_set_loss(model, valid, ps, batches, autocast, on_forward=advance)
    if ps.rank != 0:
        return None
    t = cfg.trainer
    quantized = {} if quantize == "none" else {"quantize": quantize}
    return quantized | {
        "loss": loss,
        "perplexity": perplexity(loss),
        "micro_batches": t.eval_batches,
        "sequences": t.eval_batches * t.micro_batch,
        "seq_len": cfg.data.seq_len,
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "precision": precision,
    }


@contextlib.contextmanager
def _forwards_bar(shown: bool, total: int) -> Iterator[Callable[[], None] | None]:
    """A bar on stderr over ``total`` forwards, gone when they are done, where ``shown`` and
    stderr is a terminal (a log or a pipe gets only the result); yields its advance."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if not shown or not console.is_terminal:
        yield None
        return
    columns = (TextColumn("[bold]evaluate"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("evaluate", total=total)
        yield lambda: bar.advance(task)


def _evaluate(args: argparse.Namespace, text_prefix: str | None) -> dict:
    cfg = check(args, evaluation_config(args, text_prefix))
    source = ModelSource(args.ckpt, args.hf_dir)
    world = args.tp_size * args.dp_size
    if "RANK" in os.environ or world == 1:
        return worker(cfg, source, args.split, args.quantize)
    from engine.launching import launch_workers

    launched = launch_workers(worker, cfg, source, args.split, args.quantize, nproc_per_node=world)
    return launched[0]


def _tokenize_text(path: str, tokenizer: str, directory: str) -> str:
    """``path`` as one document in ``directory/text.bin/.idx``; returns the prefix."""
    from engine.data.preprocess import encode_to_indexed, iter_documents, load_tokenizer

    prefix = os.path.join(directory, "text")
    docs = list(iter_documents([Path(path)]))
    encode_to_indexed(docs, load_tokenizer(tokenizer), prefix, progress=False)
    return prefix


def main(argv: list[str] | None = None) -> int:
    """Evaluate and print one JSON line; 2 (one line on stderr) on a bad input."""
    args = parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="meshtron-eval-") as tmp:
            text_prefix = None
            if args.text:
                if not Path(args.text).is_file():
                    raise ValueError(f"--text {args.text}: no such file (a UTF-8 text file)")
                tokenizer = tokenizer_file(
                    args.tokenizer,
                    evaluation_config(args).data.tokenizer,
                    args.ckpt or args.hf_dir,
                )
                _readable_tokenizer(tokenizer)
                text_prefix = _tokenize_text(args.text, tokenizer, tmp)
            result = _evaluate(args, text_prefix)
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (OSError, ValueError, KeyError, CheckpointError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        flags = {"--tp-size", "--dp-size", "--seq-len", "--micro-batch"}
        print(f"evaluate: error: {in_flags(str(message), flags)}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
