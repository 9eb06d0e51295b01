"""Timing probes shared by calibration and validation: a median wall time, and the GEMM
probe that measures how much of a core this process gets on a shared machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def median_seconds(fn: Callable[[], object], repeats: int, min_time: float = 0.02) -> float:
    """Median wall time of ``fn`` over ``repeats`` blocks, each at least ``min_time`` long."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time:
        fn()
        calls += 1
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(max(1, calls)):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / max(1, calls))
    return statistics.median(times)


def worker_context(*modules: str):
    """The multiprocessing context of the calibration's worker processes: a forkserver that
    has imported torch and ``modules`` (the workers' own) once, so each worker starts by a
    fork instead of paying a fresh ``import torch`` (a CPU second or more each, on the
    cores the measurement shares); spawn where there is no forkserver. Either way a worker
    is a process of its own that sets its own threads before it measures anything."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *modules])
    return ctx


def probe_gflops(seconds: float = 0.5) -> float:
    """GFLOP/s of a 256³ fp32 GEMM on one thread now: how much of a core this process gets.

    Taken at calibration and next to every measured run, so a prediction can be rescaled
    by the share of the (shared) machine the run actually had.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        return 2 * 256**3 / median_seconds(lambda: a @ b, 5, seconds / 5) / 1e9
    finally:
        torch.set_num_threads(before)
