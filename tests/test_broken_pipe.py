"""A tool whose reader stops reading (``python -m engine.pretrain --help | head``) stops
quietly: no traceback, no "Exception ignored" at exit, status 141 (128 + SIGPIPE, what a
C tool killed by the signal reports). Before, ``engine.pretrain --help | head -1`` printed
a BrokenPipeError traceback, and ``tools/checkpoint.py inspect ... | head`` printed
``error: [Errno 32] Broken pipe``; every tool now runs its ``main`` through
``engine.tool_args.run_tool``. (argparse's own ``--help`` ignores a failed write and exits
0, also quietly.)

The reader's end of the pipe is closed before the tool starts, so its first write fails
every time (a real ``head`` may leave before or after the write: a race)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.multiproc import subprocess_env

COMMANDS = {
    "pretrain --help": ["-m", "engine.pretrain", "--help"],
    "plan search": [
        "tools/plan.py",
        "search",
        "--model",
        "gpt_13b",
        "--global-batch",
        "512",
        "--gpus",
        "8",
        "--cluster",
        "dgx_h100",
        "--pp",
        "1",
    ],
    "plan predict --json": [
        "tools/plan.py",
        "predict",
        "--model",
        "gpt_1.3b",
        "--global-batch",
        "512",
        "--gpus",
        "16",
        "--tp",
        "2",
        "--json",
    ],
}


def _run_with_stdout_unread(args: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGS`` with stdout a pipe whose reader has gone before the first line."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=subprocess_env(ROOT),
            text=True,
            timeout=timeout,
        )
    finally:
        os.close(write_end)


@pytest.mark.slow  # a fresh interpreter per command (torch, Hydra): about 5 s in all
@pytest.mark.parametrize("name", COMMANDS)
def test_a_closed_reader_stops_the_tool_quietly(name: str) -> None:
    done = _run_with_stdout_unread(COMMANDS[name], ROOT, timeout=120)
    assert done.stderr == "", done.stderr
    assert done.returncode == 141


class _GoneReader:
    """A stdout whose reader has left: every write fails as a closed pipe's does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


def test_a_tool_reporting_os_errors_lets_a_closed_reader_through(tmp_path, monkeypatch) -> None:
    """``tools/checkpoint.py`` turns an OSError (an unreadable file) into ``error: ...``,
    exit 2; a closed stdout is not such an error and reaches ``run_tool``."""
    from tests.test_checkpoint import (  # checkpoint_cli: tools/checkpoint.py
        _model_and_optimizer,
        _train_step,
        checkpoint_cli,
        save_checkpoint,
    )

    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, 1)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, ps=None, state={})
    monkeypatch.setattr(sys, "stdout", _GoneReader())
    with pytest.raises(BrokenPipeError):
        checkpoint_cli.main(["inspect", str(tmp_path)])


@pytest.mark.slow
def test_a_run_outlives_its_consoles_reader(tmp_path) -> None:
    """``python -m engine.pretrain | head``: before, rank 0's next console line raised
    BrokenPipeError, the rank died and took the run with it ("lost a peer"), checkpoint
    and all. Now the console goes quiet and the run finishes: its checkpoint, final model
    and run log (which keeps every console line) are all there."""
    from tests.corpus import build_test_corpus

    (tmp_path / "corpus").mkdir()
    prefix, tokenizer = build_test_corpus(tmp_path / "corpus")
    overrides = [
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        "model=gpt_tiny",
        "model.vocab_size=512",
        "data.seq_len=32",
        "tp_size=1",
        "dp_size=2",
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "trainer.eval_every=2",
        f"checkpoint.dir={tmp_path}/ck",
        f"hydra.run.dir={tmp_path}/run",
    ]
    done = _run_with_stdout_unread(["-m", "engine.pretrain", *overrides], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "ck" / "step_00000004").is_dir() and (tmp_path / "ck" / "final").is_dir()
    log = (tmp_path / "run" / "pretrain.log").read_text()
    assert [line.split()[1] for line in log.splitlines() if line.startswith("step ")][:4] == [
        "1/4",
        "2/4",
        "2",  # step 2's validation line
        "3/4",
    ], log
