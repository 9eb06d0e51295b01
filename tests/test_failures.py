"""Runs that go wrong: bad steps, lost ``latest``, frozen and killed peers, pruning, and the
run-level promises around them (validation at any dp, extending a run, the run log).

The failure cases run ``python -m engine.pretrain`` as real processes (cwd and every
output in tmp_path), the way a user or a launcher would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint.manager import CheckpointDirBusy, CheckpointDirLock
from engine.checkpoint.storage import (
    CheckpointError,
    read_index,
    read_latest,
    step_dirs,
    verify_complete,
    write_index,
    write_latest,
)
from engine.config import Config
from tests.corpus import build_test_corpus
from tests.multiproc import RankFailure, run_ranks, subprocess_env
from tests.test_checkpoint import (
    _all_tensors,
    _flip_bit,
    _model_and_optimizer,
    _train_step,
    run_config,
    run_overrides,
)
from tests.test_engine import ROOT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """The fixed test corpus of tests/corpus.py (the same on every Python version)."""
    return build_test_corpus(tmp_path_factory.mktemp("corpus"))


def pretrain(cwd: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m engine.pretrain`` in ``cwd`` (Hydra's run directory: cwd/run)."""
    env = {**subprocess_env(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "engine.pretrain", f"hydra.run.dir={cwd / 'run'}", *overrides]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def single(corpus, ckpt: Path, *extra: str) -> list[str]:
    """A tiny one-process fp32 run saving every 2 steps, keeping 2."""
    return [
        *run_overrides(corpus, ckpt),
        "tp_size=1",
        "dp_size=1",
        "checkpoint.every=2",
        "trainer.precision=fp32",
        "checkpoint.save_final=true",
        *extra,
    ]


@pytest.fixture(scope="module")
def good_run(corpus, tmp_path_factory) -> Path:
    """Four good steps, checkpoints at steps 2 and 4 (a real process)."""
    cwd = tmp_path_factory.mktemp("good")
    proc = pretrain(cwd, *single(corpus, cwd / "ckpt", "trainer.max_steps=4"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(step_dirs(cwd / "ckpt")) == [2, 4]
    return cwd / "ckpt"


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


# ------------------------------------------------------------------------- bad steps


@pytest.mark.slow
def test_nan_run_skips_steps_stops_and_keeps_the_good_checkpoints(corpus, good_run, tmp_path):
    """lr=1e3 (the largest accepted) from the good step-4 checkpoint: the weights grow until
    a step S is non-finite (NaN or inf). Each bad step is skipped with a line; 3 in a row
    stop the run at S+2 (exit 3, one line on stderr); no checkpoint is written during the
    streak, so the two checkpoints saved before it survive intact (finite, verified) and
    ``final`` is not overwritten with broken weights."""
    ckpt = _copy(good_run, tmp_path)
    final_before = (ckpt / "final" / "model.safetensors").read_bytes()
    proc = pretrain(
        tmp_path,
        *single(
            corpus,
            ckpt,
            "trainer.max_steps=30",
            "optim.lr=1e3",
            "optim.min_lr=0",
            "trainer.max_bad_steps=3",
        ),
    )
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = _stderr_lines(proc)
    stop = re.match(r"stopped at step (\d+): 3 bad steps in a row", lines[0])
    assert len(lines) == 1 and stop, lines
    first_bad = int(stop.group(1)) - 2
    assert re.search(
        rf"step {first_bad}: non-finite loss (nan|inf) or gradient norm (nan|inf): "
        "step skipped",
        proc.stdout,
    ), proc.stdout[-2000:]
    even = first_bad + first_bad % 2  # a save point (every 2 steps) inside the streak
    assert f"not saving step {even}" in proc.stdout
    kept = [even - 4, even - 2]  # saved before the streak; older ones pruned (keep=2)
    assert sorted(step_dirs(ckpt)) == kept and read_latest(ckpt) == kept[-1]
    for step in kept:
        path = ckpt / f"step_{step:08d}"
        assert verify_complete(path) is None
        assert all(torch.isfinite(t.float()).all() for t in _all_tensors(path).values())
    assert (ckpt / "final" / "model.safetensors").read_bytes() == final_before
    assert "Traceback" in (tmp_path / "run" / "pretrain.log").read_text()  # kept off the console


def _fp16_forever(cfg: Config) -> dict:
    from engine.worker import run_worker

    return run_worker(cfg)


@pytest.mark.slow
def test_fp16_scaler_skipping_forever_hits_max_bad_steps(corpus, tmp_path):
    """A loss scale of 1e38 overflows every step (the scaled loss alone is near fp32's max);
    the scaler halves it and skips, which took 120 steps to recover from and would never
    end for a model that overflows at any scale. 3 overflow steps in a row stop it."""
    cfg = run_config(
        corpus,
        tmp_path / "ckpt",
        "tp_size=1",
        "dp_size=1",
        "trainer.max_steps=20",
        "trainer.precision=fp16",
        "trainer.loss_scale_init=1e38",
        "trainer.max_bad_steps=3",
    )
    with pytest.raises(
        RankFailure,
        match="stopped at step 3: 3 bad steps in a row, the last one "
        "with the fp16 loss scale overflowed",
    ):
        run_ranks(_fp16_forever, 1, cfg, timeout=120)
    assert not step_dirs(tmp_path / "ckpt")


def _every_loss_nan(cfg: Config) -> dict:
    """The worker, with every training loss made NaN (fault injection in this process)."""
    from engine.runner import LocalRunner
    from engine.worker import run_worker

    loss = LocalRunner._loss
    LocalRunner._loss = lambda self, batch: loss(self, batch) * float("nan")
    return run_worker(cfg)


@pytest.mark.slow
def test_a_run_in_which_no_step_succeeded_exits_non_zero(corpus, tmp_path):
    """2 steps, both NaN, fewer than trainer.max_bad_steps=10: the streak never reaches the
    limit, yet the run must not end as a success (it used to, exit 0)."""
    cfg = run_config(corpus, tmp_path / "ckpt", "tp_size=1", "dp_size=1", "trainer.max_steps=2")
    with pytest.raises(
        RankFailure,
        match="no step succeeded: 2 steps of this run were non-finite and skipped, none was good",
    ):
        run_ranks(_every_loss_nan, 1, cfg, timeout=120)
    assert not step_dirs(tmp_path / "ckpt")


# ------------------------------------------------------------ lost latest and pruning


@pytest.mark.slow
def test_missing_latest_resumes_from_the_newest_verified_checkpoint(corpus, good_run, tmp_path):
    """A copy without ``latest`` (as rsync may make): the run resumes from step 4, the
    newest checkpoint that verifies, and its first save prunes step 2 saying why."""
    ckpt = _copy(good_run, tmp_path)
    (ckpt / "latest").unlink()
    proc = pretrain(tmp_path, *single(corpus, ckpt, "trainer.max_steps=6"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{ckpt} has no 'latest': trying the newest complete checkpoint" in proc.stdout
    assert "resuming from step 4" in proc.stdout, proc.stdout[-2000:]
    assert sorted(step_dirs(ckpt)) == [4, 6] and read_latest(ckpt) == 6
    assert f"pruned {ckpt / 'step_00000002'}: older than the 2 newest kept" in proc.stdout


def _save_steps(root: Path, steps: list[int]):
    model, optimizer = _model_and_optimizer()
    for step in steps:
        _train_step(model, optimizer, step)
        save_checkpoint(root, step, model=model, optimizer=optimizer, ps=None, state={}, keep=100)
    return model, optimizer


def _load_and_save(root: Path, step: int) -> tuple[int, list[str]]:
    messages: list[str] = []
    model, optimizer = _model_and_optimizer(seed=9)
    loaded = load_checkpoint(root, model=model, optimizer=optimizer, ps=None, log=messages.append)
    save_checkpoint(
        root, step, model=model, optimizer=optimizer, ps=None, state={}, keep=2, log=messages.append
    )
    return loaded.step, messages


def test_damaged_checkpoint_is_removed_with_its_reason_and_named_plainly(tmp_path):
    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2, 5])
    damaged = root / "step_00000005" / "rank00000.safetensors"
    _flip_bit(damaged)
    loaded, messages = _load_and_save(root, 3)
    assert loaded == 2
    assert messages[0].startswith(
        f"checkpoint {root / 'step_00000005'} is unusable ({damaged} is damaged: its BLAKE3 hash"
    ), messages
    assert "rank 0:" not in messages[0]  # the file is named, not a rank that did not own it
    assert messages[1:] == [
        f"pruned {root / 'step_00000001'}: older than the 2 newest kept (checkpoint.keep=2)",
        f"removed {root / 'step_00000005'}: newer than step 3 and not usable ({damaged} is "
        "damaged: its BLAKE3 hash does not match the index)",
    ], messages
    assert sorted(step_dirs(root)) == [2, 3]


def test_a_verified_checkpoint_newer_than_the_loaded_one_is_never_deleted(tmp_path):
    """``latest`` names step 2 (its update after step 5 was lost) but step 5 is complete:
    step 2 loads (``latest`` decides), and saving step 3 keeps step 5."""
    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2, 5])
    write_latest(root, "step_00000002")
    loaded, messages = _load_and_save(root, 3)
    assert loaded == 2
    assert sorted(step_dirs(root)) == [2, 3, 5] and verify_complete(root / "step_00000005") is None
    assert messages == [
        f"pruned {root / 'step_00000001'}: older than the 2 newest kept (checkpoint.keep=2)"
    ], messages


def _edit_index(change) -> Callable[[Path], None]:
    """Damage that keeps the index's own checksum right, as whoever edits an index can."""

    def damage(step: Path) -> None:
        index = read_index(step)
        change(index)
        write_index(step, {k: v for k, v in index.items() if k != "index_sha256"})

    return damage


def _raw(text: str) -> Callable[[Path], None]:
    return lambda step: (step / "index.json").write_text(text)


# (id, damage to step 2's index.json, fragment of the reason the fallback line gives)
INDEX_DAMAGE = [
    ("nested_deeply", _raw("[" * 100_000 + "]" * 100_000), "not readable JSON (nested too deeply)"),
    ("not_json", _raw("{"), "not readable JSON"),
    ("a_list", _raw("[]"), "is not a meshtron training checkpoint index"),
    ("int_of_5000_digits", _raw('{"step": ' + "9" * 5000 + "}"), "not readable JSON"),
    ("tensors_a_list", _edit_index(lambda i: i.update(tensors=[])), "tensors is not a dict"),
    (
        "model_config_a_list",
        _edit_index(lambda i: i.update(model_config=["x"])),
        "model_config is not a dict",
    ),
    (
        "model_config_unknown_key",
        _edit_index(lambda i: i["model_config"].update(bogus=1)),
        "has a malformed model_config",
    ),
    (
        "step_disagrees",
        _edit_index(lambda i: i.update(step=7)),
        "claims step 7, but the directory is step_00000002",
    ),
    (
        "layout_tp_a_string",
        _edit_index(lambda i: i["layout"].update(tp_size="two")),
        "layout.tp_size='two' is not a size",
    ),
    (
        "scalars_a_list",
        _edit_index(lambda i: i["optimizer"].update(scalars=[1])),
        "optimizer.scalars is not a mapping of mappings",
    ),
    (
        "file_bytes_a_string",
        _edit_index(lambda i: i["files"]["rank00000.safetensors"].update(bytes="9")),
        "the record of 'rank00000.safetensors' is malformed",
    ),
    (
        "slice_a_number",
        _edit_index(
            lambda i: next(iter(i["files"].values()))["slices"].update(
                {"model/embedding.position": 5}
            )
        ),
        "is malformed (TypeError",
    ),
    (
        "size_disagrees",
        _edit_index(lambda i: i["files"]["rank00000.safetensors"].update(bytes=9)),
        "the index says 9 (truncated?)",
    ),
]


@pytest.mark.parametrize(
    ("damage", "fragment"), [c[1:] for c in INDEX_DAMAGE], ids=[c[0] for c in INDEX_DAMAGE]
)
def test_a_damaged_newest_index_of_any_shape_falls_back_to_the_older_step(
    tmp_path, damage, fragment
):
    """Issue 22: the newest index unreadable in any way (bad JSON of any shape, wrong types,
    claims the files contradict) is skipped with a line naming why; step 1 loads."""
    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2])
    damage(root / "step_00000002")
    messages: list[str] = []
    model, optimizer = _model_and_optimizer(seed=9)
    loaded = load_checkpoint(root, model=model, optimizer=optimizer, ps=None, log=messages.append)
    assert loaded is not None and loaded.step == 1, messages
    assert messages[0].startswith(f"checkpoint {root / 'step_00000002'} is unusable ("), messages
    assert fragment in messages[0] and "falling back to step_00000001" in messages[0], messages


# ------------------------------------------------------------- one run per checkpoint dir


def test_a_failed_save_removes_its_own_temp_and_no_other(tmp_path):
    """Temp names are unique per save; a save that fails removes its own temp directory,
    and neither a failed nor a good save touches another run's temp directory."""
    root = tmp_path / "ckpt"
    model, optimizer = _save_steps(root, [1])
    other = root / ".tmp-step_00000002-another-run"
    other.mkdir()
    (other / "rank00000.safetensors").write_bytes(b"half written by another run")

    def full_disk(point: str) -> None:
        if point == "before_index":
            raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(
            root, 2, model=model, optimizer=optimizer, ps=None, state={}, fault=full_disk
        )
    assert sorted(p.name for p in root.iterdir()) == [other.name, "latest", "step_00000001"]
    save_checkpoint(root, 2, model=model, optimizer=optimizer, ps=None, state={}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [other.name, "latest", "step_00000002"]
    assert (other / "rank00000.safetensors").read_bytes() == b"half written by another run"


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_checkpoint_dir_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    root = tmp_path / "ckpt"
    first = CheckpointDirLock(root, run_dir="first-run")
    first.acquire(log=print)
    with pytest.raises(CheckpointDirBusy) as busy:
        CheckpointDirLock(root, run_dir="second-run").acquire(log=print)
    assert f"PID {os.getpid()}" in str(busy.value) and "run directory first-run" in str(busy.value)
    first.release()
    assert (root / ".lock").read_text() == ""  # a clean end leaves no owner behind
    # A run killed while holding the lock leaves its record and a half-written save.
    pid = _dead_pid()
    record = {"user": "u", "host": "h", "pid": pid, "started": "then", "run_dir": "dead-run"}
    (root / ".lock").write_text(json.dumps(record))
    (root / ".tmp-step_00000003-dead").mkdir()
    messages: list[str] = []
    taker = CheckpointDirLock(root, run_dir="taker")
    taker.acquire(log=messages.append)
    taker.release()
    assert messages == [
        f"took over the lock of {root} from a run that did not end cleanly (u@h, PID {pid}, "
        "started then, run directory dead-run; no longer running)",
        f"removed {root / '.tmp-step_00000003-dead'}: an interrupted save of that run",
    ], messages
    assert sorted(p.name for p in root.iterdir()) == [".lock"]


@pytest.mark.slow
def test_a_second_run_in_one_checkpoint_dir_is_refused_up_front(corpus, tmp_path):
    """While a run holds checkpoint.dir, ``python -m engine.pretrain`` on it exits 2 with
    one line naming the holder (host, PID), before any worker, leaving nothing behind."""
    ckpt = tmp_path / "ckpt"
    with CheckpointDirLock(ckpt, run_dir="the-first-run"):
        proc = pretrain(tmp_path, *single(corpus, ckpt, "trainer.max_steps=2"))
    lines = _stderr_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"config error: checkpoint.dir={ckpt} is in use by another run ("), (
        lines
    )
    assert f"PID {os.getpid()}" in lines[0] and "run directory the-first-run" in lines[0]
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock"] and not (tmp_path / "run").exists()


# ----------------------------------------------------------------- frozen / killed peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The frozen-peer cases' trainer.collective_timeout_s. A warm step of this tiny model takes
# a few ms of CPU (under 0.5 s of wall time at load 20 on 2 cores), so 3 s is 6x what a
# live peer needs. Start-up (trainer.collective_startup_timeout_s) gets 60 s for the model
# build after the rendezvous (under 1 s of CPU, plus the optimizer's first import of
# torch._dynamo, 1.2 s): 5x the old 5 s, 25 s, ran out at load 36. The signal comes after
# start-up, so this bound costs no time; a frozen peer is found 3 s after it stops.
_COLLECTIVE_TIMEOUT_S = 3
_STARTUP_TIMEOUT_S = 60

# One line per surviving rank: the watchdog's (no progress), or a collective's failure
# (a peer's connection closed), each naming the step, the rank and the group.
_PEER_LINE = re.compile(
    rf"rank (\d) (stopped: no progress for {_COLLECTIVE_TIMEOUT_S} s in|lost a peer in) "
    r"the [\w/() -]+ of step \d+, "
    r"waiting on its (tp|dp|pp|world) group \(ranks \[[\d, ]+\]\)"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "layout", "world"),
    [
        ("SIGSTOP", "tp_size=2 dp_size=2", 4),
        ("SIGKILL", "tp_size=2 dp_size=2", 4),
        # 2 stages, 4 micro-batches; dp=1: the survivor waits in the schedule on its pp group
        # (the dp and world groups' waits are the tp cases' survivors').
        ("SIGSTOP", "pp_size=2 tp_size=1 dp_size=1 trainer.micro_batch=1", 2),
    ],
)
def test_frozen_or_killed_rank_stops_the_others_with_one_line(corpus, tmp_path, sig, layout, world):
    """Ranks started by environment (as srun or mpirun start them): 4 at tp=2 × dp=2, 2 at
    pp=2. The last rank is frozen (SIGSTOP) or killed (SIGKILL) mid-run; every other one
    must exit non-zero within 60 s (collective_timeout_s plus start-up slack on a loaded
    machine), each with one stderr line naming the step, its rank and the group it
    waited on. Before, they waited forever (SIGSTOP) or printed an 85-line traceback. Under
    pp, what each rank waits on depends on where the signal lands: a rank stuck in the
    schedule names its stage and pp group ("the pipeline schedule (stage 0) of step 4,
    waiting on its pp group (ranks [0, 1])"), one past it the bad-step check of the world."""
    env = {
        **subprocess_env(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
    }
    named = {o.split("=")[0] for o in layout.split()}  # the layout's keys replace the base's
    overrides = [
        f"hydra.run.dir={tmp_path / 'run'}",
        *(o for o in run_overrides(corpus, tmp_path / "ckpt") if o.split("=")[0] not in named),
        *layout.split(),
        "trainer.max_steps=100000",
        "checkpoint.every=0",
        f"trainer.collective_timeout_s={_COLLECTIVE_TIMEOUT_S}",
        f"trainer.collective_startup_timeout_s={_STARTUP_TIMEOUT_S}",
    ]
    survivors = range(world - 1)
    procs, outs = [], []
    try:
        for rank in range(world):
            out = open(tmp_path / f"rank{rank}.out", "w+")  # noqa: SIM115 - closed below
            err = open(tmp_path / f"rank{rank}.err", "w+")  # noqa: SIM115
            outs += [out, err]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "engine.pretrain", *overrides],
                    cwd=tmp_path,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=out,
                    stderr=err,
                )
            )
        # A hang guard only: at load 35 on 2 cores, 4 ranks took over 120 s to import.
        deadline = time.monotonic() + 300
        while "step     3/" not in (tmp_path / "rank0.out").read_text():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(world)]
                raise AssertionError(errs)
            time.sleep(0.2)
        victim = world - 1
        os.kill(procs[victim].pid, getattr(signal, sig))
        stopped = time.monotonic()
        for rank in survivors:
            code = procs[rank].wait(timeout=max(1.0, stopped + 60 - time.monotonic()))
            assert code != 0, rank
        print(f"{sig}: the other ranks exited {time.monotonic() - stopped:.1f} s later")
        errs = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(world)}
        for rank in survivors:
            lines = [x for x in errs[rank].splitlines() if x]
            assert len(lines) == 1 and _PEER_LINE.match(lines[0]), (rank, errs)
            assert _PEER_LINE.match(lines[0]).group(1) == str(rank)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in outs:
            f.close()


@pytest.mark.slow  # subprocess trainers, 17 s on 2 idle cores
def test_every_rank_ends_when_the_rendezvous_cannot_happen(corpus, tmp_path):
    """Ranks started by the environment, as srun and mpirun start them, with
    trainer.rendezvous_timeout_s=1: (a) MASTER_PORT held by another program (rank 1 used
    to wait forever on it), (b) a peer that never arrives, (c) nothing at the address.
    Every rank exits non-zero with one line naming the address and port. No case can
    ever meet, so the timeout needs no margin over anything (its timer starts after the
    imports); 1 s only keeps the waiting short."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # accepts connections and never answers, as a foreign server may
    free = _free_port()
    port_of = {"taken": taken.getsockname()[1], "absent_peer": _free_port(), "nobody": free}
    cases = [("taken", 0), ("taken", 1), ("absent_peer", 0), ("nobody", 1)]
    base = {
        **subprocess_env(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": "2",
    }
    procs = []
    try:
        for i, (case, rank) in enumerate(cases):
            overrides = single(
                corpus,
                tmp_path / f"ckpt{i}",
                "trainer.max_steps=2",
                "dp_size=2",
                "trainer.rendezvous_timeout_s=1",
            )
            env = {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "MASTER_PORT": str(port_of[case]),
            }
            cmd = [
                sys.executable,
                "-m",
                "engine.pretrain",
                f"hydra.run.dir={tmp_path / f'run{i}'}",
                *overrides,
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        started = time.monotonic()
        for (case, rank), proc in zip(cases, procs, strict=True):
            _, err = proc.communicate(timeout=300)
            print(f"{case} rank {rank}: ended {time.monotonic() - started:.1f} s after start")
            lines = [x for x in err.splitlines() if x.strip()]
            where = f"127.0.0.1:{port_of[case]}"
            assert proc.returncode == 3 and len(lines) == 1, (case, rank, proc.returncode, err)
            if (case, rank) == ("taken", 0):
                assert lines[0].startswith(f"rank 0 cannot listen on {where}: the port is taken")
            else:
                assert lines[0].startswith(f"rank {rank}: no rendezvous at {where} within 1 s"), (
                    lines
                )
    finally:
        taken.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------ run-level promises


def _valid_loss(cfg: Config) -> tuple[float, float | None]:
    """The trainer's validation loss of the initial model, and on DP rank 0 of a one-rank
    layout an independent one: F.cross_entropy over the same fixed sequences."""
    import parallel_state
    from engine.trainer import Trainer

    trainer = Trainer(cfg, parallel_state.initialize(cfg.tp_size, cfg.dp_size))
    got = trainer.evaluate()["valid/loss"]
    if trainer.ps.world_size != 1:
        return got, None
    t, data = cfg.trainer, trainer.data.valid.dataset
    losses = []
    with torch.no_grad():
        for j in range(t.eval_batches):
            seqs = torch.stack(
                [torch.as_tensor(data[j * t.micro_batch + i]).long() for i in range(t.micro_batch)]
            )
            logits = trainer.model(seqs[:, :-1])[..., : cfg.model.vocab_size]
            losses.append(F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten()).item())
    return got, sum(losses) / len(losses)


@pytest.mark.slow
def test_validation_loss_does_not_depend_on_dp_size(corpus, tmp_path):
    """The same weights at dp 1, 2 and 4 (tp=1): the same fixed validation sequences. Each
    micro-batch's loss is the same fp32 computation at every layout; only the float64
    sum over them changes order, so 1e-9 relative. Against F.cross_entropy (another
    kernel, fp32): 1e-5 relative."""
    results = {}
    for dp in (1, 2, 4):
        cfg = run_config(
            corpus,
            tmp_path / f"ckpt{dp}",
            "tp_size=1",
            f"dp_size={dp}",
            "trainer.global_batch=8",
            "trainer.eval_batches=4",
            "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0",
        )
        results[dp] = run_ranks(_valid_loss, dp, cfg, timeout=120)[0]
    base, reference = results[1]
    assert abs(base - reference) <= 1e-5 * reference, (base, reference)
    for dp in (2, 4):
        assert abs(results[dp][0] - base) <= 1e-9 * base, results


def _run_all(cfgs: list[Config]) -> list:
    from engine.worker import run_worker

    return [run_worker(cfg).get("history") for cfg in cfgs]


@pytest.mark.slow
def test_extending_max_steps_with_a_fixed_schedule_is_bitwise_the_longer_run(corpus, tmp_path):
    """The README's example, scaled down: a run to step 4 (decay_steps unset, so the
    cosine spans 4 - 1 warmup = 3 steps), re-run with trainer.max_steps=6 and
    optim.decay_steps=3, ends bitwise where one run with max_steps=6 decay_steps=3 ends.
    Re-run without decay_steps instead, the resume says the schedule changed."""
    base = ("tp_size=1", "dp_size=1", "checkpoint.every=2", "optim.decay_steps=null")

    def cfg(name: str, *extra: str) -> Config:
        return run_config(corpus, tmp_path / name, *base, *extra)

    first = cfg("split", "trainer.max_steps=4")
    again = cfg("split", "trainer.max_steps=6", "optim.decay_steps=3")
    whole = cfg("whole", "trainer.max_steps=6", "optim.decay_steps=3")
    unset = cfg("split", "trainer.max_steps=6")  # already at step 6: only loads, and says
    h_first, h_again, h_whole, _ = run_ranks(
        _run_all, 1, [first, again, whole, unset], timeout=240
    )[0]
    assert [s for s, _ in h_again] == [5, 6]  # it resumed from step 4
    assert h_first + h_again == h_whole  # losses bit for bit
    a = _all_tensors(tmp_path / "split" / "step_00000006")
    b = _all_tensors(tmp_path / "whole" / "step_00000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = (tmp_path / "pretrain.log").read_text()  # run_config's run_dir: tmp_path
    assert (
        "note: the learning-rate schedule changed on resume (cosine decay over 3 steps "
        "after warmup, now 5: trainer.max_steps moved its end); to continue the saved "
        "schedule pass optim.decay_steps=3"
    ) in log, log[-2000:]


@pytest.mark.slow
def test_resuming_at_another_global_batch_says_where_the_data_goes_on(corpus, tmp_path):
    """2 steps of 8 sequences, then resumed at 16 a step: the resume says the batch
    changed and that the data goes on from sample 2 × 8 = 16 (counted by hand); the same
    batch again says nothing of it. Before, the change passed without a word; so did a
    resume at another data.seq_len, which now says so too."""
    base = ("tp_size=1", "dp_size=1", "checkpoint.every=1", "trainer.micro_batch=4")

    def cfg(steps: int, batch: int) -> Config:
        limits = (f"trainer.max_steps={steps}", f"trainer.global_batch={batch}")
        return run_config(corpus, tmp_path / "run", *base, *limits)

    first, wider, same = cfg(2, 8), cfg(3, 16), cfg(4, 16)
    shorter = dataclasses.replace(cfg(5, 16), data=dataclasses.replace(first.data, seq_len=8))
    histories = run_ranks(_run_all, 1, [first, wider, same, shorter], timeout=240)[0]
    assert [[s for s, _ in h] for h in histories] == [[1, 2], [3], [4], [5]]
    log = (tmp_path / "pretrain.log").read_text()  # run_config's run_dir: tmp_path
    note = "note: trainer.global_batch changed on resume"
    assert log.count(note) == 1, log[-2000:]
    assert (
        f"{note} (8 → 16 sequences a step): the data goes on from sample 16, and the "
        "learning-rate schedule's steps now each hold the new batch"
    ) in log, log[-2000:]
    # Another sequence length, from sample 16 + 2 × 16 = 48: said once, by the last resume.
    note = f"note: data.seq_len changed on resume ({first.data.seq_len} → 8 tokens a sequence)"
    assert log.count(note) == 1, log[-2000:]
    assert (
        f"{note}: the corpus is cut into other sequences in another shuffled order, read "
        "from sample 48 of it on"
    ) in log, log[-2000:]


def test_readme_resume_example_keeps_the_default_schedule():
    """The README's extend-a-run command (docs/CHECKPOINTS.md, one of the pages its commands
    live in) fixes optim.decay_steps at the length the default run used
    (trainer.max_steps - optim.warmup_steps), as the test above requires."""
    from tests.test_engine import compose_config
    from tests.test_readme import documented_text

    text = documented_text()
    command = re.search(r"\$ python -m engine\.pretrain (trainer\.max_steps=\d+ .*)", text)
    assert command, "the README and its pages lost the resume example"
    overrides = dict(o.split("=", 1) for o in command.group(1).split())
    default = compose_config()
    assert int(overrides["trainer.max_steps"]) > default.trainer.max_steps
    want = default.trainer.max_steps - default.optim.warmup_steps
    assert int(overrides["optim.decay_steps"]) == want, overrides
    assert math.isfinite(want)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_bad_steps=0", "trainer.max_bad_steps=0 must be >= 1"),
        (
            "trainer.collective_timeout_s=-1",
            "trainer.collective_timeout_s=-1.0 must be >= 0 and finite (0: off)",
        ),
        (
            "trainer.collective_startup_timeout_s=0",
            "trainer.collective_startup_timeout_s=0.0 must be > 0 and finite "
            "(null: 5 x trainer.collective_timeout_s)",
        ),
        (
            "trainer.collective_timeout_s=0 trainer.collective_startup_timeout_s=30",
            "trainer.collective_startup_timeout_s=30.0 does nothing with "
            "trainer.collective_timeout_s=0 (the watchdog is off)",
        ),
        (
            "trainer.rendezvous_timeout_s=0",
            "trainer.rendezvous_timeout_s=0.0 must be > 0 and finite",
        ),
    ],
)
def test_failure_settings_are_checked_before_any_worker(
    override, message, capsys, tmp_path, monkeypatch
):
    from engine.pretrain import prepare
    from tests.test_engine import compose_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        prepare(compose_config("tp_size=1", "dp_size=1", *override.split()))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment holds ``MESHTRON_TEST_TAG=tag``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and f"MESHTRON_TEST_TAG={tag}".encode() in env:
            found.append(int(proc.name))
    return found


def _a_worker_pid(tag: str) -> int | None:
    """A worker of the run whose processes hold ``MESHTRON_TEST_TAG=tag`` in their
    environment: a child of its forkserver (the self-launched ranks fork from one)."""
    tagged = {}
    for pid in _tagged_pids(tag):
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            ppid = int(next(x for x in status if x.startswith("PPid:")).split()[1])
            tagged[pid] = (ppid, Path(f"/proc/{pid}/cmdline").read_bytes())
        except (OSError, ValueError, StopIteration):
            continue
    servers = {pid for pid, (_, cmd) in tagged.items() if b"forkserver" in cmd}
    workers = [pid for pid, (ppid, _) in tagged.items() if ppid in servers]
    return max(workers) if workers else None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
def test_a_rank_killed_by_sigkill_is_reported_with_the_memory_hint(corpus, tmp_path):
    """A self-launched rank killed with SIGKILL (what the kernel's out-of-memory killer
    sends; the memory check before launch is a floor, so a run can still run out): the one
    line that ends the run names the signal and what to check and change."""
    tag = f"sigkill-{os.getpid()}-{time.monotonic_ns()}"
    env = {**subprocess_env(ROOT), "OMP_NUM_THREADS": "1", "MESHTRON_TEST_TAG": tag}
    cmd = [sys.executable, "-m", "engine.pretrain", f"hydra.run.dir={tmp_path / 'run'}"]
    cmd += [*run_overrides(corpus, tmp_path / "ckpt"), "tp_size=1", "dp_size=2"]
    cmd += ["trainer.max_steps=100000", "checkpoint.every=0", "trainer.max_restarts=0"]
    out = open(tmp_path / "out.txt", "w+")  # noqa: SIM115 - closed below
    # A session of its own: whatever happens below, the run's every process (launcher,
    # forkserver, ranks) is killed with it at the end, none left training.
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300  # a hang guard: imports are slow on busy cores
        while "step     3/" not in (tmp_path / "out.txt").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "no step 3"
            time.sleep(0.2)
        pid = _a_worker_pid(tag)
        assert pid is not None, "no worker process was found"
        os.kill(pid, signal.SIGKILL)
        err = proc.communicate(timeout=120)[1].decode()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        out.close()
    assert proc.returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert re.match(r"rank [01] died \(killed by SIGKILL\); no restart left", line), err
    assert line.endswith(
        "; SIGKILL is the out-of-memory killer's signal (dmesg says if it was): a smaller "
        "trainer.micro_batch or data.seq_len needs less memory"
    ), err


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_ranks_end_when_the_process_that_started_them_is_killed(corpus, tmp_path):
    """The self-launching process killed with SIGKILL (it can tell no rank to stop): every
    rank sees it gone within seconds and ends with one line naming it, where before they
    trained on, orphaned, for as long as trainer.max_steps allowed."""
    tag = f"orphans-{os.getpid()}-{time.monotonic_ns()}"
    env = {**subprocess_env(ROOT), "OMP_NUM_THREADS": "1", "MESHTRON_TEST_TAG": tag}
    cmd = [sys.executable, "-m", "engine.pretrain", f"hydra.run.dir={tmp_path / 'run'}"]
    cmd += [*run_overrides(corpus, tmp_path / "ckpt"), "tp_size=1", "dp_size=2"]
    cmd += ["trainer.max_steps=100000", "checkpoint.every=0", "trainer.max_restarts=0"]
    out, err = (open(tmp_path / n, "w+") for n in ("out.txt", "err.txt"))  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=out, stderr=err, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300  # a hang guard: imports are slow on busy cores
        while "step     3/" not in (tmp_path / "out.txt").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "no step 3"
            time.sleep(0.2)
        proc.kill()  # the launcher alone: its ranks are in other processes
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60  # the ranks look once a second
        while [p for p in _tagged_pids(tag) if p != os.getpid()]:
            assert time.monotonic() < deadline, "ranks still running a minute later"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out.close()
        err.close()
    text = (tmp_path / "err.txt").read_text()
    for rank in (0, 1):
        line = f"rank {rank} stopped: the process that started it (pid {proc.pid}) is gone"
        assert line in text, text[-2000:]
