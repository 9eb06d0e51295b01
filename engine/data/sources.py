"""Corpora as people have them: text, JSONL (plain, ``.gz``, ``.zst``) and Parquet, as documents.

Each reader yields ``(text, nbytes)``: a document and the bytes of the file it consumed
(compressed bytes for a compressed file), which drive the progress bar against the files'
sizes. Every bad input is a ``ValueError`` naming the file and, where there is one, the line
or row. Nothing is read whole into memory but a text file, which is one document.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from engine.data.fsutil import file_problem, open_regular_file

Document = tuple[str, int]
"""A document's text and the number of input bytes it came from (drives the progress bar)."""

PARQUET_SUFFIXES = (".parquet", ".pq")
# Rows per Parquet batch: big enough to amortize pyarrow's per-batch cost, small in memory.
_PARQUET_BATCH_ROWS = 1024


def is_parquet(path: Path) -> bool:
    """Whether ``path`` is read as Parquet (by its name)."""
    return path.suffix.lower() in PARQUET_SUFFIXES


@contextmanager
def open_maybe_compressed(path: Path) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """``(decompressed stream, raw file)`` for ``path``: gzip for ``.gz``, zstd for ``.zst``.

    Anything but a regular file (a FIFO, a directory) is a ``ValueError`` naming it.
    """
    with open_regular_file(path) as raw:
        suffix = path.suffix.lower()
        if suffix == ".gz":
            yield gzip.GzipFile(fileobj=raw, mode="rb"), raw
        elif suffix in (".zst", ".zstd"):
            yield io.BufferedReader(_ZstdFrames(raw)), raw
        else:
            yield raw, raw


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames, one after another.

    A file that ends inside a frame is an ``EOFError``, as a cut gzip file is: zstandard's
    ``stream_reader`` returns what it decoded and then nothing, so a cut file read as a
    shorter whole one. Each frame's decompressor says whether it reached the frame's end.
    """

    _READ = 1 << 17  # compressed bytes per read of the file (what stream_reader reads)
    # Compressed bytes per decompress call: a call's output is at most 32768 times its input
    # (a 4-byte block can repeat one byte 128 KiB times), so this bounds it at 32 MiB.
    _FEED = 1 << 10

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard  # only for .zst inputs

        self._raw = raw
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of a frame begun and not yet ended
        self._input = memoryview(b"")  # read from the file, not yet decompressed
        self._rest = b""  # what followed a frame's end in the piece that ended it: next first
        self._output, self._at = b"", 0  # decompressed, returned up to _at

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._output):
            if not self._rest and not self._input:
                self._input = memoryview(self._raw.read(self._READ))
                if not self._input:
                    if self._frame is not None:
                        raise EOFError(
                            "Compressed file ended before the end-of-stream marker was reached"
                        )
                    return 0
            self._output, self._at = self._decompress(), 0
        n = min(len(buffer), len(self._output) - self._at)
        buffer[:n] = self._output[self._at : self._at + n]
        self._at += n
        return n

    def _decompress(self) -> bytes:
        """Feed the next piece of input; a frame's end starts the next frame after it."""
        if self._rest:
            piece, self._rest = self._rest, b""
        else:
            piece, self._input = self._input[: self._FEED], self._input[self._FEED :]
        if self._frame is None:
            self._frame = self._decompressor.decompressobj()
        output = self._frame.decompress(piece)
        if self._frame.eof:
            self._rest, self._frame = self._frame.unused_data, None
        return output


def _stream_errors(path: Path) -> tuple[type[BaseException], ...]:
    """What a corrupt or truncated compressed stream raises while it is read."""
    errors: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile)
    if path.suffix.lower() in (".zst", ".zstd"):
        import zstandard

        errors += (zstandard.ZstdError,)
    return errors


def iter_text(path: Path) -> Iterator[Document]:
    """The whole (possibly compressed) file as one UTF-8 document."""
    try:
        with open_maybe_compressed(path) as (stream, _):
            data = stream.read()
    except _stream_errors(path) as err:
        raise ValueError(f"{path}: cannot decompress ({err})") from None
    try:
        yield data.decode("utf-8"), path.stat().st_size
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_jsonl(path: Path, key: str) -> Iterator[Document]:
    """One document per non-blank line: the string under ``key``."""
    lineno = 0
    try:
        with open_maybe_compressed(path) as (stream, raw):
            consumed = 0
            for lineno, line in enumerate(stream, 1):  # noqa: B007 - named in the error below
                if not line.strip():
                    continue
                text = _json_text(path, lineno, line, key)
                # Bytes of the file read so far (blank lines included): the bar ends at its
                # size. A compressed file advances by its decompressor's blocks.
                position = raw.tell()
                yield text, position - consumed
                consumed = position
    except _stream_errors(path) as err:
        raise ValueError(f"{path}:{lineno + 1}: cannot decompress ({err})") from None


def _long_int(digits: str) -> int | float:
    # JSON integers have no length limit; Python converts at most 4300 digits from text. A
    # longer one (never the text) must not stop the line, so it is read as a float.
    try:
        return int(digits)
    except ValueError:
        return float(digits)


_JSON = json.JSONDecoder(parse_int=_long_int)


def _json_text(path: Path, lineno: int, line: bytes, key: str) -> str:
    where = f"{path}:{lineno}"
    try:
        # Strict UTF-8 (json.loads would let encoded surrogates through); a BOM may open a file.
        record = _JSON.decode(line.decode("utf-8-sig" if lineno == 1 else "utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply for Python's parser") from None
    if not isinstance(record, dict) or key not in record:
        raise ValueError(f"{where}: JSON line has no key {key!r}")
    value = record[key]
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: value of {key!r} is {kind}, expected a string")
    if not value.isascii():  # an escaped lone surrogate ("\\ud800") is no character of text
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: value of {key!r} holds the lone surrogate \\u{ord(value[e.start]):04x} "
                f"(character {e.start}), which is not text"
            ) from None
    return value


def iter_parquet(path: Path, column: str) -> Iterator[Document]:
    """One document per row: the string in ``column``, read in batches of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    problem = file_problem(path)
    if problem is not None:  # pyarrow would wait on a FIFO for ever
        raise ValueError(f"{path} {problem}; give a data file")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a Parquet file ({err})") from None
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise ValueError(
            f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); "
            "choose one with --text-key"
        )
    kind = schema.field(column).type
    if not _is_text(kind):
        raise ValueError(f"{path}: column {column!r} holds {kind}, expected strings")
    rows, size, row = parquet.metadata.num_rows, path.stat().st_size, 0
    batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column])
    with parquet:
        while True:
            try:
                texts = next(batches).column(0).to_pylist()
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as err:
                raise ValueError(f"{path}: unreadable Parquet after row {row} ({err})") from None
            for text in texts:
                if text is None:
                    raise ValueError(f"{path}: row {row}: {column!r} is null, expected a string")
                # Bytes are shared out over rows: the bar's total is the files' sizes.
                yield text, size * (row + 1) // rows - size * row // rows
                row += 1


def _is_text(kind) -> bool:
    """Whether Arrow type ``kind`` holds strings: plain, large, view, or dictionary-encoded."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    )


def is_jsonl(path: Path) -> bool:
    """Whether ``path`` is named as JSON lines (``.jsonl``, ``.ndjson``, either compressed)."""
    name = path.name.lower().removesuffix(".gz").removesuffix(".zst")
    return name.endswith((".jsonl", ".ndjson"))


def iter_source(path: Path, key: str | None) -> Iterator[Document]:
    """Documents of one input file: Parquet by name, else JSONL when ``key`` is given, else text.

    A file named as JSONL needs ``key`` too: read as text, its JSON syntax would become one
    document of training data."""
    if is_parquet(path):
        if key is None:
            raise ValueError(f"{path}: a Parquet input needs --text-key COLUMN")
        return iter_parquet(path, key)
    if key is None and is_jsonl(path):
        raise ValueError(
            f"{path}: a JSONL input needs --text-key KEY, the key holding each document "
            "(e.g. --text-key text)"
        )
    return iter_jsonl(path, key) if key is not None else iter_text(path)
