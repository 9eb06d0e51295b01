"""Runs that go wrong: bad steps, lost ``latest``, frozen and killed peers, pruning, and the
run-level promises around them (validation at any dp, extending a run, the run log).

The failure cases run ``python -m engine.pretrain`` as real processes (cwd and every
output in tmp_path), the way a user or a launcher would.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint.storage import read_latest, step_dirs, verify_complete, write_latest
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
    return [*run_overrides(corpus, ckpt), "tp_size=1", "dp_size=1", "checkpoint.every=2",
            "trainer.precision=fp32", "checkpoint.save_final=true", *extra]  # fmt: skip


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
    """lr=1e10 from the good step-4 checkpoint: step 5 blows the weights up, steps 6.. are
    NaN. Each is skipped with a line; 3 in a row stop the run (exit 3, one line on
    stderr); no checkpoint is written during the streak, so steps 2 and 4 survive intact
    (not pruned) and ``final`` is not overwritten with broken weights."""
    ckpt = _copy(good_run, tmp_path)
    final_before = (ckpt / "final" / "model.safetensors").read_bytes()
    proc = pretrain(tmp_path, *single(corpus, ckpt, "trainer.max_steps=30", "optim.lr=1e10",
                                      "optim.min_lr=0", "trainer.max_bad_steps=3"))  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = _stderr_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("stopped at step 8: 3 bad steps in a row"), lines
    # 1e10-sized weights overflow fp32 within two layers: inf, then NaN after a norm.
    assert re.search(r"step 6: non-finite loss (nan|inf) or gradient norm (nan|inf): step "
                     "skipped", proc.stdout), proc.stdout[-2000:]  # fmt: skip
    assert "not saving step 6" in proc.stdout
    assert sorted(step_dirs(ckpt)) == [2, 4] and read_latest(ckpt) == 4
    for step in (2, 4):
        path = ckpt / f"step_{step:08d}"
        assert verify_complete(path) is None
        assert all(torch.isfinite(t.float()).all() for t in _all_tensors(path).values())
    assert (ckpt / "final" / "model.safetensors").read_bytes() == final_before
    assert "Traceback" in (tmp_path / "run" / "pretrain.log").read_text()  # kept off the console


def _fp16_forever(cfg: Config) -> dict:
    from engine.trainer import run_worker

    return run_worker(cfg)


def test_fp16_scaler_skipping_forever_hits_max_bad_steps(corpus, tmp_path):
    """A loss scale of 1e38 overflows every step (the scaled loss alone is near fp32's max);
    the scaler halves it and skips, which took 120 steps to recover from and would never
    end for a model that overflows at any scale. 3 overflow steps in a row stop it."""
    cfg = run_config(corpus, tmp_path / "ckpt", "tp_size=1", "dp_size=1", "trainer.max_steps=20",
                     "trainer.precision=fp16", "trainer.loss_scale_init=1e38",
                     "trainer.max_bad_steps=3")  # fmt: skip
    with pytest.raises(RankFailure, match="stopped at step 3: 3 bad steps in a row, the last one "
                       "with the fp16 loss scale overflowed"):  # fmt: skip
        run_ranks(_fp16_forever, 1, cfg, timeout=120)
    assert not step_dirs(tmp_path / "ckpt")


# ------------------------------------------------------------ lost latest and pruning


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
        save_checkpoint(root, step, model=model, optimizer=optimizer, ps=None, state={},
                        keep=100)  # fmt: skip
    return model, optimizer


def _load_and_save(root: Path, step: int) -> tuple[int, list[str]]:
    messages: list[str] = []
    model, optimizer = _model_and_optimizer(seed=9)
    loaded = load_checkpoint(root, model=model, optimizer=optimizer, ps=None, log=messages.append)
    save_checkpoint(root, step, model=model, optimizer=optimizer, ps=None, state={}, keep=2,
                    log=messages.append)  # fmt: skip
    return loaded.step, messages


def test_damaged_checkpoint_is_removed_with_its_reason_and_named_plainly(tmp_path):
    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2, 5])
    damaged = root / "step_00000005" / "rank00000.safetensors"
    _flip_bit(damaged)
    loaded, messages = _load_and_save(root, 3)
    assert loaded == 2
    assert messages[0].startswith(f"checkpoint {root / 'step_00000005'} is unusable ({damaged} "
                                  "is damaged: SHA-256"), messages  # fmt: skip
    assert "rank 0:" not in messages[0]  # the file is named, not a rank that did not own it
    assert messages[1:] == [
        f"pruned {root / 'step_00000001'}: older than the 2 newest kept (checkpoint.keep=2)",
        f"removed {root / 'step_00000005'}: newer than step 3 and not usable ({damaged} is "
        "damaged: SHA-256 does not match the index)",
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
    assert messages == [f"pruned {root / 'step_00000001'}: older than the 2 newest kept "
                        "(checkpoint.keep=2)"], messages  # fmt: skip


# ----------------------------------------------------------------- frozen / killed peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One line per surviving rank: the watchdog's (no progress), or a collective's failure
# (a peer's connection closed), each naming the step, the rank and the group.
_PEER_LINE = re.compile(
    r"rank (\d) (stopped: no progress for 8 s in|lost a peer in) the [\w/ -]+ of step \d+, "
    r"waiting on its (tp|dp|world) group \(ranks \[[\d, ]+\]\)"
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_frozen_or_killed_rank_stops_the_others_with_one_line(corpus, tmp_path, sig):
    """4 ranks started by environment (as srun or mpirun start them), tp=2 × dp=2. One
    rank is frozen (SIGSTOP) or killed (SIGKILL) mid-run; the other three must exit
    non-zero within 60 s (collective_timeout_s=8 plus start-up slack on a loaded
    machine), each with one stderr line naming the step, its rank and the group it
    waited on. Before, they waited forever (SIGSTOP) or printed an 85-line traceback."""
    env = {**subprocess_env(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "4"}  # fmt: skip
    overrides = [f"hydra.run.dir={tmp_path / 'run'}", *run_overrides(corpus, tmp_path / "ckpt"),
                 "tp_size=2", "dp_size=2", "trainer.max_steps=100000", "checkpoint.every=0",
                 "trainer.collective_timeout_s=8"]  # fmt: skip
    procs, outs = [], []
    try:
        for rank in range(4):
            out = open(tmp_path / f"rank{rank}.out", "w+")  # noqa: SIM115 - closed below
            err = open(tmp_path / f"rank{rank}.err", "w+")  # noqa: SIM115
            outs += [out, err]
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "engine.pretrain", *overrides], cwd=tmp_path,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=out, stderr=err,
            ))  # fmt: skip
        deadline = time.monotonic() + 120
        while "step     3/" not in (tmp_path / "rank0.out").read_text():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise AssertionError([(tmp_path / f"rank{r}.err").read_text() for r in range(4)])
            time.sleep(0.2)
        victim = 3
        os.kill(procs[victim].pid, getattr(signal, sig))
        stopped = time.monotonic()
        for rank in (0, 1, 2):
            code = procs[rank].wait(timeout=max(1.0, stopped + 60 - time.monotonic()))
            assert code != 0, rank
        print(f"{sig}: the other ranks exited {time.monotonic() - stopped:.1f} s later")
        errs = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(4)}
        for rank in (0, 1, 2):
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
            seqs = torch.stack([torch.as_tensor(data[j * t.micro_batch + i]).long()
                                for i in range(t.micro_batch)])  # fmt: skip
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
        cfg = run_config(corpus, tmp_path / f"ckpt{dp}", "tp_size=1", f"dp_size={dp}",
                         "trainer.global_batch=8", "trainer.eval_batches=4",
                         "model.hidden_dropout=0.0", "model.attention_dropout=0.0")  # fmt: skip
        results[dp] = run_ranks(_valid_loss, dp, cfg, timeout=120)[0]
    base, reference = results[1]
    assert abs(base - reference) <= 1e-5 * reference, (base, reference)
    for dp in (2, 4):
        assert abs(results[dp][0] - base) <= 1e-9 * base, results


def _run_all(cfgs: list[Config]) -> list:
    from engine.trainer import run_worker

    return [run_worker(cfg).get("history") for cfg in cfgs]


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
    h_first, h_again, h_whole, _ = run_ranks(_run_all, 1, [first, again, whole, unset],
                                             timeout=240)[0]  # fmt: skip
    assert [s for s, _ in h_again] == [5, 6]  # it resumed from step 4
    assert h_first + h_again == h_whole  # losses bit for bit
    a = _all_tensors(tmp_path / "split" / "step_00000006")
    b = _all_tensors(tmp_path / "whole" / "step_00000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = (tmp_path / "pretrain.log").read_text()  # run_config's run_dir: tmp_path
    assert ("note: the learning-rate schedule changed on resume (cosine decay over 3 steps "
            "after warmup, now 5: trainer.max_steps moved its end); to continue the saved "
            "schedule pass optim.decay_steps=3") in log, log[-2000:]  # fmt: skip


def test_readme_resume_example_keeps_the_default_schedule():
    """The README's extend-a-run command fixes optim.decay_steps at the length the default
    run used (trainer.max_steps - optim.warmup_steps), as the test above requires."""
    from tests.test_engine import compose_config

    text = (ROOT / "README.md").read_text()
    command = re.search(r"\$ python -m engine\.pretrain (trainer\.max_steps=\d+ .*)", text)
    assert command, "README lost its resume example"
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
        ("trainer.collective_timeout_s=-1", "trainer.collective_timeout_s=-1.0 >= 0 (0: off)"),
    ],
)
def test_failure_settings_are_checked_before_any_worker(override, message, capsys, tmp_path,
                                                        monkeypatch):  # fmt: skip
    from engine.pretrain import prepare
    from tests.test_engine import compose_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        prepare(compose_config("tp_size=1", "dp_size=1", override))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
