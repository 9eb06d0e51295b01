"""From the data config to this rank's batch iterators and the tokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
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

# Samples a blended dataset is laid out for, at least: twice what the run will draw.
_MIN_BLEND_SIZE = 10_000_000


def resolve_data(data: DataConfig) -> DataConfig:
    """Fill in the embedded default corpus (built once, cached) and the tokenizer path.

    Runs in the launching process, before workers start, so only one process builds it.
    """
    if not data.prefixes:
        prefix, tokenizer = build_default_corpus(
            data.cache_dir, vocab_size=data.default_vocab_size, max_bytes=data.default_max_bytes
        )
        return dataclasses.replace(data, prefixes=[prefix], tokenizer=tokenizer)
    if data.tokenizer is None:
        return dataclasses.replace(data, tokenizer=data.prefixes[0] + ".tokenizer.json")
    return data


def load_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer that made the data."""
    return Tokenizer.from_file(data.tokenizer)


def _dataset(cfg: Config, split: str, tokenizer: Tokenizer):
    d, parts = cfg.data, []
    for i, prefix in enumerate(d.prefixes):
        indexed = IndexedDataset(prefix)
        docs = split_documents(len(indexed), d.split)[split]
        seed = d.seed + 1000 * i + {"train": 0, "valid": 1, "test": 2}[split]
        if cfg.model.arch == "gpt":
            parts.append(GPTDataset(indexed, d.seq_len, seed=seed, doc_range=docs))
            continue
        ids = {k: tokenizer.token_to_id(t) for k, t in
               (("cls_id", "[CLS]"), ("sep_id", "[SEP]"), ("mask_id", "[MASK]"), ("pad_id", "[PAD]"))}  # fmt: skip
        missing = [k for k, v in ids.items() if v is None]
        if missing:
            raise ValueError(f"the tokenizer {d.tokenizer} lacks BERT's special tokens {missing}")
        parts.append(
            BertDataset(
                indexed,
                d.seq_len,
                seed=seed,
                doc_range=docs,
                vocab_size=tokenizer.get_vocab_size(),
                **ids,
            )  # fmt: skip
        )
    if len(parts) == 1:
        return parts[0]
    size = max(_MIN_BLEND_SIZE, 2 * cfg.trainer.max_steps * cfg.trainer.global_batch)
    return BlendedDataset(parts, d.weights or [1.0] * len(parts), size)


@dataclass
class DataPipeline:
    """This DP rank's training and validation iterators."""

    train: DataIterator
    valid: DataIterator | None
    tokenizer: Tokenizer
    no_valid_reason: str | None = None  # why there is no validation set, when there is none


def build_pipeline(cfg: Config, dp_rank: int, dp_size: int) -> DataPipeline:
    """Iterators over this DP rank's part of every global batch."""
    tokenizer = load_tokenizer(cfg.data)
    t = cfg.trainer
    common = dict(micro_batch=t.micro_batch, dp_rank=dp_rank, dp_size=dp_size)
    train = DataIterator(_dataset(cfg, "train", tokenizer), global_batch=t.global_batch, **common)
    try:
        valid_set = _dataset(cfg, "valid", tokenizer)
    except ValueError as err:  # a split too small to hold one sequence: train without it
        return DataPipeline(train, None, tokenizer, f"validation split {cfg.data.split!r}: {err}")
    valid = DataIterator(valid_set, global_batch=t.micro_batch * dp_size, **common)
    return DataPipeline(train, valid, tokenizer)


def to_device(batch, device: torch.device):
    """Move a batch (tensor or dict of tensors) to ``device``."""
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)
