"""IDX files (the MNIST / Fashion-MNIST format), plain or gzipped, read into tensors.

An IDX file is a 4-byte magic number ``0x00 0x00 <type> <ndim>`` followed by ``ndim``
big-endian uint32 sizes and then the values, big-endian, in row-major order. The type
byte names the element type (0x08 uint8 is what the image and label files use).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch

# IDX type byte -> big-endian numpy dtype.
_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IDXError(ValueError):
    """The bytes are not a well-formed IDX file; the message names the file and the fault."""


def read_idx(path: str | os.PathLike) -> torch.Tensor:
    """The array stored in the IDX file ``path`` (gzip-compressed when it ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:  # gzip raises these on a truncated or non-gzip file
        raise IDXError(f"{path}: cannot read ({err})") from None
    return parse_idx(raw, name=str(path))


def parse_idx(raw: bytes, *, name: str = "<bytes>") -> torch.Tensor:
    """Decode IDX bytes; raises IDXError naming ``name`` when they are malformed."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IDXError(f"{name}: not an IDX file (bad magic number)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _DTYPES:
        raise IDXError(f"{name}: unknown IDX element type 0x{type_code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IDXError(f"{name}: header truncated ({len(raw)} bytes for {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise IDXError(
            f"{name}: {len(raw) - header} data bytes, but shape {list(shape)} of {dtype.name} "
            f"needs {expected}"
        )
    values = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(values.astype(dtype.newbyteorder("="), copy=True))


def write_idx(path: str | os.PathLike, array: torch.Tensor | np.ndarray) -> None:
    """Write ``array`` as IDX (gzipped when ``path`` ends in ``.gz``); the inverse of read_idx."""
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in _DTYPES.items()}
    native = array.dtype.newbyteorder("=")
    if native not in codes:
        raise IDXError(f"{path}: dtype {array.dtype} has no IDX type code")
    code = codes[native]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(_DTYPES[code], copy=False).tobytes()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(data)
