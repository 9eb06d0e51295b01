"""The benchmark CLIs reject bad flags with one line and exit status 2, before any work."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def _exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


# (script, argv, message): each bad flag is one line on stderr and exit code 2.
BAD_FLAGS = [
    ("bench_train", ["--preset", "nonexistent"], "unknown model preset 'nonexistent'"),
    ("bench_train", ["--tp", "0"], "argument --tp: 0 must be >= 1"),
    ("bench_train", ["--micro-batch", "0"], "argument --micro-batch: 0 must be >= 1"),
    ("bench_train", ["--seq", "0"], "argument --seq: 0 must be >= 1"),
    ("bench_train", ["--threads", "0"], "argument --threads: 0 must be >= 1"),
    ("bench_train", ["--references", "eager,jax"], "--references: unknown 'jax'"),
    (
        "bench_train",
        ["--also-torch-kernels", "--kernels", "torch"],
        "--also-torch-kernels compares the kernels with torch's ops",
    ),
    ("bench_train", ["--tp", "two"], "argument --tp: 'two' is not an integer"),
    ("bench_kernels", ["--tokens", "0"], "argument --tokens: 0 must be >= 1"),
    ("bench_kernels", ["--hidden", "64", "-3"], "argument --hidden: -3 must be >= 1"),
    ("bench_kernels", ["--vocab", "0"], "argument --vocab: 0 must be >= 1"),
    ("bench_kernels", ["--tp", "0"], "argument --tp: 0 must be >= 1"),
    ("bench_kernels", ["--dtype", "int8"], "argument --dtype: invalid choice"),
    ("bench_moe", ["--tokens", "0"], "argument --tokens: 0 must be >= 1"),
    ("bench_moe", ["--top-k", "9"], "--top-k 9 exceeds --experts 8"),
    ("bench_moe", ["--only", "both"], "argument --only: invalid choice"),
    ("bench_dp_memory", ["--dp", "4", "--replicas", "3"], "--dp 4 --replicas 3: need dp >= 2"),
    ("bench_dp_memory", ["--dp", "1"], "--dp 1 --replicas 2: need dp >= 2"),
    (
        "bench_preprocess",
        ["--vocab-size", "10"],
        "argument --vocab-size: 10 is too small: a byte-level BPE needs at least 261 ids",
    ),
    ("bench_pipeline", ["--layers", "0"], "argument --layers: 0 must be >= 1"),
    ("bench_pipeline", ["--pp", "0"], "argument --pp: 0 must be >= 1"),
    (
        "bench_pipeline",
        ["--schedules", "1f1b,gpipe"],
        "--schedules 'gpipe' is not one of 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev",
    ),
    ("bench_cp_balance", ["--cp", "0"], "argument --cp: 0 must be >= 1"),
    ("bench_cp_balance", ["--replays", "0"], "argument --replays: 0 must be >= 1"),
    (
        "bench_cp_balance",
        ["--seq", "30"],
        "--seq 30 is not divisible by 2·cp = 8; choose a multiple of 8",
    ),
]


@pytest.mark.parametrize(("script", "argv", "message"), BAD_FLAGS)
def test_bench_bad_flags(script, argv, message, monkeypatch, capsys):
    bench = _load(script, monkeypatch)
    assert _exit_code(bench.main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bench_preprocess_refuses_a_byte_cap_with_no_text(monkeypatch, capsys):
    """--max-bytes below any non-empty stdlib file was the tokenizer trainer's traceback."""
    from engine.data.default_corpus import stdlib_sources

    bench = _load("bench_preprocess", monkeypatch)
    argv = ["--max-bytes", "1", "--rounds", "1", "--workers", "1", "--formats", "text"]
    # Files of at most 1 byte are empty ones in the stdlib here, unless it has a 1-byte
    # file: then the benchmark runs (on that one byte).
    no_text = not any(size for _, size in stdlib_sources(1)[1])
    assert _exit_code(bench.main, argv) == (2 if no_text else 0)
    if no_text:
        line = capsys.readouterr().err.strip()
        assert line.startswith("bench_preprocess.py: --max-bytes 1 takes only empty files"), line
        assert len(line.splitlines()) == 1


def test_bench_train_writes_every_loop_to_csv(tmp_path, monkeypatch):
    """A run with a reference writes one CSV row per loop, the reference's with its ratio
    (the meshtron row has none: a header built from the first row alone used to refuse
    the second). The ratio is meshtron's median step time over the reference's."""
    import csv

    bench = _load("bench_train", monkeypatch)
    out = tmp_path / "bench.csv"
    argv = [
        "--preset",
        "gpt_tiny",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seq",
        "16",
        "--micro-batch",
        "2",
        "--vocab",
        "256",
        "--threads",
        "1",
        "--references",
        "eager",
        "--precision",
        "fp32",
        "--warmup",
        "1",
        "--blocks",
        "2",
        "--steps-per-block",
        "1",
        "--out",
        str(out),
    ]
    assert _exit_code(bench.main, argv) in (0, None)
    rows = list(csv.DictReader(out.open()))
    assert [r["loop"].split()[0] for r in rows] == ["meshtron", "pytorch"]
    assert rows[0]["ratio"] == ""
    want = float(rows[0]["step_ms_median"]) / float(rows[1]["step_ms_median"])
    assert float(rows[1]["ratio"]) == pytest.approx(want, rel=1e-12)


def test_bench_train_says_when_the_reference_cannot_be_built(tmp_path, monkeypatch, capsys):
    """The plain PyTorch reference is GPT-2's parts only: with 2 KV heads for 4 query
    heads (--kv-heads) the run times meshtron alone, and says so in one line."""
    bench = _load("bench_train", monkeypatch)
    small = ["--preset", "gpt_tiny", "--hidden", "32", "--layers", "1", "--heads", "4"]
    small += ["--seq", "8", "--micro-batch", "1", "--vocab", "128", "--threads", "1"]
    small += ["--warmup", "0", "--blocks", "1", "--steps-per-block", "1"]
    out = tmp_path / "bench.csv"
    assert _exit_code(bench.main, [*small, "--kv-heads", "2", "--out", str(out)]) in (0, None)
    printed = capsys.readouterr().out
    assert "note: no plain PyTorch reference: it builds GPT-2's parts only" in printed
    assert "kv=2" in printed  # the model line names the KV heads
    assert [row["loop"].split()[0] for row in csv.DictReader(out.open())] == ["meshtron"]


@pytest.mark.slow
def test_bench_kernel_host_refuses_without_a_gpu_in_one_line(tmp_path):
    """The GPU-only diagnosis tool, shown no GPU (on any machine), says so in one line."""
    import os

    from tests.launch_util import run

    root = Path(__file__).resolve().parents[1]
    tool = str(root / "tools" / "bench_kernel_host.py")
    out = run([sys.executable, tool], tmp_path, 120, CUDA_VISIBLE_DEVICES="")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "bench_kernel_host.py: needs a CUDA GPU (it times GPU kernels)"
    ], out.stderr
    assert os.listdir(tmp_path) == []


def test_bench_kernels_without_a_gpu_refuses_in_one_line_pointing_to_smoke(
    tmp_path, monkeypatch, capsys
):
    """The full sweep on a CPU (the Triton interpreter) ran for minutes saying nothing:
    without --smoke it is refused at once, in one line, and nothing is written."""
    bench = _load("bench_kernels", monkeypatch)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert _exit_code(bench.main, ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--smoke" in err, err
    assert not (tmp_path / "out").exists()


def test_matmul_ceiling_is_the_fastest_matmul_and_a_share_above_it_is_marked(monkeypatch):
    """The ceiling is the fastest of its matmuls (a median timed the machine's load, and
    a step beat it: 141 %); a loop still above 100 % is marked and explained."""
    import io

    import torch
    from rich.console import Console

    from studies.bench import train, train_report

    clock = iter([0.0, 0.5, 1.0, 3.0, 3.0, 5.0])  # matmuls of 0.5 s, 2 s, 2 s
    monkeypatch.setattr(train, "_now", lambda device: next(clock))
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: a)  # no real work
    assert train.matmul_ceiling(torch.device("cpu"), None, reps=3) == 2 * 1024**3 / 0.5
    row = {
        "loop": "meshtron",
        "step_ms_median": 1.0,
        "step_ms_p10": 1.0,
        "step_ms_p90": 1.0,
        "cpu_ms_median": 1.0,
        "tokens_per_s": 1.0,
        "model_tflops_per_s": 1.0,
        "pct_of_matmul_ceiling": 141.3,
        "mfu_pct": None,
    }
    meta = {
        "device_name": "cpu",
        "precision": "fp32",
        "model": "gpt",
        "seq": 16,
        "micro_batch": 2,
        "matmul_ceiling_tflops": 1.0,
        "ceiling_shape": "1024³ fp32, fastest of 10",
        "load_avg_1min": 9.5,
    }
    out = io.StringIO()
    train_report.render([row], meta, Console(file=out, width=200))
    text = out.getvalue()
    assert "141.3% *" in text and "the ceiling was timed low (load average 9.50)" in text, text
