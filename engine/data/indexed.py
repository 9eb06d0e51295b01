"""Token storage on disk: a flat ``PREFIX.bin`` of token ids and a ``PREFIX.idx`` of documents.

``.idx`` layout (little endian)::

    magic       8 bytes   b"MSHTIDX\\0"
    version     uint32    3 (1, 2: written before the fields marked v2, v3; still read)
    itemsize    uint8     2 (uint16 ids) or 4 (uint32 ids)
    padding     3 bytes
    eod_id      int64     token id appended after every document
    num_docs    uint64
    num_tokens  uint64
    min_token   int64     v2: smallest id in the .bin (0 when it is empty)
    max_token   int64     v2: largest id in the .bin (-1 when it is empty)
    bin_sha256  32 bytes  v2: SHA-256 of the whole .bin
    doc_offsets int64[num_docs + 1]   token offset of each document start, then the total
    idx_sha256  32 bytes  v3: SHA-256 of every byte of the .idx before it

Document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i + 1]]`` and ends with ``eod_id``.
The recorded token range lets a run check the ids against its vocabulary. ``bin_sha256``
covers the data and ``idx_sha256`` every header field (the range and ``bin_sha256``
included) and the offsets. :meth:`IndexedDataset.verify` checks both and compares the
recorded range with the ids it reads, so a header that claims a smaller largest id than the
data holds is refused. A version 2 index (a range no checksum covered) still loads and
verifies the same way, less the index checksum.

:class:`IndexedDataset` also reads Megatron-LM's ``.idx`` (see ``megatron_index``), told apart
by its magic; :class:`IndexedDatasetWriter` writes either; :func:`convert_index` rewrites one
index as the other over the same ``.bin``.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from engine.data.fsutil import atomic_output, temp_path_beside
from engine.data.megatron_index import (
    is_megatron_index,
    megatron_dtype,
    megatron_index_bytes,
    read_megatron_index,
)

MAGIC = b"MSHTIDX\0"
VERSION = 3
_HEADER = struct.Struct("<8sIB3xqQQ")
_HEADER_V2 = struct.Struct("<qq32s")  # follows _HEADER from version 2 on
_TRAILER_V3 = 32  # bytes of idx_sha256, after the document offsets, from version 3 on
_CHUNK_BYTES = 8 << 20
_DTYPES = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
INDEX_FORMATS = ("meshtron", "megatron")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest supported unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def index_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair, ours or Megatron's.

    Validates magic, version, dtype and that the ``.bin`` size matches the index, so a
    truncated or mismatched pair fails here with the file named rather than as garbage later.
    ``eod_id`` is used only for a Megatron index, which does not record it (``None``: unknown).
    ``format`` says which index was read.
    """

    def __init__(self, prefix: str | os.PathLike, *, eod_id: int | None = None) -> None:
        self.bin_path, self.idx_path = index_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file")
        with open(self.idx_path, "rb") as f:
            header = f.read(_HEADER.size + _HEADER_V2.size)
        if is_megatron_index(header):
            self._open_megatron(eod_id)
        else:
            self._open_meshtron(header)
        num_tokens = int(self.doc_offsets[-1])
        bin_size, expected = self.bin_path.stat().st_size, num_tokens * self.dtype.itemsize
        if bin_size != expected:
            raise ValueError(
                f"{self.bin_path}: {bin_size} bytes, but {self.idx_path.name} expects "
                f"{num_tokens} tokens x {self.dtype.itemsize} bytes = {expected} bytes "
                "(truncated or mismatched)"
            )
        # np.memmap refuses zero-length files.
        self.tokens: np.ndarray = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r")
            if num_tokens
            else np.empty(0, self.dtype)
        )

    def _open_megatron(self, eod_id: int | None) -> None:
        """A Megatron-LM pair: no recorded eod id, range or checksum (verify scans the ids)."""
        index = read_megatron_index(self.idx_path)
        self.format, self.version = "megatron", 1
        self.dtype = index.dtype
        # Megatron's index does not record it: the caller's tokenizer says which id it is.
        self.eod_id = eod_id
        self.token_range = None
        self.bin_sha256 = None
        self.doc_offsets = index.doc_offsets
        self._sequences = (index.sequence_lengths, index.document_indices)

    def _open_meshtron(self, header: bytes) -> None:
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            raise ValueError(
                f"{self.idx_path}: neither a meshtron nor a Megatron index (bad magic)"
            )
        _, version, itemsize, eod_id, num_docs, num_tokens = _HEADER.unpack_from(header)
        if version not in (1, 2, VERSION):
            raise ValueError(
                f"{self.idx_path}: index version {version}, this reads 1 to {VERSION}; "
                "re-run tools/preprocess_data.py"
            )
        if itemsize not in _DTYPES:
            raise ValueError(f"{self.idx_path}: unsupported token itemsize {itemsize}")
        self.format, self.version = "meshtron", version
        # Version 1 recorded neither the token range nor a checksum: verify() scans for them.
        self.token_range: tuple[int, int] | None = None
        self.bin_sha256: str | None = None
        offsets_at = _HEADER.size
        if version >= 2:
            if len(header) < _HEADER.size + _HEADER_V2.size:
                raise ValueError(f"{self.idx_path}: truncated index header")
            lo, hi, digest = _HEADER_V2.unpack_from(header, _HEADER.size)
            self.token_range, self.bin_sha256 = (int(lo), int(hi)), digest.hex()
            offsets_at += _HEADER_V2.size
        idx_size = offsets_at + 8 * (num_docs + 1) + (_TRAILER_V3 if version >= 3 else 0)
        if self.idx_path.stat().st_size != idx_size:
            raise ValueError(
                f"{self.idx_path}: {self.idx_path.stat().st_size} bytes, expected {idx_size} "
                f"for {num_docs} documents (truncated index?)"
            )
        self.dtype = _DTYPES[itemsize]
        self.eod_id = int(eod_id)
        self.doc_offsets: np.ndarray = np.memmap(
            self.idx_path, dtype=np.int64, mode="r", offset=offsets_at, shape=(num_docs + 1,)
        )
        self._sequences = None
        self._check_offsets(num_tokens)

    def _check_offsets(self, num_tokens: int) -> None:
        if self.doc_offsets[0] != 0 or self.doc_offsets[-1] != num_tokens:
            raise ValueError(f"{self.idx_path}: document offsets do not span {num_tokens} tokens")
        # Every document holds at least its end-of-document token, so offsets strictly rise.
        rises = np.diff(self.doc_offsets) > 0
        if not rises.all():
            doc = int(np.argmin(rises))
            raise ValueError(
                f"{self.idx_path}: document offsets are not increasing at document {doc} "
                f"({self.doc_offsets[doc]} then {self.doc_offsets[doc + 1]}); the index is "
                "damaged: re-run tools/preprocess_data.py"
            )

    def __len__(self) -> int:
        return len(self.doc_offsets) - 1

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's view: (tokens per sequence, first sequence of each document then the count).

        A meshtron document is one sequence; a Megatron index may split documents further.
        """
        if self._sequences is not None:
            return self._sequences
        return np.diff(self.doc_offsets), np.arange(len(self) + 1, dtype=np.int64)

    def check_bin_digest(self, digest: str) -> None:
        """ValueError naming the ``.bin`` unless ``digest`` (its SHA-256, hex) is the one the
        index recorded (nothing to check for an index that recorded none)."""
        if self.bin_sha256 is not None and digest != self.bin_sha256:
            raise ValueError(
                f"{self.bin_path}: SHA-256 does not match the one {self.idx_path.name} recorded "
                "(changed or damaged after preprocessing); re-run tools/preprocess_data.py"
            )

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError naming the file unless every id fits a vocabulary of ``vocab_size``.

        Reads the ``.bin`` once, for its SHA-256 and its id range: the SHA-256 must be the
        recorded one and the range the recorded one (versions 2 and 3), and the range must lie
        in the vocabulary (ids past it read nothing from a vocab-parallel shard at tp >= 2).
        Also checks that every document ends with ``eod_id``, and last the index's own
        checksum (version 3), so that a field's own check names it first.
        """
        if self.eod_id is not None and not 0 <= self.eod_id < vocab_size:
            raise ValueError(
                f"{self.idx_path}: eod_id={self.eod_id} is outside the model's vocabulary of "
                f"{vocab_size} ids; the index is damaged or made with another tokenizer"
            )
        digest, (lo, hi) = self._read_bin()
        self.check_bin_digest(digest)
        if self.token_range is not None and self.token_range != (lo, hi):
            raise ValueError(
                f"{self.idx_path}: records token ids {self.token_range[0]}..{self.token_range[1]}"
                f" but {self.bin_path.name} holds {lo}..{hi}; the index is damaged: re-run "
                "tools/preprocess_data.py"
            )
        if self.num_tokens and (lo < 0 or hi >= vocab_size):
            raise ValueError(
                f"{self.bin_path}: token ids {lo}..{hi}, outside the model's vocabulary of "
                f"{vocab_size} ids (model.vocab_size; largest id {hi}); the data was made with "
                "another tokenizer: preprocess it with the model's"
            )
        # Megatron appends an end-of-document id only when asked (--append-eod).
        if self.format == "meshtron":
            self._check_doc_ends()
        if self.version >= 3 and not self._index_intact():
            raise ValueError(
                f"{self.idx_path}: header or document offsets do not match the index's "
                "checksum (edited or damaged after preprocessing); re-run tools/preprocess_data.py"
            )

    def _index_intact(self) -> bool:
        raw = self.idx_path.read_bytes()
        return hashlib.sha256(raw[:-_TRAILER_V3]).digest() == raw[-_TRAILER_V3:]

    def _check_doc_ends(self) -> None:
        ends = self.tokens[self.doc_offsets[1:] - 1] if len(self) else np.empty(0)
        if (ends != self.eod_id).any():
            doc = int(np.argmax(ends != self.eod_id))
            raise ValueError(
                f"{self.idx_path}: document {doc} does not end with eod_id={self.eod_id}; "
                "the index does not match its .bin: re-run tools/preprocess_data.py"
            )

    def _chunks(self):
        step = _CHUNK_BYTES // self.dtype.itemsize
        for start in range(0, self.num_tokens, step):
            yield np.asarray(self.tokens[start : start + step])

    def _read_bin(self) -> tuple[str, tuple[int, int]]:
        """SHA-256 (hex) and ``(min, max)`` id of the ``.bin`` (``(0, -1)`` when empty), in
        one pass."""
        digest, lo, hi = hashlib.sha256(), 0, -1
        for i, chunk in enumerate(self._chunks()):
            digest.update(chunk.tobytes())
            lo = int(chunk.min()) if i == 0 else min(lo, int(chunk.min()))
            hi = max(hi, int(chunk.max()))
        return digest.hexdigest(), (lo, hi)

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

    def __init__(
        self,
        prefix: str | os.PathLike,
        *,
        vocab_size: int,
        eod_id: int,
        index_format: str = "meshtron",
    ) -> None:
        if not 0 <= eod_id < vocab_size:
            raise ValueError(f"eod_id {eod_id} outside vocabulary of size {vocab_size}")
        if index_format not in INDEX_FORMATS:
            raise ValueError(f"index format {index_format!r}: choose one of {INDEX_FORMATS}")
        self.bin_path, self.idx_path = index_paths(prefix)
        self.index_format = index_format
        self.dtype = (
            token_dtype(vocab_size) if index_format == "meshtron" else megatron_dtype(vocab_size)
        )
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self._offsets = [0]
        self._range = [0, -1]  # ids seen so far: [min, max]; -1 while none
        self._sha256 = hashlib.sha256()
        self._tmp_bin = temp_path_beside(self.bin_path)
        self._tmp_idx = temp_path_beside(self.idx_path)
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in __exit__

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        """Append one document's ids followed by the end-of-document token."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id outside vocabulary of size {self.vocab_size}")
        data = np.append(ids.astype(self.dtype, copy=False), self.dtype.type(self.eod_id))
        lo, hi = int(data.min()), int(data.max())
        first = self._range[1] < 0
        self._range = [lo if first else min(lo, self._range[0]), max(hi, self._range[1])]
        self._bin.write(data.tobytes())
        self._sha256.update(data.tobytes())
        self._offsets.append(self._offsets[-1] + data.size)

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
        if self.index_format == "megatron":
            # One sequence per document, as Megatron's preprocess_data.py without sentence splits.
            index = megatron_index_bytes(self.dtype, np.diff(offsets), np.arange(len(offsets)))
        else:
            index = _meshtron_index_bytes(
                self.dtype, self.eod_id, offsets, self._range, self._sha256.digest()
            )
        with open(self._tmp_idx, "wb") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)


def _meshtron_index_bytes(
    dtype: np.dtype, eod_id: int, offsets: np.ndarray, token_range, sha256: bytes
) -> bytes:
    offsets = np.asarray(offsets, dtype=np.int64)
    header = _HEADER.pack(MAGIC, VERSION, dtype.itemsize, eod_id, len(offsets) - 1, offsets[-1])
    body = header + _HEADER_V2.pack(*token_range, sha256) + offsets.tobytes()
    return body + hashlib.sha256(body).digest()


def check_token_ids(
    dataset: IndexedDataset | str | os.PathLike, vocab_size: int, *, eod_id: int | None = None
) -> None:
    """Refuse (ValueError, one line naming the file and the largest id) data whose ids do
    not all fit a model's vocabulary of ``vocab_size``, or whose index disagrees with its
    ``.bin``. ``dataset`` is an opened set or a ``PREFIX`` (``eod_id``: for a Megatron index).

    Run it before the first step: past the vocabulary, a TP shard's embedding lookup reads
    nothing at tp >= 2 and the run trains on silently (at tp = 1 it fails mid-step).
    """
    if not isinstance(dataset, IndexedDataset):
        dataset = IndexedDataset(dataset, eod_id=eod_id)
    dataset.verify(vocab_size)


def convert_index(prefix: str | os.PathLike, to: str, *, eod_id: int | None = None) -> str:
    """Rewrite ``PREFIX.idx`` in format ``to`` (atomically); the ``.bin`` is read, never written.

    Megatron -> meshtron needs ``eod_id`` and every document ending with it (Megatron's
    ``--append-eod``); its sentence boundaries inside a document are dropped. Returns the
    format converted from.
    """
    if to not in INDEX_FORMATS:
        raise ValueError(f"index format {to!r}: choose one of {INDEX_FORMATS}")
    dataset = IndexedDataset(prefix, eod_id=eod_id)
    if dataset.format == to:
        raise ValueError(f"{dataset.idx_path} is already a {to} index")
    digest, (lo, hi) = dataset._read_bin()
    dataset.check_bin_digest(digest)  # a Megatron index would drop the damage's only witness
    if dataset.num_tokens and (lo < 0 or hi >= 2**31):
        raise ValueError(
            f"{dataset.bin_path}: token ids {lo}..{hi} are not token ids of a vocabulary"
        )
    # The same bytes under the other format's name for that width: no rewrite of the .bin.
    same_bytes = {"uint16": "uint16", "uint32": "int32", "int32": "uint32"}
    if dataset.dtype.name not in same_bytes:
        raise ValueError(
            f"{dataset.idx_path}: token dtype {dataset.dtype.name} has no {to} equivalent of "
            "the same width (uint16 and 32-bit ids convert); re-run tools/preprocess_data.py"
        )
    dtype = np.dtype(same_bytes[dataset.dtype.name])
    if to == "megatron":
        index = megatron_index_bytes(dtype, *dataset.sequences())
    else:
        index = _meshtron_index_from(dataset, dtype, (lo, hi), bytes.fromhex(digest))
    with atomic_output(dataset.idx_path) as tmp:
        tmp.write_bytes(index)
    return dataset.format


def _meshtron_index_from(
    dataset: IndexedDataset, dtype: np.dtype, token_range, digest: bytes
) -> bytes:
    if dataset.eod_id is None:
        raise ValueError(
            f"{dataset.idx_path}: a meshtron index records the end-of-document id; give "
            "--eod-id N or --tokenizer PATH"
        )
    if len(dataset) and not (np.diff(dataset.doc_offsets) > 0).all():
        raise ValueError(f"{dataset.idx_path}: holds empty documents, which meshtron does not")
    ends = dataset.tokens[dataset.doc_offsets[1:] - 1]
    if (ends != dataset.eod_id).any():
        raise ValueError(
            f"{dataset.idx_path}: document {int(np.argmax(ends != dataset.eod_id))} does not end "
            f"with eod_id={dataset.eod_id} (made without Megatron's --append-eod, or another "
            "tokenizer); meshtron's format needs one after every document"
        )
    return _meshtron_index_bytes(dtype, dataset.eod_id, dataset.doc_offsets, token_range, digest)
