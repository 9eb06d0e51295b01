"""The benchmark CLIs reject bad flags with one line and exit status 2, before any work."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "nonexistent"], "unknown model preset 'nonexistent'"),
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (["--micro-batch", "0"], "--micro-batch must be >= 1, got 0"),
        (["--seq", "0"], "--seq must be >= 1, got 0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--references", "eager,jax"], "--references: unknown 'jax'"),
        (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
    ],
)
def test_bench_train_bad_flags(argv, message, monkeypatch, capsys):
    bench = _load("bench_train", monkeypatch)
    assert _exit_code(bench.main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "0"], "--tokens values must be >= 1, got 0"),
        (["--hidden", "64", "-3"], "--hidden values must be >= 1, got -3"),
        (["--vocab", "0"], "--vocab must be >= 1, got 0"),
        (["--tp", "0"], "--tp values must be >= 1, got 0"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
    ],
)
def test_bench_kernels_bad_flags(argv, message, monkeypatch, capsys):
    bench = _load("bench_kernels", monkeypatch)
    assert _exit_code(bench.main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
