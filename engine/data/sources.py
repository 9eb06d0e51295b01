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
    """``(decompressed stream, raw file)`` for ``path``: gzip for ``.gz``, zstd for ``.zst``."""
    with open(path, "rb") as raw:
        suffix = path.suffix.lower()
        if suffix == ".gz":
            yield gzip.GzipFile(fileobj=raw, mode="rb"), raw
        elif suffix in (".zst", ".zstd"):
            import zstandard  # only for .zst inputs

            reader = zstandard.ZstdDecompressor().stream_reader(
                raw, read_across_frames=True, closefd=False
            )
            yield io.BufferedReader(reader), raw
        else:
            yield raw, raw


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


def _json_text(path: Path, lineno: int, line: bytes, key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 ({e.reason})") from None
    if not isinstance(record, dict) or key not in record:
        raise ValueError(f"{path}:{lineno}: JSON line has no key {key!r}")
    value = record[key]
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{path}:{lineno}: value of {key!r} is {kind}, expected a string")
    return value


def iter_parquet(path: Path, column: str) -> Iterator[Document]:
    """One document per row: the string in ``column``, read in batches of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
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


def iter_source(path: Path, key: str | None) -> Iterator[Document]:
    """Documents of one input file: Parquet by name, else JSONL when ``key`` is given, else text."""
    if is_parquet(path):
        if key is None:
            raise ValueError(f"{path}: a Parquet input needs --text-key COLUMN")
        return iter_parquet(path, key)
    return iter_jsonl(path, key) if key is not None else iter_text(path)
