"""Files on disk: shard files with checksums, the index, atomic commit, ``latest``, pruning.

A checkpoint root holds committed step directories and a ``latest`` pointer::

    ROOT/latest                      "step_00000120", replaced atomically
    ROOT/step_00000120/index.json    tensors, layout, trainer state, file checksums
    ROOT/step_00000120/rank00000.safetensors ...

A step directory is assembled under ``ROOT/.tmp-step_…`` (every file fsynced), renamed
into place, and only then is ``latest`` moved to it. While ``latest`` exists, only
directories at or below the step it names are loaded (anything newer is the leftover of an
interrupted save); without it (a copy that lost it) the newest complete one is. Pruning
never deletes a complete checkpoint newer than the one just committed, nor another save's
temp directory. Nothing here unpickles: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from engine.checkpoint.layout import Box, TensorSpec, box_numel, intersect
from engine.checkpoint.tensorfile import (
    HASH,
    HASHES,
    TensorFileError,
    hash_file,
    read_names,
    read_tensors,
    write_tensors,
)

FORMAT = "meshtron-train-checkpoint"
VERSION = 1
INDEX = "index.json"
LATEST = "latest"
STEP_DIGITS = 8  # step_00000120: fixed width, so names sort by step
MAX_STEP = 10**STEP_DIGITS - 1  # the last step whose directory can be found again
_STEP_DIR = re.compile(rf"step_(\d{{{STEP_DIGITS}}})")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


def step_dir_name(step: int) -> str:
    """``step_00000120``: fixed width, so names sort by step."""
    return f"step_{step:0{STEP_DIGITS}d}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file (what checkpoints before BLAKE3 recorded)."""
    return hash_file(path, "sha256")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], boxes: dict[str, Box]) -> dict:
    """Write one rank's slices as safetensors, fsync it, and return its index record.

    The tensors' own memory is written (no copies but of non-contiguous crops) and hashed
    in the same pass (``engine.checkpoint.tensorfile``).
    """
    data = {k: v.detach().cpu() for k, v in tensors.items()}
    digest = write_tensors(path, data, metadata={"format": FORMAT})
    slices = {name: [list(pair) for pair in boxes[name]] for name in sorted(data)}
    return {"bytes": path.stat().st_size, HASH: digest, "slices": slices}


def _canonical(index: dict) -> bytes:
    body = {k: v for k, v in index.items() if k != "index_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_index(directory: Path, index: dict) -> None:
    """Write ``index.json`` carrying a checksum of its own content; fsync it."""
    index = {**index, "format": FORMAT, "version": VERSION}
    index["index_sha256"] = hashlib.sha256(_canonical(index)).hexdigest()
    path = directory / INDEX
    with open(path, "w") as f:
        f.write(json.dumps(index, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_index(directory: Path) -> dict:
    """Parse and verify ``index.json``; CheckpointError naming the file when it is damaged."""
    path = directory / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (not a complete checkpoint)") from None
    except (ValueError, UnicodeDecodeError, RecursionError, OSError) as err:
        # ValueError: bad JSON, or an integer too long to parse; RecursionError: nesting.
        why = "nested too deeply" if isinstance(err, RecursionError) else str(err)[:120]
        raise CheckpointError(f"{path} is damaged: not readable JSON ({why})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a meshtron training checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{path}: version {index.get('version')!r}, this reads {VERSION}")
    try:
        intact = index.get("index_sha256") == hashlib.sha256(_canonical(index)).hexdigest()
    except (ValueError, TypeError, RecursionError):  # e.g. NaN, nested too deeply to write
        intact = False
    if not intact:
        raise CheckpointError(f"{path} is damaged: its content does not match its checksum")
    return index


class ShardReader:
    """Reads regions of full-shape tensors out of a step directory's shard files.

    A file is read whole the first time one of its tensors is needed, each tensor into a
    tensor of its own, and hashed while it is read; it is checked against the index (size
    before reading, hash after) before any of its tensors is handed out, so a truncated or
    flipped file fails with its name before any byte is used.
    """

    def __init__(self, directory: str | os.PathLike, index: dict | None = None) -> None:
        self.directory = Path(directory)
        self.index = index if index is not None else read_index(self.directory)
        self.specs = {n: TensorSpec.from_json(n, e) for n, e in self.index["tensors"].items()}
        self._pieces: dict[str, list[tuple[str, Box]]] = {}
        for fname, record in self.index["files"].items():
            # Only plain safetensors names inside the directory: never a path elsewhere,
            # never a pickle-based format.
            if "/" in fname or "\\" in fname or not fname.endswith(".safetensors"):
                raise CheckpointError(f"{self.directory / INDEX} lists a bad file name {fname!r}")
            for name, box in record["slices"].items():
                self._pieces.setdefault(name, []).append((fname, [tuple(p) for p in box]))
        self._files: dict[str, dict[str, torch.Tensor]] = {}
        self._into: dict[str, dict[str, torch.Tensor]] = {}

    def read_into(self, name: str, box: Box, destination: torch.Tensor) -> None:
        """Have the stored slice of ``name`` whose box is ``box`` read straight into
        ``destination`` (its shape), when its file is read (before that file is opened).
        Only host memory can be read into; a destination elsewhere (a GPU) gets the slice
        read into a new host tensor, which the caller copies over."""
        if destination.device.type != "cpu":
            return
        for fname, piece in self._pieces.get(name, []):
            if piece == [tuple(pair) for pair in box]:
                self._into.setdefault(fname, {})[name] = destination

    def _checked(self, fname: str) -> tuple[Path, dict, str]:
        """(path, index record, hash name) after the checks that need no data read."""
        path, record = self.directory / fname, self.index["files"][fname]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(
                f"{path} is damaged: {size} bytes, the index says {record['bytes']} (truncated?)"
            )
        algo = next((name for name in HASHES if name in record), None)
        if algo is None:
            raise CheckpointError(f"{self.directory / INDEX} records no hash of {fname}")
        return path, record, algo

    def check_sizes(self) -> None:
        """CheckpointError naming the first file the index lists that is missing or not
        its recorded size (nothing is read: the hashes are checked when files are)."""
        for fname in self.index["files"]:
            self._checked(fname)

    def _check_names(self, path: Path, record: dict, names) -> None:
        missing = set(record["slices"]) - set(names)
        if missing:
            raise CheckpointError(f"{path} lacks tensors the index lists: {sorted(missing)[:3]}")

    def verify_file(self, fname: str) -> None:
        """Check one file against the index: size, hash, a safetensors header listing the
        tensors the index says it holds (the data is hashed, not kept)."""
        if fname in self._files:
            return
        path, record, algo = self._checked(fname)
        if hash_file(path, algo) != record[algo]:
            raise CheckpointError(_damaged(path, algo))
        try:
            names = read_names(path)
        except (TensorFileError, OSError) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from None
        self._check_names(path, record, names)

    def _open(self, fname: str) -> dict[str, torch.Tensor]:
        if fname in self._files:
            return self._files[fname]
        path, record, algo = self._checked(fname)
        try:
            tensors, digest = read_tensors(path, algo, self._into.pop(fname, None))
        except (TensorFileError, OSError) as err:
            # A damaged file usually fails its hash too: name that, the cause, first.
            if hash_file(path, algo) != record[algo]:
                raise CheckpointError(_damaged(path, algo)) from None
            raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from None
        if digest != record[algo]:
            raise CheckpointError(_damaged(path, algo))
        self._check_names(path, record, tensors)
        self._files[fname] = tensors
        return tensors

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The region ``box`` (default: all) of tensor ``name``, assembled from its slices.

        A region that is exactly one stored slice is the tensor read from the file itself
        (no copy; the same tensor on every call for it).
        """
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.directory} has no tensor {name}")
        box = [tuple(pair) for pair in (box or [(0, n) for n in spec.shape])]
        out, covered = None, 0
        for fname, piece in self._pieces.get(name, []):
            part = intersect(box, piece)
            if part is None:
                continue
            stored = self._open(fname).get(name)
            if stored is None or list(stored.shape) != [hi - lo for lo, hi in piece]:
                raise CheckpointError(f"{self.directory / fname}: {name} is not the indexed slice")
            if part == box == piece:
                return stored
            src = tuple(
                slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(part, piece, strict=True)
            )
            dst = tuple(
                slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(part, box, strict=True)
            )
            if out is None:  # every element is written below (the coverage check says so)
                out = torch.empty([hi - lo for lo, hi in box], dtype=spec.torch_dtype)
            out[dst] = stored[src]
            covered += box_numel(part)
        if out is None or covered != box_numel(box):
            raise CheckpointError(f"{self.directory}: the files do not cover {name} {box}")
        return out


def _damaged(path: Path, algo: str) -> str:
    name = {"blake3": "BLAKE3", "sha256": "SHA-256"}[algo]
    return f"{path} is damaged: its {name} hash does not match the index"


def commit(
    tmp: Path,
    root: Path,
    step: int,
    keep: int,
    *,
    before_latest: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Rename the finished ``tmp`` to its step directory, point ``latest`` at it, prune.

    ``before_latest`` is a test hook run between the rename and the ``latest`` update;
    ``log`` hears what is replaced or pruned, and why.
    """
    final = root / step_dir_name(step)
    fsync_dir(tmp)
    if final.exists():  # a leftover of an interrupted save of this step (renamed, not named)
        if log is not None:
            problem = verify_complete(final)
            why = f"incomplete: {problem}" if problem else "complete, but 'latest' never named it"
            log(f"replacing {final} ({why})")
        remove_dir(final)
    os.rename(tmp, final)
    fsync_dir(root)
    if before_latest is not None:
        before_latest()
    write_latest(root, final.name)
    prune(root, step, keep, log=log)
    return final


def write_latest(root: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (temp file, fsync, os.replace, fsync dir)."""
    tmp = root / f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def remove_dir(path: Path) -> None:
    """Delete a directory so that it never looks complete while half deleted."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def step_dirs(root: Path) -> dict[int, Path]:
    """{step: directory} of every step directory in ``root`` holding an index."""
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and (entry / INDEX).exists():
            found[int(match.group(1))] = entry
    return found


def read_latest(root: Path) -> int | None:
    """The step ``latest`` names; None when there is no ``latest``.

    Raises CheckpointError when ``latest`` exists but is unreadable.
    """
    path = root / LATEST
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    match = _STEP_DIR.fullmatch(text)
    if match is None:
        raise CheckpointError(f"{path} is damaged: {text[:40]!r} is not a step directory name")
    return int(match.group(1))


def verify_complete(directory: Path) -> str | None:
    """None when ``directory`` is a complete checkpoint (its index and every file it lists
    verify: size and SHA-256), else what is wrong, in a few words naming the file."""
    try:
        reader = ShardReader(directory)
        for fname in reader.index["files"]:
            reader.verify_file(fname)
    except (CheckpointError, KeyError, TypeError, ValueError) as err:
        return str(err) if isinstance(err, CheckpointError) else f"bad index ({err!r})"
    return None


def prune(
    root: Path, committed: int, keep: int, *, log: Callable[[str], None] | None = None
) -> None:
    """Keep the ``keep`` newest step directories up to ``committed``; drop older ones.

    A directory newer than ``committed`` is removed only when it does not verify (the
    leftover of an interrupted save, or damage a resume fell back from): a complete newer
    checkpoint is never deleted here. ``log`` hears each removal and its reason.
    """
    say = log or (lambda msg: None)
    dirs = step_dirs(root)
    kept = sorted((s for s in dirs if s <= committed), reverse=True)[:keep]
    for step, path in sorted(dirs.items()):
        if step in kept:
            continue
        if step < committed:
            say(f"pruned {path}: older than the {keep} newest kept (checkpoint.keep={keep})")
        else:
            problem = verify_complete(path)
            if problem is None:
                continue
            say(f"removed {path}: newer than step {committed} and not usable ({problem})")
        remove_dir(path)


def remove_stale_temps(root: Path) -> None:
    """Delete the temp and trash directories interrupted saves and deletions left behind."""
    for entry in root.iterdir() if root.is_dir() else []:
        if entry.is_dir() and entry.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(entry, ignore_errors=True)
