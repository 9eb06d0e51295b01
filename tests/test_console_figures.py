"""The figures a training console prints say what they measure and add up (issue 45)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from rich.console import Console

import engine.observe as observe
from engine.step_timer import StepTimer, breakdown_metrics, format_breakdown


def _step(timer: StepTimer) -> dict:
    timer.start()
    for _ in range(4):  # data, forward+backward, dp wait, optimizer
        timer.lap()
    return timer.finish()


def test_dp_size_1_has_no_dp_communication():
    """At dp 1 nothing is reduced: both DP figures are exactly 0 (the phase between
    backward and the optimizer is bookkeeping, counted as optimizer), and the parts still
    add up to the step."""
    record = _step(StepTimer(torch.device("cpu"), dp_size=1))
    assert record["dp_comm_exposed_s"] == 0.0 and record["dp_comm_total_s"] == 0.0
    parts = ("data_s", "compute_s", "tp_comm_s", "dp_comm_exposed_s", "optimizer_s")
    # Sums of the same perf_counter differences: equal up to float rounding.
    assert sum(record[k] for k in parts) == pytest.approx(record["step_time_s"], abs=1e-9)


def test_pipeline_wait_is_not_compute_and_the_shares_add_up():
    """A pipelined step whose stages waited 4.47 × their compute: compute is the stages'
    own work, pp_wait its own share, and the printed shares sum to 100 %."""
    record = {
        "data_s": 0.0,
        "compute_s": 5.47,  # forward+backward − TP: own work 1.0 plus the 4.47 s wait
        "tp_comm_s": 0.0,
        "dp_comm_exposed_s": 0.0,
        "optimizer_s": 0.0,
        "pp_wait_s": 4.47,
        "pp_bubble_ratio": 4.47,
    }
    metrics = breakdown_metrics([record])
    assert metrics["time/compute_s"] == pytest.approx(1.0)
    line = format_breakdown(metrics)
    assert "compute 18%" in line and "pp_wait 82%" in line, line
    shares = [int(w[:-1]) for w in line.split() if w.endswith("%")]
    assert sum(shares) == 100, line


def test_shares_that_each_round_up_still_print_100_percent():
    """0.6 % + 96.8 % + 2.6 %: each rounded alone they print 1% + 97% + 3% = 101% (a
    quick start line did); the printed shares sum to 100, each within a point of its own."""
    metrics = {"time/data_s": 0.006, "time/compute_s": 0.968, "time/optimizer_s": 0.026}
    line = format_breakdown(metrics)
    words = line.split()
    shares = {w: int(p[:-1]) for w, p in itertools.pairwise(words) if p.endswith("%")}
    assert sum(shares.values()) == 100, line
    exact = {"data": 0.6, "compute": 96.8, "optim": 2.6}
    assert all(abs(shares[k] - v) < 1 for k, v in exact.items()), line
    # A part a clock rounded below zero is 0 %, and the others still sum to 100.
    line = format_breakdown({"time/data_s": -0.01, "time/compute_s": 0.5, "time/optimizer_s": 0.5})
    assert line == "  time: data 0% compute 50% optim 50%", line


def test_progress_bar_names_the_loss_it_shows(tmp_path, monkeypatch):
    """The bar's loss is this step's on rank 0's batches, not the logged mean over ranks
    and steps: its label says so."""

    class Screen(Console):
        def __init__(self, *args, force_terminal=None, **kwargs):
            super().__init__(*args, force_terminal=True, **kwargs)

    monkeypatch.setattr(observe, "Console", Screen)
    logger = observe.RunLogger(
        enabled=True,
        run_dir=str(tmp_path),
        max_steps=3,
        tensorboard=None,
        wandb_project=None,
        config={},
        progress=True,
    )
    try:
        logger.advance(1, 8.25)
        status = logger.progress.tasks[0].fields["status"]
    finally:
        logger.close()
    assert status == "step loss 8.250 (rank 0's batches)"


def test_dp_exposed_is_never_more_than_the_dp_communication():
    """A DP wait longer than its collectives (the bucket's reduction done, then 20 ms of
    gradient bookkeeping before the optimizer): exposed communication is at most the
    communication there was, the rest of the wait counts as optimizer, and the parts still
    add up to the step. Before, the whole wait was 'exposed' and exceeded the DP total (a
    quick start's metrics file: exposed 12.6 ms, total 12.1 ms)."""

    class Work:  # an asynchronous collective whose completion the test sets
        def __init__(self) -> None:
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

    timer = StepTimer(torch.device("cpu"), dp_size=2)
    timer.start()
    timer.lap()  # data
    timer.lap()  # forward and backward
    work = Work()
    timer.dp.launched(work)
    work.future.set_result(None)  # the reduction is done: its span ends here
    time.sleep(0.02)  # bookkeeping, still before the optimizer
    timer.lap()  # the DP wait
    timer.lap()  # optimizer
    record = timer.finish()
    assert record["dp_comm_exposed_s"] <= record["dp_comm_total_s"], record
    assert record["optimizer_s"] >= 0.02, record
    parts = ("data_s", "compute_s", "tp_comm_s", "dp_comm_exposed_s", "optimizer_s")
    # Sums of the same perf_counter differences: equal up to float rounding.
    assert sum(record[k] for k in parts) == pytest.approx(record["step_time_s"], abs=1e-9)


def test_without_a_dp_clock_the_dp_figures_are_none_timed_or_not():
    """A DP strategy whose collectives the timer cannot see (FSDP's run in its own hooks):
    with collective timing on or off, no DP figure is reported (the step line then says
    dp_comm n/a), the 10 ms wait after backward counts as optimizer, and the parts still
    add up to the step. With timing off it was reported as exposed DP communication."""

    class Untimed:  # FSDP's side of the interface the timer reads
        times_comm = False

        def set_comm_timer(self, timer) -> None:
            pass

    for enabled in (True, False):
        timer = StepTimer(torch.device("cpu"), enabled=enabled, dp_size=2)
        timer.attach(torch.nn.Linear(1, 1), Untimed())
        timer.start()
        timer.lap()  # data
        timer.lap()  # forward and backward
        time.sleep(0.01)  # the wait after backward
        timer.lap()
        timer.lap()  # optimizer
        record = timer.finish()
        assert record["dp_comm_exposed_s"] is None and record["dp_comm_total_s"] is None
        assert record["optimizer_s"] >= 0.01, (enabled, record)
        parts = ("data_s", "compute_s", "tp_comm_s", "optimizer_s")
        total = sum(record[k] or 0.0 for k in parts)
        assert total == pytest.approx(record["step_time_s"], abs=1e-9), (enabled, record)
