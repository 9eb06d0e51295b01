"""The built-in corpus: the running interpreter's standard-library Python sources, tokenized.

Needs no download and is the same on every machine with the same Python, so examples and tests
can train on real text out of the box. Built once per (Python, file list, vocab, cap) and cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from engine.data.fsutil import file_lock
from engine.data.preprocess import encode_to_indexed, save_tokenizer, train_tokenizer

DEFAULT_MAX_BYTES = 5_000_000
# Tests and vendored/third-party trees: repetitive or not the stdlib's own code.
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "turtledemo", "site-packages", "dist-packages"}
    | {"__pycache__", "ensurepip", "__phello__"}
)
# Bump when the cached layout or the build recipe changes, so old caches are not trusted.
_CACHE_FORMAT = 2  # 2: files drawn in hash order, not path order


def default_cache_dir() -> Path:
    """``$MESHTRON_CACHE``, else ``~/.cache/meshtron``."""
    return Path(os.environ.get("MESHTRON_CACHE") or Path.home() / ".cache" / "meshtron")


def stdlib_sources(max_bytes: int) -> tuple[Path, list[tuple[str, int]]]:
    """The stdlib root and ``(relative path, size)`` of the files in the corpus, in order.

    Files are taken in a fixed shuffled order (:func:`_draw_order`) while they fit in
    ``max_bytes``; one that would overflow the cap is skipped, so the cap fills closely yet
    the choice stays deterministic. The documents are stored in that order too: the runs'
    train/valid/test split (``data.split``) cuts contiguous document ranges, as Megatron's
    does, so in path order the validation documents would be the stdlib's last files (the
    codec tables of ``encodings/``), not a sample of it.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
    chosen, total = [], 0
    for rel, size in sorted(found, key=lambda item: _draw_order(item[0])):
        if total + size <= max_bytes:
            chosen.append((rel, size))
            total += size
    return root, chosen


def _draw_order(rel: str) -> bytes:
    """A file's place in the corpus: a hash of its relative path, the same on every
    machine, unrelated to where the path sorts."""
    return hashlib.blake2b(rel.encode(), digest_size=8).digest()


def _cache_key(files: list[tuple[str, int]], vocab_size: int, max_bytes: int) -> str:
    recipe = {
        "format": _CACHE_FORMAT,
        "python": sys.version,
        "files": files,
        "vocab_size": vocab_size,
        "max_bytes": max_bytes,
    }
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]


def _outputs(directory: Path) -> tuple[Path, Path]:
    return directory / "corpus", directory / "tokenizer.json"


def _is_complete(directory: Path) -> bool:
    prefix, tokenizer = _outputs(directory)
    return all(
        p.is_file() for p in (prefix.with_suffix(".bin"), prefix.with_suffix(".idx"), tokenizer)
    )


def _build(
    root: Path, files: list[tuple[str, int]], out: Path, vocab_size: int, progress: bool
) -> None:
    """Train the BPE and write the corpus into the empty directory ``out``."""
    docs = []
    for rel, _ in files:
        data = (root / rel).read_bytes()
        try:
            docs.append((data.decode("utf-8"), len(data)))
        except UnicodeDecodeError:
            continue  # a few stdlib files declare legacy encodings; deterministic to skip
    if not docs:
        raise ValueError(f"no UTF-8 .py files under {root} within the byte cap")
    prefix, tokenizer_path = _outputs(out)
    tokenizer = train_tokenizer((text for text, _ in docs), vocab_size)
    save_tokenizer(tokenizer, tokenizer_path)
    num_docs, num_tokens = encode_to_indexed(
        docs, tokenizer, prefix, total_bytes=sum(n for _, n in docs), progress=progress
    )
    meta = {"python": sys.version, "num_docs": num_docs, "num_tokens": num_tokens, "files": files}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def build_default_corpus(
    cache_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int = 8192,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> tuple[str, str]:
    """Build (or reuse) the stdlib corpus; return ``(data prefix, tokenizer.json path)``.

    The result lives in ``cache_dir/stdlib-<key>/``, which only ever appears by renaming a
    fully built temp directory, so a killed build leaves nothing that is later trusted.
    Concurrent callers serialize on a per-key file lock and all but the first reuse its work.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    root, files = stdlib_sources(max_bytes)
    if not any(size for _, size in files):
        raise ValueError(
            f"the .py files of {root} within a cap of {max_bytes:,} bytes are all empty"
        )
    key = _cache_key(files, vocab_size, max_bytes)
    final = cache_dir / f"stdlib-{key}"
    prefix, tokenizer_path = (str(p) for p in _outputs(final))
    if _is_complete(final):
        return prefix, tokenizer_path
    with file_lock(cache_dir / f".stdlib-{key}.lock"):
        if _is_complete(final):
            return prefix, tokenizer_path
        # Holding the lock, any temp dir of this key is a dead builder's leftover.
        for stale in cache_dir.glob(f".stdlib-{key}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # damaged by hand: rebuild
        tmp = Path(tempfile.mkdtemp(prefix=f".stdlib-{key}.", suffix=".tmp", dir=cache_dir))
        try:
            _build(root, files, tmp, vocab_size, progress)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return prefix, tokenizer_path
