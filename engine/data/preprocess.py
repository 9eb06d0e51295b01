"""Corpus -> byte-level BPE -> ``PREFIX.bin`` / ``PREFIX.idx`` (the engine behind the CLI)."""

from __future__ import annotations

import glob
import multiprocessing
import os
import re
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.data.fsutil import MISSING, atomic_output, file_problem
from engine.data.indexed import IndexedDatasetWriter
from engine.data.sources import Document, is_parquet, iter_source

EOD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOD_TOKEN, "[PAD]", "[CLS]", "[SEP]", "[MASK]")
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# Documents per encode task: big enough to amortize IPC, small enough to keep memory flat.
_CHUNK_DOCS = 256
_CHUNK_CHARS = 1 << 20  # or this many characters, whichever comes first
# Whitespace then non-whitespace, or trailing whitespace: never splits a pre-tokenized word.
_PIECES = re.compile(r"\s*\S+|\s+")


@dataclass(frozen=True)
class PreprocessResult:
    """What :func:`preprocess` wrote."""

    prefix: str
    tokenizer_path: str
    num_docs: int
    num_tokens: int
    vocab_size: int
    notes: tuple[str, ...] = ()  # what the user should know, e.g. a smaller vocabulary than asked


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """Expand paths, globs (``**`` included) and Parquet folders in order.

    Raise ``FileNotFoundError`` naming any that match nothing.
    """
    if not patterns:
        raise FileNotFoundError("no input given")
    paths: list[Path] = []
    for pattern in patterns:
        if not glob.has_magic(pattern) and os.path.isdir(pattern):
            # A folder is a Parquet dataset (as Hugging Face publishes them), partitions and all.
            shards = sorted(p for p in Path(pattern).rglob("*") if p.is_file() and is_parquet(p))
            if not shards:
                raise IsADirectoryError(
                    f"{pattern} is a directory without Parquet files (pass files or a glob "
                    f"such as '{os.path.join(pattern, '*.txt')}')"
                )
            paths.extend(shards)
            continue
        problem = None if glob.has_magic(pattern) else file_problem(pattern)
        if problem not in (None, MISSING):  # a FIFO would be read for ever
            raise ValueError(f"{pattern} {problem}; give a data file")
        matches = (
            sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        )
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"input not found: {pattern}")
        paths.extend(Path(m) for m in matches)
    return paths


def iter_documents(paths: Sequence[Path], *, json_key: str | None = None) -> Iterator[Document]:
    """Yield documents: Parquet rows (column ``json_key``), JSONL lines under ``json_key``
    (plain, ``.gz`` or ``.zst``), or, without a key, a whole text file each."""
    for path in paths:
        yield from iter_source(path, json_key)


def new_bpe_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE whose decode(encode(text)) == text exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (the special tokens come first, id 0..4)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab size {vocab_size} too small: byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    seen = 0

    def counted() -> Iterator[str]:
        nonlocal seen
        for text in texts:
            seen += len(text)
            yield text

    tokenizer = new_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(counted(), trainer)
    if seen == 0:
        raise ValueError("empty corpus: the inputs contain no text")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` atomically."""
    with atomic_output(path) as tmp:
        tokenizer.save(str(tmp))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a ``tokenizer.json``, requiring the end-of-document token."""
    problem = file_problem(path)
    if problem == MISSING:
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if problem is not None:  # a FIFO would be read for ever
        raise ValueError(f"{path} {problem}; give a tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{path}: not a tokenizer.json ({err})") from None
    if tokenizer.token_to_id(EOD_TOKEN) is None:
        raise ValueError(f"{path}: tokenizer has no {EOD_TOKEN} token")
    return tokenizer


def _encoding_copy(tokenizer_json: str) -> Tokenizer:
    tokenizer = Tokenizer.from_str(tokenizer_json)
    # Control tokens typed in the text are data, not document boundaries.
    tokenizer.encode_special_tokens = True
    return tokenizer


def _encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]


# Per-process state of a spawned encode worker, set once by its Pool initializer.
_worker_tokenizer: list[Tokenizer] = []


def _init_worker(tokenizer_json: str) -> None:
    # One Rust thread per worker process: the process count is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C is the parent's to handle: it tears the pool down; workers stay quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer.append(_encoding_copy(tokenizer_json))


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _encode_texts(_worker_tokenizer[0], texts)


def _chunks(docs: Iterable[Document]) -> Iterator[tuple[list[str], int]]:
    texts: list[str] = []
    nbytes = chars = 0
    for text, size in docs:
        texts.append(text)
        nbytes += size
        chars += len(text)
        # Whichever comes first: few large documents (whole files) still spread over workers.
        if len(texts) == _CHUNK_DOCS or chars >= _CHUNK_CHARS:
            yield texts, nbytes
            texts, nbytes, chars = [], 0, 0
    if texts:
        yield texts, nbytes


def _encoded_chunks(
    docs: Iterable[Document], tokenizer_json: str, workers: int
) -> Iterator[tuple[list[np.ndarray], int]]:
    """Encoded chunks in input order; ``workers > 1`` spreads them over that many processes."""
    if workers <= 1:
        tokenizer = _encoding_copy(tokenizer_json)
        # encode_batch already runs on the tokenizer's Rust thread pool.
        for texts, nbytes in _chunks(docs):
            yield _encode_texts(tokenizer, texts), nbytes
        return
    # spawn, not fork: forking after the Rust thread pool has started can deadlock.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _init_worker, (tokenizer_json,)) as pool:
        pending: deque = deque()
        for texts, nbytes in _chunks(docs):
            pending.append((pool.apply_async(_encode_in_worker, (texts,)), nbytes))
            # A bounded window keeps memory flat while every worker stays busy.
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield result.get(), size
        while pending:
            result, size = pending.popleft()
            yield result.get(), size


def _progress(enabled: bool, *, sized: bool = True) -> Progress:
    columns = (
        (BarColumn(), DownloadColumn(), TimeRemainingColumn())
        if sized
        else (SpinnerColumn(), TimeElapsedColumn())
    )
    return Progress(TextColumn("[bold]{task.description}"), *columns, disable=not enabled)


def encode_to_indexed(
    docs: Iterable[Document],
    tokenizer: Tokenizer,
    prefix: str | os.PathLike,
    *,
    total_bytes: int | None = None,
    workers: int = 1,
    progress: bool = True,
    index_format: str = "meshtron",
) -> tuple[int, int]:
    """Tokenize ``docs`` into ``PREFIX.bin/.idx`` (EOD after each); return (docs, tokens)."""
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    if eod_id is None:
        raise ValueError(f"tokenizer has no {EOD_TOKEN} token")
    vocab_size = tokenizer.get_vocab_size()
    content_tokens = 0
    with (
        IndexedDatasetWriter(
            prefix, vocab_size=vocab_size, eod_id=eod_id, index_format=index_format
        ) as writer,
        _progress(progress) as bar,
    ):
        task = bar.add_task("tokenizing", total=total_bytes)
        for encoded, nbytes in _encoded_chunks(docs, tokenizer.to_str(), workers):
            for ids in encoded:
                writer.add_document(ids)
                content_tokens += ids.size
            bar.advance(task, nbytes)
        if content_tokens == 0:
            raise ValueError("empty corpus: the inputs produced no tokens")
    return writer.num_docs, writer.num_tokens


def vocab_ceiling(texts: Iterable[str], wanted: int) -> int | None:
    """An upper bound on the ids a byte-level BPE can have after training on ``texts``;
    ``None`` once it reaches ``wanted`` (reading stops there: a plausible request costs a few
    documents, an impossible one a fast pass over the corpus).

    Each merge joins two symbols inside at least one distinct pre-tokenized word, so a word
    of n bytes allows at most n - 1 merges; on top come the 256 bytes and the special
    tokens. The byte-level pre-tokenizer never puts a non-space and a following space in
    one word, so splitting there instead (what ``_PIECES`` does, at C speed) gives pieces
    that each hold whole words, whose merges are bounded by the piece's bytes - 1.
    """
    pieces: set[str] = set()
    merges = 0
    for text in texts:
        if MIN_VOCAB_SIZE + merges >= wanted:
            return None
        for piece in _PIECES.findall(text):
            if piece not in pieces:
                pieces.add(piece)
                merges += len(piece.encode("utf-8")) - 1
    return None if MIN_VOCAB_SIZE + merges >= wanted else MIN_VOCAB_SIZE + merges


def _trained_tokenizer(docs: Callable[[], Iterator[Document]], vocab_size: int, progress: bool):
    """Train a BPE of ``vocab_size`` on ``docs()``: (tokenizer, notes)."""
    # The tokenizers library allocates for the asked size up front and aborts the process
    # when that fails, so a size the corpus cannot fill is refused before it is called.
    ceiling = vocab_ceiling((text for text, _ in docs()), vocab_size)
    if ceiling is not None and not any(text for text, _ in docs()):
        raise ValueError("empty corpus: the inputs contain no text")
    if ceiling is not None:
        raise ValueError(
            f"vocab size {vocab_size} (--vocab-size) is more than this corpus can yield: a "
            f"byte-level BPE trained on it has at most {ceiling} ids; give --vocab-size "
            f"{ceiling} or less, or more text"
        )
    with _progress(progress, sized=False) as bar:
        bar.add_task(f"training BPE ({vocab_size} ids)", total=None)
        tokenizer = train_tokenizer((text for text, _ in docs()), vocab_size)
    got = tokenizer.get_vocab_size()
    if got >= vocab_size:
        return tokenizer, ()
    note = (
        f"the trained vocabulary has {got} ids, fewer than the {vocab_size} asked: BPE ran out "
        "of pairs to merge (every word of the corpus is already one token); more text gives "
        f"more ids, and model.vocab_size={got} is enough for this tokenizer"
    )
    return tokenizer, (note,)


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    json_key: str | None = None,
    tokenizer_path: str | None = None,
    vocab_size: int | None = None,
    tokenizer_out: str | None = None,
    workers: int = 1,
    progress: bool = True,
    index_format: str = "meshtron",
) -> PreprocessResult:
    """Tokenize ``inputs`` with a loaded (``tokenizer_path``) or freshly trained BPE.

    ``json_key`` names the key of JSONL lines and the column of Parquet files;
    ``index_format`` is ``"meshtron"`` (checksummed, with the id range) or ``"megatron"``.
    """
    if (tokenizer_path is None) == (vocab_size is None):
        raise ValueError("give exactly one of a tokenizer to load or a vocab size to train")
    paths = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    tokenizer_out = tokenizer_out or f"{output_prefix}.tokenizer.json"
    # Fail (or succeed) on the output directories now, not after minutes of BPE training.
    outputs = [output_prefix] if tokenizer is not None else [output_prefix, tokenizer_out]
    for out in outputs:
        os.makedirs(os.path.dirname(os.fspath(out)) or ".", exist_ok=True)
    docs: Callable[[], Iterator[Document]] = lambda: iter_documents(paths, json_key=json_key)
    notes: tuple[str, ...] = ()
    if tokenizer is None:
        assert vocab_size is not None
        tokenizer, notes = _trained_tokenizer(docs, vocab_size, progress)
    num_docs, num_tokens = encode_to_indexed(
        docs(),
        tokenizer,
        output_prefix,
        total_bytes=sum(p.stat().st_size for p in paths),
        workers=workers,
        progress=progress,
        index_format=index_format,
    )
    if tokenizer_path is None:
        # Saved only once encoding succeeded: a failed run leaves no orphan tokenizer.
        tokenizer_path = tokenizer_out
        save_tokenizer(tokenizer, tokenizer_path)
    return PreprocessResult(
        output_prefix, str(tokenizer_path), num_docs, num_tokens, tokenizer.get_vocab_size(), notes
    )
