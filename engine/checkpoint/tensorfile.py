"""safetensors files written and read in one pass, hashed on the way (no second read).

The files are plain safetensors (an 8-byte little-endian header length, a JSON header of
dtype, shape and byte offsets per tensor, then the raw bytes), readable by
``safetensors.safe_open``. Writing streams each tensor's own memory to the file (no
serialized copy) while a second thread hashes the same bytes; reading fills one new
tensor per stored tensor straight from the file (no zeroed buffer, no copy) while the
second thread hashes what was just read. The digest is BLAKE3 (the ``blake3`` package,
the BLAKE3 team's Rust implementation: cryptographic like SHA-256, several times faster
per core); files recorded with SHA-256 (checkpoints from before) are verified with it.
Nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

HASH = "blake3"  # the index key of the digest new files record
HASHES = ("blake3", "sha256")  # what a reader verifies (the first the record holds)
_CHUNK = 8 << 20  # bytes per read or write: large enough for throughput, small for overlap
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class TensorFileError(ValueError):
    """A file is not a safetensors file this module can read (the message says why)."""


def new_hash(name: str = HASH):
    """A hash object of algorithm ``name`` ("blake3" or "sha256")."""
    if name == "blake3":
        from blake3 import blake3

        return blake3()
    return hashlib.new(name)


class _Hasher:
    """Feeds chunks to a hash in one background thread, in order, one chunk ahead."""

    def __init__(self, name: str) -> None:
        self.hash, self._pool = new_hash(name), ThreadPoolExecutor(1)
        self._pending: Future | None = None

    def update(self, chunk) -> None:
        self.wait()
        self._pending = self._pool.submit(self.hash.update, chunk)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def hexdigest(self) -> str:
        self.wait()
        self._pool.shutdown()
        return self.hash.hexdigest()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes (little-endian hosts, as safetensors assumes)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), _CHUNK):
        yield view[start : start + _CHUNK]


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list]:
    """(length-prefixed header, names in file order). Larger elements first, then by name,
    as safetensors lays files out, so every tensor starts aligned to its element size."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name here")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, order


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write ``tensors`` (CPU; non-contiguous ones are made contiguous) as a safetensors
    file, fsync it, and return its BLAKE3 hex digest, computed while writing."""
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    head, order = _header(tensors, metadata)
    hasher = _Hasher(HASH)
    with open(path, "wb", buffering=0) as f:
        hasher.update(head)
        f.write(head)
        for name in order:
            for chunk in _chunks(_bytes_of(tensors[name])):
                hasher.update(chunk)  # hashed in the other thread while this one writes
                f.write(chunk)
        digest = hasher.hexdigest()
        os.fsync(f.fileno())
    umask = os.umask(0)  # the permissions ordinary files get (see format.save_tensors)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return digest


def hash_file(path: Path, name: str) -> str:
    """Hex digest of a file with algorithm ``name``, read in chunks."""
    hasher, buffer = new_hash(name), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            hasher.update(view[:n])
    return hasher.hexdigest()


def _read_into(f, view: memoryview) -> None:
    while len(view):
        n = f.readinto(view)
        if not n:
            raise TensorFileError("the file ends inside its tensor data (truncated?)")
        view = view[n:]


def _parse_header(text: bytes, data_bytes: int) -> list[tuple[str, torch.dtype, list[int]]]:
    """[(name, dtype, shape)] in file order, after checking that the entries tile the
    ``data_bytes`` of tensor data exactly (no gaps, no overlaps, no bytes left over)."""
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TensorFileError(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise TensorFileError("its header is not a JSON object")
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _BY_NAME[entry["dtype"]], [int(n) for n in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise TensorFileError(f"its header entry of {name!r} is malformed") from None
        numel = torch.Size(shape).numel() if all(n >= 0 for n in shape) else -1
        if numel < 0 or end - begin != numel * dtype.itemsize:
            raise TensorFileError(f"{name!r}: offsets {begin}..{end} do not fit {shape}")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    offset = 0
    for begin, end, name, _, _ in entries:
        if begin != offset:
            raise TensorFileError(f"{name!r} starts at byte {begin}, expected {offset}")
        offset = end
    if offset != data_bytes:
        raise TensorFileError(f"its header covers {offset} data bytes, the file has {data_bytes}")
    return [(name, dtype, shape) for _, _, name, dtype, shape in entries]


def read_tensors(
    path: Path, hash_name: str, into: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """({name: tensor}, hex digest): each stored tensor read straight into its destination,
    the file hashed with ``hash_name`` while it is read. The destination is ``into[name]``
    where that is a contiguous host tensor of the stored dtype and shape, else a new one. The
    caller compares the digest before trusting any tensor. TensorFileError when the file is
    not safetensors."""
    hasher, tensors, into = _Hasher(hash_name), {}, into or {}
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = bytearray(8)
            _read_into(f, memoryview(prefix))
            length = int.from_bytes(prefix, "little")
            if length > size - 8:
                raise TensorFileError(f"its header length {length} exceeds the file ({size} B)")
            text = bytearray(length)
            _read_into(f, memoryview(text))
            hasher.update(bytes(prefix + text))
            for name, dtype, shape in _parse_header(bytes(text), size - 8 - length):
                tensor = into.get(name)
                fits = tensor is not None and tensor.is_contiguous() and tensor.dtype == dtype
                fits = fits and tensor.device.type == "cpu"  # a file reads into host memory
                if not (fits and list(tensor.shape) == shape):
                    tensor = torch.empty(shape, dtype=dtype)
                for chunk in _chunks(_bytes_of(tensor)):
                    _read_into(f, chunk)
                    hasher.update(chunk)  # hashed in the other thread while this one reads
                tensors[name] = tensor
    finally:
        digest = hasher.hexdigest()
    return tensors, digest


def read_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (the header alone is read)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 <= length <= size - 8:
            raise TensorFileError(f"its header length {length} does not fit the file ({size} B)")
        entries = _parse_header(f.read(length), size - 8 - length)
    return [name for name, _, _ in entries]
