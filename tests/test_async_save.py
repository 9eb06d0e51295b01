"""Asynchronous checkpoint saves (``checkpoint.async_save=true``): training goes on while
the save writes; atomic publish and integrity as the synchronous save's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import parallel_state
from engine.checkpoint import CheckpointError, ShardReader, load_checkpoint, save_checkpoint
from engine.checkpoint.background import BackgroundSaver
from engine.checkpoint.manager import stage_checkpoint
from engine.checkpoint.storage import read_latest
from parallel_state.groups import side_group
from tests.multiproc import run_ranks
from tests.test_checkpoint import (  # noqa: F401 - corpus is a fixture
    POINTS,
    SimulatedCrash,
    _model_and_optimizer,
    _train_step,
    corpus,
    run_config,
)


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    reader = ShardReader(step_dir)
    return {n: reader.read(n) for n in reader.specs if not n.startswith("rng/")}


def _stage(root, step, model, optimizer, ps=None, fault=None, group=None):
    return stage_checkpoint(
        root,
        step,
        model=model,
        optimizer=optimizer,
        ps=ps,
        state={},
        fault=fault,
        copy=True,
        group=group,
    )


def test_the_saved_state_is_the_staged_snapshot_while_training_goes_on(tmp_path):
    """Training steps taken while the writer is held mid-write do not reach the checkpoint:
    it holds exactly what a synchronous save at staging time writes."""
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, 1)
    save_checkpoint(tmp_path / "sync", 1, model=model, optimizer=optimizer, ps=None, state={})
    hold, reached = threading.Event(), threading.Event()

    def fault(point: str) -> None:
        if point == "after_shard":
            reached.set()
            hold.wait(30)

    saver = BackgroundSaver()
    saver.submit(1, _stage(tmp_path / "async", 1, model, optimizer, fault=fault))
    assert reached.wait(30)
    for seed in (2, 3):  # the parameters and moments change under the writer
        _train_step(model, optimizer, seed)
    assert read_latest(tmp_path / "async") is None  # not published before the write ends
    hold.set()
    path, _ = saver.wait()
    assert read_latest(tmp_path / "async") == 1
    want = _tensors(tmp_path / "sync" / "step_00000001")
    got = _tensors(path)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("point", POINTS)
def test_a_writer_that_fails_publishes_nothing(tmp_path, point):
    """A failure anywhere in the background write is raised at the wait, and the previous
    checkpoint is the one that loads (the failed step is neither listed nor loaded)."""
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, 1)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, ps=None, state={})
    good = model.full_state_dict()
    _train_step(model, optimizer, 2)

    def fault(at: str) -> None:
        if at == point:
            raise SimulatedCrash(at)

    saver = BackgroundSaver()
    saver.submit(2, _stage(tmp_path, 2, model, optimizer, fault=fault))
    with pytest.raises(CheckpointError, match="SimulatedCrash"):
        saver.wait()
    assert read_latest(tmp_path) == 1
    fresh, fresh_opt = _model_and_optimizer(seed=7)
    loaded = load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, ps=None, log=print)
    assert loaded.step == 1
    params = fresh.full_state_dict()
    assert all(torch.equal(params[k], good[k]) for k in good)


def _killed_mid_write(root: str, point: str) -> None:
    """Save step 1, then step 2 in the background while training goes on; the process
    dies (exit 9, as a killed job does) when the writer reaches ``point``."""
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, 1)
    save_checkpoint(root, 1, model=model, optimizer=optimizer, ps=None, state={})
    _train_step(model, optimizer, 2)

    def fault(at: str) -> None:
        if at == point:
            os._exit(9)  # the process dies here, mid-write

    saver = BackgroundSaver()
    saver.submit(2, _stage(root, 2, model, optimizer, fault=fault))
    for seed in range(3, 100):  # training goes on until the writer kills the process
        _train_step(model, optimizer, seed)
    saver.wait()


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_a_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, point):
    """The process dies inside the background write (at each point of the commit): what it
    leaves is never loaded; step 1 is. The process comes from the forkserver that
    tests.multiproc preloads with torch (a fresh interpreter paid ~3 s of imports a point)."""
    process = mp.get_context("forkserver").Process(
        target=_killed_mid_write, args=(str(tmp_path), point)
    )
    process.start()
    process.join(120)
    assert process.exitcode == 9, process.exitcode
    model, optimizer = _model_and_optimizer(seed=7)
    loaded = load_checkpoint(tmp_path, model=model, optimizer=optimizer, ps=None, log=print)
    assert loaded.step == 1 and read_latest(tmp_path) == 1


def test_one_save_in_flight(tmp_path):
    """A second save waits for the first to be written and committed before it starts."""
    model, optimizer = _model_and_optimizer()
    hold, order = threading.Event(), []

    def slow(point: str) -> None:
        if point == "before_latest":
            hold.wait(30)
            order.append(1)

    saver = BackgroundSaver()
    saver.submit(1, _stage(tmp_path, 1, model, optimizer, fault=slow))
    _train_step(model, optimizer, 2)
    second = _stage(
        tmp_path, 2, model, optimizer, fault=lambda p: p == "after_shard" and order.append(2)
    )
    submitter = threading.Thread(target=saver.submit, args=(2, second))
    submitter.start()
    time.sleep(0.3)
    assert submitter.is_alive() and order == []  # waiting for step 1
    hold.set()
    submitter.join(30)
    saver.wait()
    assert order == [1, 2] and read_latest(tmp_path) == 2


def _two_ranks(root: str) -> dict:
    """tp=2: the writers agree over a gloo group of their own while the training thread
    runs collectives (the TP all-reduces of training steps) on the world's."""
    ps = parallel_state.initialize(2, 1)
    group = side_group(2)
    model, optimizer = _model_and_optimizer(ps.tp_group)
    _train_step(model, optimizer, 1)
    snapshot = model.full_state_dict()
    saver = BackgroundSaver()
    saver.submit(1, _stage(root, 1, model, optimizer, ps=ps, group=group))
    for seed in (2, 3, 4):
        _train_step(model, optimizer, seed)
    saver.wait()
    fresh, fresh_opt = _model_and_optimizer(ps.tp_group, seed=9)
    loaded = load_checkpoint(root, model=fresh, optimizer=fresh_opt, ps=ps, log=print)
    params = fresh.full_state_dict()
    return {"step": loaded.step, "equal": all(torch.equal(params[k], snapshot[k]) for k in params)}


@pytest.mark.slow
def test_two_ranks_write_in_the_background(tmp_path):
    out = run_ranks(_two_ranks, 2, str(tmp_path / "ckpt"), timeout=180)
    assert all(r == {"step": 1, "equal": True} for r in out), out


@pytest.mark.slow
def test_async_run_writes_what_the_sync_run_writes(corpus, tmp_path, capsys):  # noqa: F811
    """engine.pretrain with checkpoint.async_save=true: every kept checkpoint bitwise the
    synchronous run's, each save said once written, and the run waits for the last."""
    from engine.worker import run_worker

    common = ("tp_size=1", "dp_size=1", "trainer.max_steps=6", "checkpoint.every=2")
    run_worker(run_config(corpus, tmp_path / "sync" / "ck", *common))
    capsys.readouterr()
    run_worker(run_config(corpus, tmp_path / "async" / "ck", *common, "checkpoint.async_save=true"))
    out = capsys.readouterr().out
    assert out.count("in the background") == 3, out
    for step in ("step_00000004", "step_00000006"):
        want = _tensors(tmp_path / "sync" / "ck" / step)
        got = _tensors(tmp_path / "async" / "ck" / step)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert read_latest(tmp_path / "async" / "ck") == 6
