"""Calibration probes of what summing single operations misses (CPU; needs torch).

The GEMM table, the element-wise bandwidth and the α-β fits time each piece alone. A
training step differs from their sum in three measured ways, each timed here on the
model's own work, not fitted to the validation points:

- ``compute_scale``: the real model's forward+backward (one rank, one thread, at each
  hidden size calibrated) over the model's price of the same micro-batch. Inside the model
  the operations interleave with each other, the allocator and the autograd engine.
- ``sync_excess``: p ranks that alternate one transformer layer's forward GEMMs with a
  blocking all-reduce of the layer's activations, as tensor parallelism does. A rank's
  time inside each all-reduce exceeds the same all-reduce run back to back (every rank
  released together by the previous one), because it waits for the slowest rank of that
  moment. The excess is stored
  as a fraction of the compute between collectives: TP communication at size p gains
  ``sync_excess[p]`` × the rank's compute.
- ``sp_pair``: gloo's reduce-scatter + all-gather of the layer's activations (the
  sequence-parallel pair) over the all-reduce of the same tensor, each timed back to
  back.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.perfmodel.cluster import cluster_from_dict
from engine.perfmodel.model import Layout, Workload, _compute_seconds, _gemm_shapes

BLOCK_S = 1.0  # one timed block of the real model's steps
SYNC_BLOCKS, SYNC_ROUNDS = 5, 40  # blocks of compute + all-reduce rounds per probe
SOLO_SAMPLES = 40  # back-to-back all-reduces (and SP pairs) timed per probe
CPU_LAYOUT = dict(fused_attention=False, threads=1)  # the trainer's CPU path (dropout 0.1)


def measure_compute_scale(w: Workload, micro_batch: int, spec: dict, repeats: int) -> float:
    """Measured forward+backward of the real model ÷ the model's compute price (tp = 1).

    Timed in ``repeats`` blocks of about BLOCK_S each (median), one thread. The GEMM probe
    taken around the blocks, against the one taken with the GEMM table (``probe_gflops``
    in ``spec``), removes the machine's drift between the two measurements.
    """
    from engine.models import build_model
    from engine.models.config import preset
    from engine.perfmodel.calibrate import probe_gflops

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = preset("gpt_tiny", hidden_size=w.hidden, num_layers=w.layers,
                     num_heads=w.heads, vocab_size=w.vocab, max_positions=w.seq)  # fmt: skip
        torch.manual_seed(0)
        model = build_model(cfg)
        tokens = torch.randint(0, w.vocab, (micro_batch, w.seq + 1))

        def step() -> None:
            model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
            model.zero_grad(set_to_none=True)

        step()
        t0 = time.perf_counter()
        step()
        calls = max(1, round(BLOCK_S / (time.perf_counter() - t0)))
        blocks, probes = [], [probe_gflops()]
        for _ in range(max(3, repeats)):
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            blocks.append((time.perf_counter() - t0) / calls)
        probes.append(probe_gflops())
    finally:
        torch.set_num_threads(before)
    lay = Layout(1, 1, micro_batch, **CPU_LAYOUT)
    predicted = _compute_seconds(w, lay, cluster_from_dict(spec), 1.0)["total"]
    drift = statistics.fmean(probes) / float(spec.get("probe_gflops") or statistics.fmean(probes))
    return statistics.median(blocks) * drift / predicted


def _layer_work(w: Workload, micro_batch: int, tp: int):
    """One transformer layer's forward GEMMs at this TP size (one thread)."""
    F = torch.nn.functional
    shapes = _gemm_shapes(w, Layout(tp, 1, micro_batch))[:-1]  # the LM head is not a layer's
    gemms = [(torch.randn(m, k), torch.randn(n, k)) for m, n, k, _ in shapes]

    def work() -> None:
        for a, b in gemms:
            F.linear(a, b)

    return work


def _sync_worker(rank, world, store_path, w, micro_batch, out) -> None:
    from layers.mappings import flat_all_gather, flat_reduce_scatter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)  # fmt: skip
    work = _layer_work(w, micro_batch, world)
    act = torch.ones(micro_batch * w.seq * w.hidden)
    shard = torch.empty(act.numel() // world)
    work()
    dist.all_reduce(act)
    # Tensor parallelism's rhythm: compute, then a blocking all-reduce that every rank
    # must reach. Per round: this rank's compute time and its time inside the collective.
    blocks = []
    for _ in range(SYNC_BLOCKS):
        rounds = []
        dist.barrier()
        for _ in range(SYNC_ROUNDS):
            t0 = time.perf_counter()
            work()
            t1 = time.perf_counter()
            dist.all_reduce(act)
            rounds.append((t1 - t0, time.perf_counter() - t1))
        blocks.append((statistics.median(r[0] for r in rounds),
                       statistics.median(r[1] for r in rounds)))  # fmt: skip
    # The collectives alone, back to back: each call releases every rank together, so the
    # next one starts in step (a barrier's exit is not: its skew would count as cost).
    single, pair = [], []
    dist.barrier()
    for _ in range(SOLO_SAMPLES):
        t0 = time.perf_counter()
        dist.all_reduce(act)
        single.append(time.perf_counter() - t0)
    dist.barrier()
    for _ in range(SOLO_SAMPLES):
        t0 = time.perf_counter()
        flat_reduce_scatter(shard, act)
        flat_all_gather(act, shard)
        pair.append(time.perf_counter() - t0)
    out.put((blocks, statistics.median(single), statistics.median(pair)))
    dist.destroy_process_group()


def measure_sync(w: Workload, micro_batch: int, ranks: list[int]) -> dict:
    """{"sync_excess": {p: fraction}, "sp_pair": {p: ratio}} over ``ranks`` gloo groups.

    sync_excess[p]: (time inside the collective in the rhythm − the same collective back
    to back) ÷ the compute time between collectives, both as the ranks
    ran them (per-rank medians over a block's rounds, the mean over ranks, and the median
    over blocks).
    """
    excess, pair_ratio = {}, {}
    ctx = mp.get_context("spawn")
    for p in sorted(r for r in ranks if r > 1):
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            args = (p, os.path.join(tmp, "store"), w, micro_batch, queue)
            procs = [ctx.Process(target=_sync_worker, args=(r, *args)) for r in range(p)]
            for proc in procs:
                proc.start()
            try:
                results = [queue.get(timeout=300) for _ in procs]
            finally:
                for proc in procs:
                    proc.join(timeout=30)
                    if proc.is_alive():  # a rank that died leaves the others waiting
                        proc.kill()
        single = statistics.fmean(r[1] for r in results)
        per_block = []
        for block in zip(*(r[0] for r in results), strict=True):  # one block, every rank
            work = statistics.fmean(b[0] for b in block)
            inside = statistics.fmean(b[1] for b in block)
            per_block.append(max(0.0, inside - single) / work)
        # The median block: one block caught by a burst of other load does not decide it.
        excess[p] = round(statistics.median(per_block), 4)
        pair_ratio[p] = round(statistics.fmean(r[2] for r in results) / single, 3)
    return {"sync_excess": excess, "sp_pair": pair_ratio}
