"""A run's data: from the data config to this rank's batch iterators and the tokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenizers import Tokenizer

from engine.config import Config, DataConfig
from engine.data import (
    BertDataset,
    BlendedDataset,
    DataIterator,
    GPTDataset,
    IndexedDataset,
    build_default_corpus,
    split_documents,
)
from engine.data.preprocess import EOD_TOKEN

# Samples a blended dataset is laid out for, at least: twice what the run will draw.
_MIN_BLEND_SIZE = 10_000_000


def resolve_data(data: DataConfig) -> DataConfig:
    """Fill in the embedded default corpus (built once, cached) and the tokenizer path.

    Runs in the launching process, before workers start, so only one process builds it.
    A byte cap that takes no text is a ValueError naming ``data.default_max_bytes``.
    """
    if not data.prefixes:
        try:
            prefix, tokenizer = build_default_corpus(
                data.cache_dir,
                vocab_size=data.default_vocab_size,
                max_bytes=data.default_max_bytes,
            )
        except ValueError as err:
            raise ValueError(
                f"data.default_max_bytes={data.default_max_bytes}: {err}; raise it (the default "
                f"corpus is {DataConfig.default_max_bytes:,} bytes) or pass data.prefixes"
            ) from None
        return dataclasses.replace(data, prefixes=[prefix], tokenizer=tokenizer)
    if data.tokenizer is None:
        return dataclasses.replace(data, tokenizer=data.prefixes[0] + ".tokenizer.json")
    return data


BERT_SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")


def check_data(cfg: Config) -> list[str]:
    """Problems of resolved data paths (one line each), found before any worker starts."""
    d, problems = cfg.data, []
    try:
        tokenizer = load_tokenizer(d)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        return [f"data.tokenizer: {d.tokenizer} is not a tokenizer.json ({err})"]
    vocab = tokenizer.get_vocab_size()
    if vocab > cfg.model.vocab_size:  # ids past the embedding would be silently zeroed at tp>1
        problems.append(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({vocab}, {d.tokenizer}); set model.vocab_size={vocab}"
        )
    if not cfg.model.causal:  # the masked-LM data (_part's BertDataset) needs them
        missing = [t for t in BERT_SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            problems.append(
                f"data.tokenizer: {d.tokenizer} lacks BERT's special tokens "
                f"{missing} (tools/preprocess_data.py adds them when it trains one)"
            )
    for prefix in d.prefixes:
        try:
            indexed = IndexedDataset(prefix, eod_id=tokenizer.token_to_id(EOD_TOKEN))
            if vocab <= cfg.model.vocab_size:  # else already reported, once, above
                indexed.verify(cfg.model.vocab_size)
        except ValueError as err:
            problems.append(f"data.prefixes: {err}")
            continue
        start, end = split_documents(len(indexed), d.split)["train"]
        tokens = int(indexed.doc_offsets[end] - indexed.doc_offsets[start])
        if tokens < d.seq_len + 1:
            problems.append(
                f"data.prefixes: the train split of {prefix} holds {tokens} tokens, "
                f"fewer than data.seq_len + 1 = {d.seq_len + 1}; lower data.seq_len "
                "or add data"
            )
    return problems


def load_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer that made the data."""
    return Tokenizer.from_file(data.tokenizer)


def _part(cfg: Config, i: int, prefix: str, split: str, tokenizer: Tokenizer):
    d = cfg.data
    # A Megatron index does not record its end-of-document id: the tokenizer names it.
    indexed = IndexedDataset(prefix, eod_id=tokenizer.token_to_id(EOD_TOKEN))
    docs = split_documents(len(indexed), d.split)[split]
    seed = d.seed + 1000 * i + {"train": 0, "valid": 1, "test": 2}[split]
    if cfg.model.causal:  # decoders (GPT, Llama) read next-token windows
        return GPTDataset(
            indexed, d.seq_len, seed=seed, doc_range=docs, document_mask=d.document_mask
        )
    names = ("cls_id", "sep_id", "mask_id", "pad_id")  # check_data made sure they exist
    ids = {k: tokenizer.token_to_id(t) for k, t in zip(names, BERT_SPECIAL_TOKENS, strict=True)}
    return BertDataset(
        indexed, d.seq_len, seed=seed, doc_range=docs, vocab_size=tokenizer.get_vocab_size(), **ids
    )


class EmptySplit(ValueError):
    """Every data prefix was left out of an evaluation split (each part too small)."""


def _dataset(cfg: Config, split: str, tokenizer: Tokenizer) -> tuple[object, list[str]]:
    """The (blended) dataset of ``split`` and notes on prefixes left out of it.

    Training needs every prefix; an evaluation split drops a prefix whose part is too
    small to hold one sequence (and says so) rather than losing validation altogether.
    """
    d, parts, weights, notes = cfg.data, [], [], []
    for i, prefix in enumerate(d.prefixes):
        try:
            parts.append(_part(cfg, i, prefix, split, tokenizer))
            weights.append(d.weights[i] if d.weights else 1.0)
        except ValueError as err:
            if split == "train":
                raise
            notes.append(f"{prefix} left out of the {split} split: {err}")
    if not parts:
        raise EmptySplit("; ".join(notes))
    if len(parts) == 1:
        return parts[0], notes
    size = max(_MIN_BLEND_SIZE, 2 * cfg.trainer.max_steps * cfg.trainer.global_batch)
    return BlendedDataset(parts, weights, size), notes


@dataclass
class RunData:
    """A run's data as this rank reads it: the training and validation iterators and the
    tokenizer (the data pipeline; not the pipeline-parallel schedule)."""

    train: DataIterator
    valid: DataIterator | None
    tokenizer: Tokenizer
    valid_note: str | None = None  # why validation is missing or leaves a prefix out


def build_run_data(cfg: Config, batch_rank: int, batch_size: int) -> RunData:
    """Iterators over this rank's part of every global batch: part ``batch_rank`` of
    ``batch_size`` (the mesh's batch role)."""
    tokenizer = load_tokenizer(cfg.data)
    t = cfg.trainer
    common = dict(micro_batch=t.micro_batch, dp_rank=batch_rank, dp_size=batch_size)
    train_set, _ = _dataset(cfg, "train", tokenizer)
    train = DataIterator(train_set, global_batch=t.global_batch, **common)
    try:
        valid, notes = eval_iterator(cfg, "valid", tokenizer)
    except ValueError as err:  # no prefix can hold one validation sequence: train without
        return RunData(train, None, tokenizer, f"validation split {cfg.data.split!r}: {err}")
    return RunData(train, valid, tokenizer, "; ".join(notes) or None)


def eval_iterator(cfg: Config, split: str, tokenizer: Tokenizer) -> tuple[DataIterator, list[str]]:
    """The micro-batches of ``split`` an evaluation reads, one per step, and notes on prefixes
    left out. Not sharded here: evaluation reads a fixed set of micro-batches, the same at
    every layout, and deals them out over DP itself (engine.runner.fixed_set_loss)."""
    dataset, notes = _dataset(cfg, split, tokenizer)
    mb = cfg.trainer.micro_batch
    return DataIterator(dataset, global_batch=mb, micro_batch=mb, dp_rank=0, dp_size=1), notes
