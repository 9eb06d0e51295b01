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

from tests.case_table import shell_cases
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


# Each refused before anything is written, one case a line: id, argv after --input a.txt,
# "fragment of the line".
# {d} is the data folder, holding a.txt, corpus.bin, corpus.idx (inputs too) and sub/.
REFUSED_CASES = """
    tokenizer_out_is_an_input --output-prefix {d}/o --tokenizer-out {d}/a.txt "a.txt is an input and would be overwritten as --tokenizer-out"
    input_is_prefix_bin --input {d}/corpus.bin --output-prefix {d}/corpus "corpus.bin is an input and would be overwritten as the output"
    input_is_prefix_idx --input {d}/corpus.idx --output-prefix {d}/corpus "corpus.idx is an input and would be overwritten as the output"
    prefix_is_a_directory --output-prefix {d}/sub "is a directory: give a file name prefix such as {d}/sub/corpus"
    prefix_ends_in_a_slash --output-prefix {d}/fresh/ "is a directory: give a file name prefix such as {d}/fresh/corpus"
    # found by the adversarial pass of issue 39
    same_input_twice --input {d}/sub/../a.txt --output-prefix {d}/o "sub/../a.txt is given twice (also as {d}/a.txt)"
    tokenizer_out_is_prefix_bin --output-prefix {d}/o --tokenizer-out {d}/o.bin "o.bin would be written both as --tokenizer-out and as the output"
    tokenizer_out_is_a_directory --output-prefix {d}/o --tokenizer-out {d}/sub "sub (--tokenizer-out) is a directory"
    prefix_under_a_file --output-prefix {d}/a.txt/x/o "cannot write into {d}/a.txt/x: {d}/a.txt is a file, not a directory"
    workers_past_any_machine --output-prefix {d}/o --workers 1000000000 "argument --workers: 1000000000 must be <= 1024"
"""
REFUSED = {cid: (args, fragment) for cid, *args, fragment in shell_cases(REFUSED_CASES)}


@pytest.mark.parametrize("case", REFUSED)
def test_outputs_over_inputs_and_bad_combinations_are_refused_before_writing(
    tmp_path, capsys, case
):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for name in ("a.txt", "corpus.bin", "corpus.idx"):
        (data / name).write_text(TEXT)
    args, fragment = REFUSED[case]
    argv = ["--input", str(data / "a.txt"), *(a.format(d=data) for a in args)]
    code, err = _run_cli([*argv, "--vocab-size", "300"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert fragment.format(d=data) in lines[0], lines
    assert all(p.read_text() == TEXT for p in data.glob("*.*")), "an input was overwritten"
    assert _files(data) == ["a.txt", "corpus.bin", "corpus.idx", "sub"]
    assert _files(data / "sub") == []


def test_tokenizer_out_without_training_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    argv = ["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "o")]
    argv += ["--tokenizer", str(tmp_path / "t.json"), "--tokenizer-out", str(tmp_path / "u")]
    code, err = _run_cli(argv, capsys)
    assert code == 2 and "--tokenizer-out saves a trained tokenizer" in err, (code, err)
    assert _files(tmp_path) == ["a.txt"]


def test_a_trained_tokenizer_never_replaces_another_at_its_path(tmp_path, capsys):
    """The same command again trains the same tokenizer (BPE training is deterministic) and
    may rewrite its files; another vocabulary size would train another one, which runs
    trained with the first record by SHA-256 and would then refuse: that is refused before
    anything is written, and every file stays as it was (bytes compared)."""
    (tmp_path / "a.txt").write_text(TEXT * 20)
    argv = ["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "o")]
    assert _run_cli([*argv, "--vocab-size", "300"], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert _run_cli([*argv, "--vocab-size", "300"], capsys)[0] == 0  # the same one again
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    code, err = _run_cli([*argv, "--vocab-size", "280"], capsys)
    tokenizer = tmp_path / "o.tokenizer.json"
    assert code == 2 and err.strip().splitlines() == [
        f"preprocess_data.py: error: {tokenizer} exists and the tokenizer trained now is "
        "another one (other inputs or --vocab-size); runs trained with it would refuse a "
        f"replaced file: pass --tokenizer {tokenizer} to encode with it, --tokenizer-out "
        "PATH to keep both, or delete it first"
    ], err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
