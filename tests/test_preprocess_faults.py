"""Preprocessing under faults: a killed worker, a killed run, two runs on one prefix, and
outputs that would overwrite an input. Each ends in one line, with nothing half written."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.multiproc import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "tools" / "preprocess_data.py"
MARKER = "KILL-THIS-WORKER"
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(100))

# Swaps the encode function the parent hands its workers for one that SIGKILLs its own
# process (as the out-of-memory killer would) on the chunk holding MARKER; then runs the CLI.
KILLER = f"""
import os, signal
from engine.data import preprocess

_encode = preprocess._encode_texts


def encode_or_die(tokenizer, texts):
    if any({MARKER!r} in text for text in texts):
        os.kill(os.getpid(), signal.SIGKILL)
    return _encode(tokenizer, texts)
"""
DRIVER = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import killer
from engine.data import preprocess
preprocess._encode_texts = killer.encode_or_die
cli, sys.argv = sys.argv[2], ["preprocess_data.py", *sys.argv[3:]]
runpy.run_path(cli, run_name="__main__")
"""


def _cli():
    spec = importlib.util.spec_from_file_location("preprocess_faults_cli", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = _cli().main(["--no-progress", *argv])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    return code, capsys.readouterr().err


def _jsonl(path: Path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_killed_worker_ends_the_run_with_one_line_naming_its_input(tmp_path):
    """A SIGKILLed encode worker used to leave the parent waiting forever; now the parent
    exits 2 naming the input that worker was encoding, and writes nothing."""
    data = tmp_path / "data"
    data.mkdir()
    # Exactly one chunk of documents each (256), so the dying chunk is kill.jsonl's alone.
    good = _jsonl(data / "good.jsonl", [f"def f{i}(x):\n    return x + {i}\n" for i in range(256)])
    bad = _jsonl(data / "kill.jsonl", [f"print({MARKER!r})"] * 3)
    (tmp_path / "killer.py").write_text(KILLER)
    out = tmp_path / "out"
    argv = ["--input", good, "--input", bad, "--text-key", "text", "--vocab-size", "300"]
    argv += ["--output-prefix", str(out / "corpus"), "--workers", "2", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path), str(CLI), *argv],
        env=subprocess_env(ROOT),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,  # a bound on a hang, not a timing: the run takes seconds
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert "killed by SIGKILL" in lines[0] and f"while encoding {bad}" in lines[0], lines
    assert "good.jsonl" not in lines[0] and "out-of-memory killer" in lines[0], lines
    assert _files(out) == []  # no .bin/.idx, no temp files, no tokenizer, no lock


def test_temp_files_of_a_killed_run_are_removed_by_the_next_run(tmp_path, capsys):
    """A run killed mid-write leaves hidden temp files beside its outputs; the next run on
    that prefix removes those whose writer is dead, and no other file."""
    out = tmp_path / "corpus"
    killed = textwrap.dedent(f"""
        import os, signal
        from engine.data.fsutil import temp_path_beside
        from engine.data.indexed import IndexedDatasetWriter
        writer = IndexedDatasetWriter({str(out)!r}, vocab_size=300, eod_id=0)
        writer.add_document([5, 6, 7])
        temp_path_beside({str(out) + ".tokenizer.json"!r})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", killed], env=subprocess_env(ROOT), timeout=300)
    assert proc.returncode == -9
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 3, _files(tmp_path)
    live = tmp_path / f".corpus.bin.{os.getpid()}.0123abcd.tmp"  # a live writer's
    other = tmp_path / f".other.bin.{_dead_pid()}.0123abcd.tmp"  # another prefix's
    live.touch()
    other.touch()
    (tmp_path / "in.txt").write_text(TEXT)
    argv = ["--input", str(tmp_path / "in.txt"), "--output-prefix", str(out)]
    code, err = _run_cli([*argv, "--vocab-size", "300"], capsys)
    assert code == 0, err
    assert "removed 3 temporary file(s) of runs that died" in err, err
    assert all(str(p) in err for p in left), err
    assert _files(tmp_path) == sorted(
        [other.name, live.name, "corpus.bin", "corpus.idx", "corpus.tokenizer.json", "in.txt"]
    )


def _hold_lock(path: Path):
    """Hold ``path`` as a first run would: an exclusive flock, its PID written in it."""
    handle = open(path, "a+")  # noqa: SIM115 - the caller closes it
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def test_a_second_run_on_a_prefix_being_written_is_refused(tmp_path, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    first = {"corpus.bin": b"the first run's", "corpus.idx": b"output"}
    for name, data in first.items():
        (tmp_path / name).write_bytes(data)
    lock = _hold_lock(tmp_path / "corpus.lock")
    try:
        argv = ["--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "corpus")]
        code, err = _run_cli([*argv, "--vocab-size", "300"], capsys)
    finally:
        lock.close()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert f"being written by another run (PID {os.getpid()}" in lines[0], lines
    assert all((tmp_path / n).read_bytes() == d for n, d in first.items())
    assert _files(tmp_path) == ["corpus.bin", "corpus.idx", "corpus.lock", "in.txt"]


def test_a_stale_lock_of_a_dead_run_is_taken_over_saying_so(tmp_path, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    pid = _dead_pid()
    (tmp_path / "corpus.lock").write_text(f"{pid}\n")  # recorded, but nobody holds the flock
    argv = ["--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "corpus")]
    code, err = _run_cli([*argv, "--vocab-size", "300"], capsys)
    assert code == 0, err
    assert f"took over {tmp_path / 'corpus.lock'} from PID {pid}" in err, err
    assert _files(tmp_path) == ["corpus.bin", "corpus.idx", "corpus.tokenizer.json", "in.txt"]


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("tokenizer_out_is_an_input", "is an input and would be overwritten"),
        ("input_is_prefix_bin", "is an input and would be overwritten"),
        ("input_is_prefix_idx", "is an input and would be overwritten"),
        ("prefix_is_a_directory", "give a file name prefix such as"),
        ("prefix_ends_in_a_slash", "give a file name prefix such as"),
    ],
)
def test_outputs_that_would_overwrite_inputs_are_refused_before_writing(
    tmp_path, capsys, case, fragment
):
    data = tmp_path / "data"
    data.mkdir()
    text = TEXT
    for name in ("a.txt", "corpus.bin", "corpus.idx"):
        (data / name).write_text(text)
    prefix, inputs, extra = str(data / "corpus"), [str(data / "a.txt")], []
    if case == "tokenizer_out_is_an_input":
        extra = ["--tokenizer-out", str(data / "a.txt")]
    elif case.startswith("input_is_prefix_"):
        inputs.append(f"{prefix}.{case[-3:]}")
    elif case == "prefix_is_a_directory":
        prefix = str(data)
    else:
        prefix = str(tmp_path / "fresh") + "/"
    argv = [a for i in inputs for a in ("--input", i)] + ["--output-prefix", prefix, *extra]
    code, err = _run_cli([*argv, "--vocab-size", "300"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and fragment in lines[0], (code, err)
    assert all(p.read_text() == text for p in data.iterdir()), "an input was overwritten"
    assert _files(data) == ["a.txt", "corpus.bin", "corpus.idx"]
    assert not (tmp_path / "fresh").exists() or _files(tmp_path / "fresh") == []
