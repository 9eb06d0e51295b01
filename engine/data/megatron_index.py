"""The ``.idx`` format of Megatron-LM / Megatron-Core (``MMIDIDX``), read and written.

Layout (little endian), as megatron-core's ``IndexedDatasetBuilder`` writes it::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                               7 float32, 8 uint16
    sequence_count   uint64    S
    document_count   uint64    D + 1
    sequence_lengths int32[S]  tokens per sequence
    sequence_ptrs    int64[S]  byte offset of each sequence in the .bin
    document_indices int64[D + 1]  first sequence of each document, then S
    sequence_modes   int8[S]   only in multimodal indexes

The ``.bin`` is the same flat array of token ids as ours: only the index differs. A document
is one or more sequences (Megatron's ``--split-sentences`` makes one per sentence); there is
no end-of-document id in the index, and the data holds one only when ``--append-eod`` was used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
# Megatron's dtype codes; the float ones cannot hold token ids and are refused on read.
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_FLOAT_CODES = (6, 7)


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocessing picks for a vocabulary (``DType.optimal_dtype``)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype: np.dtype) -> int:
    """Megatron's code for ``dtype``; ValueError when Megatron has none (e.g. uint32)."""
    for code, candidate in DTYPE_CODES.items():
        if candidate == dtype:
            return code
    raise ValueError(f"Megatron indexes have no code for token dtype {dtype}")


def is_megatron_index(header: bytes) -> bool:
    """Whether the first bytes of an ``.idx`` are Megatron's magic."""
    return header[: len(MAGIC)] == MAGIC


@dataclass(frozen=True)
class MegatronIndex:
    """A parsed Megatron ``.idx``: token dtype, per-sequence lengths and per-document starts."""

    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32[S]
    document_indices: np.ndarray  # int64[D + 1], sequence index where each document starts

    @property
    def doc_offsets(self) -> np.ndarray:
        """Token offset of each document's start, then the total (int64[D + 1])."""
        seq_starts = np.zeros(len(self.sequence_lengths) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=seq_starts[1:])
        return seq_starts[self.document_indices]


def read_megatron_index(idx_path: Path) -> MegatronIndex:
    """Parse and check a Megatron ``.idx``; ValueError naming the file and the fault."""
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    if len(raw) < _HEADER.size:
        raise ValueError(f"{idx_path}: truncated Megatron index header")
    _, version, code, num_seqs, num_doc_idx = _HEADER.unpack_from(bytes(raw[: _HEADER.size]))
    if version != VERSION:
        raise ValueError(f"{idx_path}: Megatron index version {version}, this reads {VERSION}")
    if code not in DTYPE_CODES or code in _FLOAT_CODES:
        kind = DTYPE_CODES[code].name if code in DTYPE_CODES else f"unknown code {code}"
        raise ValueError(f"{idx_path}: Megatron token dtype {kind} cannot hold token ids")
    body = 4 * num_seqs + 8 * num_seqs + 8 * num_doc_idx
    if len(raw) not in (_HEADER.size + body, _HEADER.size + body + num_seqs):
        raise ValueError(
            f"{idx_path}: {len(raw)} bytes, expected {_HEADER.size + body} for {num_seqs} "
            f"sequences and {num_doc_idx} document indices (truncated index?)"
        )
    if len(raw) != _HEADER.size + body:
        raise ValueError(
            f"{idx_path}: a multimodal Megatron index (sequence modes); meshtron trains text only"
        )
    at = _HEADER.size
    lengths = np.frombuffer(raw, np.int32, num_seqs, at)
    pointers = np.frombuffer(raw, np.int64, num_seqs, at + 4 * num_seqs)
    doc_idx = np.frombuffer(raw, np.int64, num_doc_idx, at + 12 * num_seqs)
    index = MegatronIndex(DTYPE_CODES[code], lengths, doc_idx)
    _check(idx_path, index, pointers)
    return index


def _check(idx_path: Path, index: MegatronIndex, pointers: np.ndarray) -> None:
    lengths, doc_idx = index.sequence_lengths, index.document_indices
    if (lengths < 0).any():
        raise ValueError(f"{idx_path}: negative sequence length at {int(np.argmax(lengths < 0))}")
    # We read the .bin as one stream, so sequences must lie back to back, as Megatron writes.
    expected = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=expected[1:])
    bad = pointers != expected * index.dtype.itemsize
    if bad.any():
        seq = int(np.argmax(bad))
        raise ValueError(
            f"{idx_path}: sequence {seq} starts at byte {pointers[seq]}, not right after the "
            f"one before ({expected[seq] * index.dtype.itemsize}); the index is damaged"
        )
    if len(doc_idx) < 1 or doc_idx[0] != 0 or doc_idx[-1] != len(lengths):
        raise ValueError(
            f"{idx_path}: document indices do not span the {len(lengths)} sequences; "
            "the index is damaged"
        )
    falls = np.diff(doc_idx) < 0
    if falls.any():
        raise ValueError(
            f"{idx_path}: document indices decrease at document {int(np.argmax(falls))}; "
            "the index is damaged"
        )


def megatron_index_bytes(
    dtype: np.dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray
) -> bytes:
    """The bytes of a Megatron ``.idx`` (no sequence modes), as megatron-core writes them."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    doc_idx = np.asarray(document_indices, dtype=np.int64)
    header = _HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(lengths), len(doc_idx))
    return header + lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes()
