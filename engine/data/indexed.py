"""Token storage on disk: a flat ``PREFIX.bin`` of token ids and a ``PREFIX.idx`` of documents.

``.idx`` layout (little endian)::

    magic       8 bytes   b"MSHTIDX\\0"
    version     uint32    1
    itemsize    uint8     2 (uint16 ids) or 4 (uint32 ids)
    padding     3 bytes
    eod_id      int64     token id appended after every document
    num_docs    uint64
    num_tokens  uint64
    doc_offsets int64[num_docs + 1]   token offset of each document start, then the total

Document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i + 1]]`` and ends with ``eod_id``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from engine.data.fsutil import temp_path_beside

MAGIC = b"MSHTIDX\0"
VERSION = 1
_HEADER = struct.Struct("<8sIB3xqQQ")
_DTYPES = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest supported unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def index_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    Validates magic, version, dtype and that the ``.bin`` size matches the index, so a
    truncated or mismatched pair fails here with the file named rather than as garbage later.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.bin_path, self.idx_path = index_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file")
        with open(self.idx_path, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            raise ValueError(f"{self.idx_path}: not a meshtron index (bad magic)")
        _, version, itemsize, eod_id, num_docs, num_tokens = _HEADER.unpack(header)
        if version != VERSION:
            raise ValueError(f"{self.idx_path}: index version {version}, expected {VERSION}")
        if itemsize not in _DTYPES:
            raise ValueError(f"{self.idx_path}: unsupported token itemsize {itemsize}")
        idx_size = _HEADER.size + 8 * (num_docs + 1)
        if self.idx_path.stat().st_size != idx_size:
            raise ValueError(
                f"{self.idx_path}: {self.idx_path.stat().st_size} bytes, expected {idx_size} "
                f"for {num_docs} documents (truncated index?)"
            )
        self.dtype = _DTYPES[itemsize]
        self.eod_id = int(eod_id)
        bin_size, expected = self.bin_path.stat().st_size, num_tokens * itemsize
        if bin_size != expected:
            raise ValueError(
                f"{self.bin_path}: {bin_size} bytes, but {self.idx_path.name} expects "
                f"{num_tokens} tokens x {itemsize} bytes = {expected} bytes (truncated or mismatched)"
            )
        self.doc_offsets: np.ndarray = np.memmap(
            self.idx_path, dtype=np.int64, mode="r", offset=_HEADER.size, shape=(num_docs + 1,)
        )
        if self.doc_offsets[0] != 0 or self.doc_offsets[-1] != num_tokens:
            raise ValueError(f"{self.idx_path}: document offsets do not span {num_tokens} tokens")
        # np.memmap refuses zero-length files.
        self.tokens: np.ndarray = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r")
            if num_tokens
            else np.empty(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Total stored tokens, end-of-document tokens included."""
        return len(self.tokens)

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (a memmap view; its last id is ``eod_id``)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        i %= len(self)
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]

    def doc_range_tokens(self, doc_range: tuple[int, int] | None = None) -> np.ndarray:
        """Flat tokens of documents ``start .. end - 1`` (all documents when ``None``)."""
        start, end = (0, len(self)) if doc_range is None else doc_range
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"doc_range {doc_range} outside 0..{len(self)} documents")
        return self.tokens[self.doc_offsets[start] : self.doc_offsets[end]]


class IndexedDatasetWriter:
    """Append documents to a new ``PREFIX.bin`` / ``PREFIX.idx`` pair, atomically.

    Use as a context manager: data goes to temp files beside the targets and is renamed into
    place only when the ``with`` body finishes without error. The old ``.idx`` is removed
    before the new ``.bin`` lands, so a crash mid-commit leaves no pair that validates.
    """

    def __init__(self, prefix: str | os.PathLike, *, vocab_size: int, eod_id: int) -> None:
        if not 0 <= eod_id < vocab_size:
            raise ValueError(f"eod_id {eod_id} outside vocabulary of size {vocab_size}")
        self.bin_path, self.idx_path = index_paths(prefix)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self._offsets = [0]
        self._tmp_bin = temp_path_beside(self.bin_path)
        self._tmp_idx = temp_path_beside(self.idx_path)
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in __exit__

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        """Append one document's ids followed by the end-of-document token."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id outside vocabulary of size {self.vocab_size}")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._bin.write(np.array([self.eod_id], self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + ids.size + 1)

    @property
    def num_docs(self) -> int:
        """Documents added so far."""
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens written so far, end-of-document tokens included."""
        return self._offsets[-1]

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            if exc_type is None:
                self._commit()
        finally:
            self._bin.close()
            self._tmp_bin.unlink(missing_ok=True)
            self._tmp_idx.unlink(missing_ok=True)

    def _commit(self) -> None:
        offsets = np.asarray(self._offsets, dtype=np.int64)
        header = _HEADER.pack(
            MAGIC, VERSION, self.dtype.itemsize, self.eod_id, len(offsets) - 1, offsets[-1]
        )
        with open(self._tmp_idx, "wb") as f:
            f.write(header)
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)
