"""Corpora that are cut, odd or not files at all: preprocessing reads each whole, or refuses it
in ONE line naming the file (and the line, where there is one), with exit status 2.

Issue 39: cut ``.zst`` files read as shorter whole ones; valid Parquet string columns
(dictionary-encoded, ``string_view``) were refused; JSON that Python's parser cannot take
ended in a traceback or a line without the file; a FIFO was blamed on something else.
Everything runs through the CLI's ``main(argv)`` in this process; every input is built here.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from engine.data.preprocess import preprocess

ROOT = Path(__file__).resolve().parents[1]
# gzip's own words for a cut file; a cut .zst file is reported the same way.
CUT = "cannot decompress (Compressed file ended before the end-of-stream marker was reached)"


def _cli():
    spec = importlib.util.spec_from_file_location(
        "bad_corpora_cli", ROOT / "tools" / "preprocess_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLI = _cli()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """A 300-id tokenizer trained on a small made-up corpus."""
    d = tmp_path_factory.mktemp("tokenizer")
    words = [f"w{i} f{i % 7}(x) = {i * 3};\n" for i in range(400)]
    (d / "c.txt").write_text("".join(words))
    return preprocess(
        [str(d / "c.txt")], str(d / "c"), vocab_size=300, progress=False
    ).tokenizer_path


def _run(tokenizer: str, path: Path, capsys, *, key: str | None = "text") -> tuple[int, str, str]:
    """(exit status, stderr, stdout) of preprocessing ``path`` alone into a prefix beside it."""
    argv = ["--input", str(path), "--tokenizer", tokenizer, "--no-progress", "--workers", "1"]
    argv += ["--output-prefix", str(path.parent / f"out_{path.name}")]
    code = CLI.main(argv + (["--text-key", key] if key else []))
    captured = capsys.readouterr()
    return code, captured.err, captured.out


def _refused(tokenizer: str, path: Path, capsys, *, key: str | None = "text") -> str:
    """The one error line refusing ``path`` (after the program's name); nothing written."""
    code, err, _ = _run(tokenizer, path, capsys, key=key)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert lines[0].startswith("preprocess_data.py: error: "), lines
    assert not [p for p in path.parent.glob(f"*out_{path.name}*")], "a refused input wrote"
    return lines[0].removeprefix("preprocess_data.py: error: ")


def _accepted(tokenizer: str, path: Path, capsys, *, key: str | None = "text") -> int:
    """The number of documents preprocessing ``path`` wrote."""
    code, err, out = _run(tokenizer, path, capsys, key=key)
    assert code == 0, err
    return int(out.split(": ", 1)[1].split(" document")[0])


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def _texts(n: int) -> list[str]:
    """``n`` documents of made-up words: they compress to many zstd blocks, not to a few."""
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(10**6)}" for _ in range(30)) for _ in range(n)]


# ---------------------------------------------------------------- item 1: cut .zst files


@pytest.mark.slow
def test_cut_zst_files_are_errors_as_cut_gzip_files_are(tokenizer, tmp_path, capsys):
    """A .txt.zst cut at 2/3 of its bytes, and a two-frame .jsonl.zst whose second frame is
    cut, used to read as shorter whole files (exit 0). zstandard's stream_reader says
    nothing at a frame's cut end."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3)
    text = "\n".join(_texts(4000)).encode()  # ~600 KB: several 128 KiB blocks
    whole = compressor.compress(text)
    (tmp_path / "whole.txt.zst").write_bytes(whole)
    (tmp_path / "cut.txt.zst").write_bytes(whole[: len(whole) * 2 // 3])
    data = _jsonl(_texts(3000))
    half = data.index(b"\n", len(data) // 2) + 1
    frames = compressor.compress(data[:half]) + compressor.compress(data[half:])
    (tmp_path / "two.jsonl.zst").write_bytes(frames)
    (tmp_path / "two_cut.jsonl.zst").write_bytes(frames[:-100])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(data)[:-100])

    assert _accepted(tokenizer, tmp_path / "whole.txt.zst", capsys, key=None) == 1
    assert _accepted(tokenizer, tmp_path / "two.jsonl.zst", capsys) == 3000
    cut_text = _refused(tokenizer, tmp_path / "cut.txt.zst", capsys, key=None)
    assert cut_text == f"{tmp_path / 'cut.txt.zst'}: {CUT}"
    cut_lines = _refused(tokenizer, tmp_path / "two_cut.jsonl.zst", capsys)
    assert cut_lines.startswith(f"{tmp_path / 'two_cut.jsonl.zst'}:") and cut_lines.endswith(
        f": {CUT}"
    ), cut_lines
    # The same words as a cut gzip file, line number and all.
    cut_gzip = _refused(tokenizer, tmp_path / "cut.jsonl.gz", capsys)
    assert cut_gzip.endswith(f": {CUT}") and cut_gzip.count(":") == cut_lines.count(":")


def test_zst_frames_of_every_size_and_skippable_frames_read_whole(tmp_path):
    """The frame-by-frame reader against zstandard's one-shot decompression of each frame:
    a frame per line, an empty frame, a skippable frame, and frames past one read."""
    import zstandard

    from engine.data.sources import iter_source

    compressor = zstandard.ZstdCompressor(level=1)
    texts = _texts(2000)
    lines = _jsonl(texts).splitlines(keepends=True)
    skippable = struct.pack("<II", 0x184D2A50, 5) + b"notes"
    parts = [compressor.compress(line) for line in lines[:1000]]
    parts += [compressor.compress(b""), skippable, compressor.compress(b"".join(lines[1000:]))]
    (tmp_path / "frames.jsonl.zst").write_bytes(b"".join(parts))
    docs = list(iter_source(tmp_path / "frames.jsonl.zst", "text"))
    assert [t for t, _ in docs] == texts
    assert sum(n for _, n in docs) == (tmp_path / "frames.jsonl.zst").stat().st_size
    (tmp_path / "garbage_after.jsonl.zst").write_bytes(b"".join(parts) + b"\0" * 8)
    with pytest.raises(ValueError, match=r"garbage_after\.jsonl\.zst:2001: cannot decompress \("):
        list(iter_source(tmp_path / "garbage_after.jsonl.zst", "text"))


# ---------------------------------------------------------------- item 2: Parquet strings


def test_every_arrow_string_column_is_text(tokenizer, tmp_path, capsys):
    """Dictionary-encoded, string_view and large_string columns hold strings as plain
    string columns do, and give the same tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["alpha beta", "gamma", "alpha beta", "", "delta ε 日本"]
    columns = {
        "plain": pa.array(texts),
        "dictionary": pa.array(texts).dictionary_encode(),
        "string_view": pa.array(texts, type=pa.string_view()),
        "large_string": pa.array(texts, type=pa.large_string()),
        "large_dictionary": pa.array(texts, type=pa.large_string()).dictionary_encode(),
    }
    for name, column in columns.items():
        pq.write_table(
            pa.table({"text": column, "n": list(range(5))}), tmp_path / f"{name}.parquet"
        )
        assert _accepted(tokenizer, tmp_path / f"{name}.parquet", capsys) == 5, name
    plain = (tmp_path / "out_plain.parquet.bin").read_bytes()
    for name in columns:
        assert (tmp_path / f"out_{name}.parquet.bin").read_bytes() == plain, name


@pytest.mark.parametrize(
    ("column", "kind"),
    [
        ([b"bytes"], "binary"),
        ([["a", "b"]], "list<element: string>"),
        ([1.5], "double"),
        ([True], "bool"),
        ([{"t": "a"}], "struct<t: string>"),
    ],
)
def test_a_column_of_another_type_is_one_line_with_its_type(
    tokenizer, tmp_path, capsys, column, kind
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": column}), tmp_path / "t.parquet")
    line = _refused(tokenizer, tmp_path / "t.parquet", capsys)
    assert line == f"{tmp_path / 't.parquet'}: column 'text' holds {kind}, expected strings"


# ---------------------------------------------------------------- item 3: JSON lines

GOOD = b'{"text": "fine"}\n'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            b'{"text": "a\\ud800b"}',
            "value of 'text' holds the lone surrogate \\ud800 (character 1), which is not text",
        ),
        (
            b'{"text": "\\udfff"}',
            "value of 'text' holds the lone surrogate \\udfff (character 0), which is not text",
        ),
        (b'{"text": "a\xed\xa0\x80"}', "not UTF-8 (invalid continuation byte at byte 11)"),
        (b"[" * 200_000 + b"]" * 200_000, "JSON nested too deeply for Python's parser"),
        (
            b'{"text": "x", "m": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
            "JSON nested too deeply for Python's parser",
        ),
        (b'{"text": ' + b"9" * 5000 + b"}", "value of 'text' is float, expected a string"),
        (b"[1, 2]", "JSON line has no key 'text'"),
        (b'"text"', "JSON line has no key 'text'"),
        (b'{"body": "x"}', "JSON line has no key 'text'"),
        (b'{"text": ["x"]}', "value of 'text' is list, expected a string"),
        (b'{"text": "x"} {"text": "y"}', "invalid JSON (Extra data)"),
        (b"\xff\xfe{}", "not UTF-8 (invalid start byte at byte 0)"),
    ],
    ids=[
        "escaped_surrogate",
        "escaped_low_surrogate",
        "encoded_surrogate",
        "nested_200000",
        "nested_200000_beside_the_text",
        "int_5000_digits_as_the_text",
        "array",
        "string",
        "no_key",
        "list_value",
        "two_objects",
        "utf16_bom",
    ],
)
def test_a_bad_json_line_is_one_line_naming_file_and_line(
    tokenizer, tmp_path, capsys, line, message
):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD + line + b"\n" + GOOD)
    assert _refused(tokenizer, path, capsys) == f"{path}:2: {message}"


def test_valid_json_lines_python_finds_awkward_are_read(tokenizer, tmp_path, capsys):
    """A 5000-digit integer beside the text is valid JSON (Python refuses to convert it
    from text), as are a byte-order mark and a surrogate pair written as two escapes."""
    path = tmp_path / "ok.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + GOOD
        + b'{"text": "big", "n": '
        + b"9" * 5000
        + b', "m": -'
        + b"1" * 5000
        + b"}\n"
        + b'{"text": "pair \\ud83d\\ude42"}\n'
    )
    from engine.data.sources import iter_source

    assert [t for t, _ in iter_source(path, "text")] == ["fine", "big", "pair \U0001f642"]
    assert _accepted(tokenizer, path, capsys) == 3


# ---------------------------------------------------------------- item 4: not files


@contextmanager
def _fifo(path: Path, *, patience_s: float = 30.0) -> Iterator[None]:
    """A FIFO at ``path``; a reader still waiting on it after ``patience_s`` gets an end of
    file (a writer opens and closes it), so a regression fails the test instead of hanging."""
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:
        while not done.wait(patience_s):
            with suppress(OSError):  # opens only while a reader waits
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def test_a_fifo_or_directory_as_input_or_tokenizer_is_refused_as_such(tokenizer, tmp_path, capsys):
    """Each used to be 'input not found' or 'tokenizer not found' (wrong cause); opened, a
    FIFO waits for a writer for ever. A directory named as an input is a Parquet folder."""
    with _fifo(tmp_path / "pipe.jsonl"), _fifo(tmp_path / "tok.json"):
        _refuse_fifos_and_directories(tokenizer, tmp_path, capsys)


def _refuse_fifos_and_directories(tokenizer: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "docs.txt").mkdir()
    (tmp_path / "docs.txt" / "a.txt").write_text("not Parquet")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    fifo = f"{tmp_path / 'pipe.jsonl'} is not a regular file (a FIFO); give a data file"
    assert _refused(tokenizer, tmp_path / "pipe.jsonl", capsys) == fifo
    assert _refused(tokenizer, tmp_path / "docs.txt", capsys).startswith(
        f"{tmp_path / 'docs.txt'} is a directory without Parquet files"
    )
    assert _refused(tokenizer, tmp_path / "loop.jsonl", capsys) == (
        f"{tmp_path / 'loop.jsonl'} cannot be opened (Too many levels of symbolic links); "
        "give a data file"
    )
    (tmp_path / "a.txt").write_text("a document")
    assert _refused(str(tmp_path / "tok.json"), tmp_path / "a.txt", capsys, key=None) == (
        f"{tmp_path / 'tok.json'} is not a regular file (a FIFO); give a tokenizer.json"
    )
    assert _refused(str(tmp_path), tmp_path / "a.txt", capsys, key=None) == (
        f"{tmp_path} is a directory; give a tokenizer.json"
    )


@pytest.mark.parametrize("name", ["pipe.jsonl", "pipe.jsonl.zst", "pipe.parquet", "pipe.txt"])
def test_the_readers_refuse_a_fifo_without_waiting_for_a_writer(tmp_path, name):
    """What evaluate's --text and any other direct caller reach, past the CLI's checks."""
    from engine.data.sources import iter_source

    key = None if name.endswith(".txt") else "text"
    with _fifo(tmp_path / name), pytest.raises(ValueError, match=rf"{name} is not a regular file"):
        list(iter_source(tmp_path / name, key))
