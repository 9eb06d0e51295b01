"""How fast one rank computes when several ranks share this CPU (calibration; needs torch).

The GEMM table and element-wise bandwidths are measured by one process on one thread. A
training run with p ranks runs p such processes at once, and on a small or shared machine
each gets less than a core: the cores may be fewer than the ranks, vCPUs may share a
physical core, the ranks share the memory bandwidth and the last-level cache, and other
users' processes take their turn. No hardware formula predicts that, so it is measured:
the same piece of the model's own work (one micro-batch's forward GEMMs and its element-wise
forward + backward, one thread) is timed alone, then in p processes started together, and

    speed(p) = time alone ÷ time until the last of the p processes is done

(the last one: a synchronous step waits for its slowest rank). The model multiplies a
rank's compute throughput by speed(p) (``device.rank_speed`` in the cluster YAML).
"""

from __future__ import annotations

import statistics
import time

import torch

from studies.perfmodel.model import Layout, Workload, gemm_shapes
from studies.perfmodel.probes import worker_context

TARGET_S = 2.0  # one timed block alone: 0.3 s blocks read 0.93 at p = 2 where training
# sustains ~0.5 (a burst allowance of the virtual CPUs); 1.5 s blocks read 0.56


def _make_work(w: Workload, micro_batch: int):
    """A callable doing one micro-batch's forward GEMMs and element-wise work (tp = 1)."""
    F = torch.nn.functional
    gemms = [
        (torch.randn(m, k), torch.randn(n, k))
        for m, n, k, _ in gemm_shapes(w, Layout(1, 1, micro_batch))
    ]
    tokens = micro_batch * w.seq
    x = torch.randn(tokens, w.hidden, requires_grad=True)
    hid = torch.randn(tokens, w.ffn_size, requires_grad=True)

    def work() -> None:
        for a, b in gemms:
            F.linear(a, b)
        y = F.dropout(F.layer_norm(x, (w.hidden,)), 0.1) + x
        z = F.gelu(hid, approximate="tanh")
        (y.sum() + z.sum()).backward()

    return work


def _timed_blocks(work, calls: int, repeats: int, barrier=None) -> list[float]:
    """Seconds of ``repeats`` blocks of ``calls`` calls (after a barrier when given)."""
    times = []
    for _ in range(repeats):
        if barrier is not None:
            barrier.wait()
        t0 = time.perf_counter()
        for _ in range(calls):
            work()
        times.append(time.perf_counter() - t0)
    return times


def _worker(w: Workload, micro_batch: int, calls: int, repeats: int, barrier, out) -> None:
    torch.set_num_threads(1)
    work = _make_work(w, micro_batch)
    work()
    out.put(_timed_blocks(work, calls, repeats, barrier))


def measure_rank_speed(
    w: Workload, micro_batch: int, ranks: list[int], repeats: int = 3, block_s: float = TARGET_S
) -> dict[int, float]:
    """speed(p) for every p in ``ranks`` (1.0 at p = 1 by definition), one thread per rank;
    ``block_s``: seconds of one timed block alone (shorter blocks read a burst figure, see
    TARGET_S; the CI test, which reads no speed, uses them to save the cores' time)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = _make_work(w, micro_batch)
        work()
        one_call = min(_timed_blocks(work, 1, 3))
        calls = max(1, round(block_s / one_call))
        alone = statistics.median(_timed_blocks(work, calls, repeats))
    finally:
        torch.set_num_threads(before)
    ctx = worker_context(__name__)
    speeds = {1: 1.0}
    for p in sorted(r for r in ranks if r > 1):
        barrier, out = ctx.Barrier(p), ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(w, micro_batch, calls, repeats, barrier, out))
            for _ in range(p)
        ]
        for proc in procs:
            proc.start()
        try:
            blocks = [out.get(timeout=300) for _ in procs]
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():  # a worker that died leaves the others at the barrier
                    proc.kill()
        slowest = [max(block) for block in zip(*blocks, strict=True)]
        speeds[p] = round(alone / statistics.median(slowest), 4)
    return speeds
