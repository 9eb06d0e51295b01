"""Shared pieces of the launcher tests: a tiny pre-training run and subprocess plumbing."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def call_main(main, argv: list[str]) -> int:
    """Exit status of a command line's ``main(argv)`` run in this process (a SystemExit's
    code included), with the SIGTERM and SIGINT handlers it may install put back. For tests
    whose subject is what the command does, not that it is a process: saves its imports."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_repo(**extra: str) -> dict[str, str]:
    """os.environ with this checkout prepended to PYTHONPATH (extended, never replaced)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


# The model and data of every tiny run: a 32-wide GPT with 512 tokens on 16-token sequences.
TINY_RUN = [
    "data.seq_len=16",
    "data.split='80,20,0'",
    "model.vocab_size=512",
    "model.hidden_size=32",
    "model.num_heads=4",
]


def tiny_overrides(corpus: tuple[str, str], run: Path, max_steps: int = 6) -> list[str]:
    """A run small enough for launcher tests: a 2-layer, 32-wide GPT on 16-token sequences.

    lr 3e-3 with one warmup step makes the loss fall within a few steps; checkpoints and
    Hydra's output stay under ``run``.
    """
    prefix, tokenizer = corpus
    return [
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        *TINY_RUN,
        f"trainer.max_steps={max_steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "trainer.global_batch=8",
        "trainer.micro_batch=2",
        "trainer.tensorboard=false",
        "trainer.sample_tokens=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=1",
        f"checkpoint.dir={run / 'ckpt'}",
        "checkpoint.save_final=false",
        f"hydra.run.dir={run / 'hydra'}",
        "trainer.device=cpu",  # several ranks on one machine: the CPU, on any machine
    ]


STEP = re.compile(r"^step\s+(\d+)/\d+\s+loss\s+([\d.]+)", re.M)


def losses(log: str) -> dict[int, float]:
    """Step -> loss from the console's step lines."""
    return {int(m.group(1)): float(m.group(2)) for m in STEP.finditer(log)}


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def python() -> str:
    return sys.executable


def run(
    cmd: list[str],
    cwd: Path | str | None,
    timeout: float,
    *,
    unset: tuple[str, ...] = (),
    **env: str,
) -> subprocess.CompletedProcess:
    """``cmd`` run to completion with this checkout on PYTHONPATH, the variables ``env`` set
    and those named in ``unset`` removed; its output captured as text."""
    full = env_with_repo(**env)
    for name in unset:
        full.pop(name, None)
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def run_pretrain(
    overrides: list[str], cwd: Path | str, timeout: float, **env: str
) -> subprocess.CompletedProcess:
    """``python -m engine.pretrain`` with ``overrides``, run to completion as :func:`run` runs
    a command."""
    return run([sys.executable, "-m", "engine.pretrain", *overrides], cwd, timeout, **env)
