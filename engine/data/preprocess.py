"""Corpus -> byte-level BPE -> ``PREFIX.bin`` / ``PREFIX.idx`` (the engine behind the CLI)."""

from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from pathlib import Path
from typing import NoReturn

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

from engine.data.fsutil import (
    MISSING,
    LockHeld,
    atomic_output,
    file_problem,
    pid_lock,
    remove_dead_temps,
)
from engine.data.indexed import IndexedDatasetWriter, index_paths
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


def _check_replaced_tokenizer(tokenizer: Tokenizer, path: str) -> None:
    """Refuse, before anything is written, to replace the tokenizer at ``path`` with another
    one: runs trained on data it tokenized record its SHA-256, and their evaluation and
    generation refuse a changed file. The same tokenizer again (the same inputs: BPE
    training is deterministic) is fine."""
    if not Path(path).is_file():
        return
    try:
        same = Tokenizer.from_file(str(path)).to_str() == tokenizer.to_str()
    except Exception:  # noqa: BLE001 - not a tokenizer file: not one a run recorded either
        return
    if not same:
        raise ValueError(
            f"{path} exists and the tokenizer trained now is another one (other inputs or "
            "--vocab-size); runs trained with it would refuse a replaced file: pass "
            f"--tokenizer {path} to encode with it, --tokenizer-out PATH to keep both, or "
            "delete it first"
        )


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


# A longer document is encoded in pieces of about this many characters: the tokenizers
# library holds about 130 bytes per character of one encode call (an 18.6 MB one-line
# document peaked at 2.5 GB), so one huge document could take a worker out of memory.
_LONG_DOC_CHARS = 1 << 20
# A whitespace character right after a non-space: byte-level pre-tokenization (GPT-2's
# pattern) never joins the two into one word, so ids of pieces cut there concatenate to
# the ids of the whole.
_WORD_END = re.compile(r"(?<=\S)\s")


def _splits_safely(tokenizer: Tokenizer) -> bool:
    """Whether a text cut at ``_WORD_END`` encodes to the ids of the whole: a byte-level
    pre-tokenizer that splits on its pattern and adds no prefix space, and no normalizer
    (one may add a prefix to every piece, as SentencePiece's ▁ does)."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    return spec.get("normalizer") is None and byte_level and not pre.get("add_prefix_space")


def _pieces(text: str) -> list[str]:
    """``text`` cut at word ends into pieces of about ``_LONG_DOC_CHARS`` characters (one
    piece when it is shorter, or has no word end past that length)."""
    pieces, start = [], 0
    while len(text) - start > _LONG_DOC_CHARS:
        end = _WORD_END.search(text, start + _LONG_DOC_CHARS)
        if end is None:
            break
        pieces.append(text[start : end.start()])
        start = end.start()
    return [*pieces, text[start:]]


def _encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if any(len(t) > _LONG_DOC_CHARS for t in texts) and _splits_safely(tokenizer):
        pieces = [_pieces(t) for t in texts]
        flat = [p for doc in pieces for p in doc]
        ids = iter(_encode_texts_whole(tokenizer, flat))
        return [np.concatenate([next(ids) for _ in doc]) for doc in pieces]
    return _encode_texts_whole(tokenizer, texts)


def _encode_texts_whole(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]


class EncodeWorkerDied(RuntimeError):
    """An encoding worker process ended unasked (killed, e.g. by the out-of-memory killer)."""


def _encode_worker(conn: Connection, tokenizer_json: str, encode: Callable) -> None:
    """A spawned worker: encode each chunk that arrives on ``conn``, send it back; stop at EOF."""
    # One Rust thread per worker process: the process count is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C is the parent's to handle: it tears the workers down; they stay quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = _encoding_copy(tokenizer_json)
    while True:
        try:
            texts = conn.recv()
        except (EOFError, OSError):  # the parent is done, or gone
            return
        try:
            reply = (True, encode(tokenizer, texts))
        except Exception as err:  # the parent raises it
            reply = (False, err)
        try:
            conn.send(reply)
        except OSError:  # the parent died (killed): nobody to tell
            return


class _EncodePool:
    """Up to ``size`` spawned encode workers, each with a pipe of its own and one chunk in
    flight (so neither end can block sending while the other does).

    The parent waits on the workers' sentinels as well as their pipes, so a worker that dies
    (the out-of-memory killer's SIGKILL) raises :class:`EncodeWorkerDied` naming the inputs it
    was encoding instead of a wait forever. Workers start as chunks need them.
    """

    def __init__(self, size: int, tokenizer_json: str) -> None:
        self._ctx = multiprocessing.get_context("spawn")  # forking after Rust threads can hang
        self._size, self._json = size, tokenizer_json
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        self.busy: dict[int, tuple[int, str]] = {}  # worker -> (chunk number, its inputs)

    def idle_worker(self) -> int | None:
        """An idle worker's number (started if need be), or ``None`` when all are busy."""
        for i in range(len(self._workers)):
            if i not in self.busy:
                return i
        if len(self._workers) == self._size:
            return None
        here, there = self._ctx.Pipe()
        # _encode_texts is looked up now, not at import: a test can swap in a faulty one.
        args = (there, self._json, _encode_texts)
        process = self._ctx.Process(target=_encode_worker, args=args, daemon=True)
        with _children_ignore_sigint():
            process.start()
        there.close()
        self._workers.append((process, here))
        return len(self._workers) - 1

    def submit(self, worker: int, seq: int, texts: list[str], inputs: str) -> None:
        """Send chunk ``seq`` (documents of ``inputs``) to an idle ``worker``."""
        self.busy[worker] = (seq, inputs)
        # A dead worker's pipe refuses this; its sentinel says how it died, in wait().
        with contextlib.suppress(OSError):
            self._workers[worker][1].send(texts)

    def wait(self) -> list[tuple[int, list[np.ndarray]]]:
        """Block until a busy worker answers; return the chunks that came back."""
        waitables = [
            w for i in self.busy for w in (self._workers[i][1], self._workers[i][0].sentinel)
        ]
        ready = set(connection_wait(waitables))
        done = []
        for i in list(self.busy):
            process, conn = self._workers[i]
            if conn in ready:
                try:
                    ok, result = conn.recv()
                except (EOFError, OSError):  # it died mid-answer
                    self._died(i)
                if not ok:
                    raise result
                done.append((self.busy.pop(i)[0], result))
            elif process.sentinel in ready:
                self._died(i)
        return done

    def _died(self, worker: int) -> NoReturn:
        process, _ = self._workers[worker]
        process.join()
        code = process.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal has no name
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        hint = " (the out-of-memory killer sends it: fewer --workers need less memory)"
        raise EncodeWorkerDied(
            f"encoding worker PID {process.pid} {how} while encoding {self.busy[worker][1]}"
            f"{hint if code == -signal.SIGKILL else ''}; nothing was written"
        )

    def close(self) -> None:
        """Stop every worker: an EOF after a full run, a kill after an error."""
        clean = not self.busy
        for process, conn in self._workers:
            conn.close()
            if not clean:
                process.kill()
        for process, _ in self._workers:
            process.join()


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Processes started in the body are born ignoring Ctrl-C (an ignored signal stays so
    across exec): a worker still importing would otherwise die of it with a traceback.

    The parent blocks SIGINT and SIGTERM meanwhile: one that comes then waits for the start
    to finish (the CLI turns both into KeyboardInterrupt), so no child is left half started.
    """
    if threading.current_thread() is not threading.main_thread() or not signal.getsignal(
        signal.SIGINT
    ):
        yield  # only the main thread may set handlers, and only Python's can be put back
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _chunks(
    docs: Iterable[Document], source: Callable[[], str]
) -> Iterator[tuple[list[str], int, str]]:
    """(texts, bytes, the inputs they came from) of up to _CHUNK_DOCS documents each."""
    texts: list[str] = []
    inputs: list[str] = []
    nbytes = chars = 0
    for text, size in docs:
        texts.append(text)
        if not inputs or inputs[-1] != source():
            inputs.append(source())
        nbytes += size
        chars += len(text)
        # Whichever comes first: few large documents (whole files) still spread over workers.
        if len(texts) == _CHUNK_DOCS or chars >= _CHUNK_CHARS:
            yield texts, nbytes, _name_inputs(inputs)
            texts, inputs, nbytes, chars = [], [], 0, 0
    if texts:
        yield texts, nbytes, _name_inputs(inputs)


def _name_inputs(inputs: list[str]) -> str:
    if len(inputs) <= 3:
        return ", ".join(inputs)
    return f"{inputs[0]} ... {inputs[-1]} ({len(inputs)} inputs)"


def _encoded_chunks(
    docs: Iterable[Document],
    tokenizer_json: str,
    workers: int,
    source: Callable[[], str] = lambda: "the input",
) -> Iterator[tuple[list[np.ndarray], int]]:
    """Encoded chunks in input order; ``workers > 1`` spreads them over that many processes.

    ``source()`` names the input being read, for the error when a worker dies.
    """
    if workers <= 1:
        tokenizer = _encoding_copy(tokenizer_json)
        # encode_batch already runs on the tokenizer's Rust thread pool.
        for texts, nbytes, _ in _chunks(docs, source):
            yield _encode_texts(tokenizer, texts), nbytes
        return
    pool = _EncodePool(workers, tokenizer_json)
    chunks = enumerate(_chunks(docs, source))
    sizes: dict[int, int] = {}  # bytes of each chunk sent and not yet yielded
    done: dict[int, list[np.ndarray]] = {}
    next_out = 0

    def feed() -> None:
        # At most 2 * workers chunks past the next one out: memory stays flat behind a slow one.
        while len(sizes) < 2 * workers and (worker := pool.idle_worker()) is not None:
            chunk = next(chunks, None)
            if chunk is None:
                return
            seq, (texts, nbytes, inputs) = chunk
            sizes[seq] = nbytes
            pool.submit(worker, seq, texts, inputs)

    try:
        feed()
        while pool.busy:
            done.update(pool.wait())
            feed()  # before yielding, so workers encode while the parent writes
            while next_out in done:
                yield done.pop(next_out), sizes.pop(next_out)
                next_out += 1
                feed()
    finally:
        pool.close()


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
    source: Callable[[], str] = lambda: "the input",
) -> tuple[int, int]:
    """Tokenize ``docs`` into ``PREFIX.bin/.idx`` (EOD after each); return (docs, tokens).

    ``source()`` names the input being read, for the error when a worker process dies.
    """
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
        chunks = _encoded_chunks(docs, tokenizer.to_str(), workers, source)
        with contextlib.closing(chunks):  # an error here stops the workers now
            for encoded, nbytes in chunks:
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
    One run at a time writes a prefix: ``PREFIX.lock`` holds its PID while it does.
    """
    if (tokenizer_path is None) == (vocab_size is None):
        raise ValueError("give exactly one of a tokenizer to load or a vocab size to train")
    _check_output_prefix(output_prefix)
    paths = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    tokenizer_out = tokenizer_out or f"{output_prefix}.tokenizer.json"
    outputs = {"the output": [*index_paths(output_prefix), Path(f"{output_prefix}.lock")]}
    if tokenizer is None:
        outputs["--tokenizer-out"] = [Path(tokenizer_out)]
    _check_outputs_spare_inputs(paths, outputs)
    # Fail (or succeed) on the output directories now, not after minutes of BPE training.
    for directory in {p.parent for names in outputs.values() for p in names}:
        _make_output_dir(directory)
    docs = _InputDocuments(paths, json_key)
    with _output_lock(output_prefix, [p for names in outputs.values() for p in names]) as notes:
        if tokenizer is None:
            assert vocab_size is not None
            tokenizer, trained = _trained_tokenizer(lambda: iter(docs), vocab_size, progress)
            notes.extend(trained)
            _check_replaced_tokenizer(tokenizer, tokenizer_out)
        num_docs, num_tokens = encode_to_indexed(
            docs,
            tokenizer,
            output_prefix,
            total_bytes=sum(p.stat().st_size for p in paths),
            workers=workers,
            progress=progress,
            index_format=index_format,
            source=lambda: docs.reading,
        )
        if tokenizer_path is None:
            # Saved only once encoding succeeded: a failed run leaves no orphan tokenizer.
            tokenizer_path = tokenizer_out
            save_tokenizer(tokenizer, tokenizer_path)
    return PreprocessResult(
        output_prefix,
        str(tokenizer_path),
        num_docs,
        num_tokens,
        tokenizer.get_vocab_size(),
        tuple(notes),
    )


class _InputDocuments:
    """The documents of ``paths`` in order; ``reading`` names the file being read."""

    def __init__(self, paths: Sequence[Path], json_key: str | None) -> None:
        self.paths, self.json_key, self.reading = paths, json_key, "the input"

    def __iter__(self) -> Iterator[Document]:
        for path in self.paths:
            self.reading = str(path)
            yield from iter_source(path, self.json_key)


def _check_output_prefix(prefix: str) -> None:
    """Refuse a prefix that names a directory: its files would be hidden ``dir/.bin``."""
    if not prefix:
        raise ValueError("--output-prefix is empty: give a file name prefix such as data/corpus")
    if os.path.isdir(prefix) or os.path.basename(prefix) in ("", ".", ".."):
        example = os.path.join(prefix.rstrip("/" + os.sep) or "/", "corpus")
        raise IsADirectoryError(
            f"--output-prefix {prefix} is a directory: give a file name prefix such as "
            f"{example} (writes {example}.bin and {example}.idx)"
        )


def _check_outputs_spare_inputs(inputs: list[Path], outputs: dict[str, list[Path]]) -> None:
    """Refuse, before anything is written, outputs that would overwrite an input, each other
    or a directory, and an input given twice (its documents would be tokenized twice)."""
    seen: dict[tuple[int, int], Path] = {}
    for path in inputs:
        st = path.stat()
        if (st.st_dev, st.st_ino) in seen:
            also = seen[st.st_dev, st.st_ino]
            spelled = "" if str(also) == str(path) else f" (also as {also})"
            raise ValueError(
                f"input {path} is given twice{spelled}: its documents would be tokenized "
                "twice; give each input once"
            )
        seen[st.st_dev, st.st_ino] = path
    written: dict[str, str] = {}
    for role, paths in outputs.items():
        for out in paths:
            key = os.path.abspath(out)
            if key in written and written[key] != role:
                raise ValueError(
                    f"{out} would be written both as {role} and as {written[key]}: give "
                    "another --tokenizer-out"
                )
            written[key] = role
            if out.is_dir():
                raise IsADirectoryError(f"{out} ({role}) is a directory: give another name")
            if out.exists() and (out.stat().st_dev, out.stat().st_ino) in seen:
                raise ValueError(
                    f"{out} is an input and would be overwritten as {role}: preprocessing "
                    "never overwrites its inputs; give another output name"
                )


def _make_output_dir(directory: Path) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next(p for p in (directory, *directory.parents) if p.exists() and not p.is_dir())
        raise NotADirectoryError(
            f"cannot write into {directory}: {blocker} is a file, not a directory"
        ) from None


@contextlib.contextmanager
def _creating(path: str) -> Iterator[None]:
    """Name the folder and the fix when the first file of the output cannot be created
    there (a read-only or virtual file system), instead of the bare OSError."""
    try:
        yield
    except OSError as err:  # FileNotFoundError, PermissionError, a read-only file system
        if err.filename != path:
            raise
        raise OSError(
            f"cannot write into {os.path.dirname(path) or '.'} ({err.strerror}): give an "
            "--output-prefix in a writable folder"
        ) from None


@contextlib.contextmanager
def _output_lock(prefix: str, outputs: list[Path]) -> Iterator[list[str]]:
    """Hold ``PREFIX.lock`` for the body, which gets a list of notes for the user.

    A lock left by a run that died is taken over, and the temp files that runs which died
    left beside the outputs are removed; the notes say so.
    """
    lock = f"{prefix}.lock"
    try:
        with _creating(lock), pid_lock(lock) as dead_holder:
            notes = []
            if dead_holder is not None:
                notes.append(
                    f"took over {lock} from PID {dead_holder}, a run that did not end cleanly "
                    "(no longer running)"
                )
            removed = [t for out in outputs for t in remove_dead_temps(out)]
            if removed:
                notes.append(
                    f"removed {len(removed)} temporary file(s) of runs that died: "
                    + ", ".join(str(t) for t in removed)
                )
            yield notes
    except LockHeld as held:
        raise LockHeld(
            f"{prefix}.bin/.idx are being written by another run (PID {held.pid}, holding "
            f"{lock}): wait for it to end, or give another --output-prefix",
            held.pid,
        ) from None
