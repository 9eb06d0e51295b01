"""Calibration probes of what summing single operations misses (CPU; needs torch).

The GEMM table, the element-wise bandwidth and the α-β fits time each piece alone. A
training step differs from their sum in three measured ways, each timed here on the
model's own work, not fitted to the validation points:

- ``compute_scale``: the real model's forward+backward (one rank, one thread, the
  calibration's shapes) over the model's price of the same micro-batch. Inside the model
  the operations interleave with each other, the allocator and the autograd engine.
- ``sync_excess``: p ranks that alternate one transformer layer's forward GEMMs with a
  blocking all-reduce of the layer's activations, as tensor parallelism does. Each
  iteration takes longer than the work alone at the sustained rank speed plus the
  all-reduce's α-β price, because every collective waits for the slowest rank of that
  moment. The excess is stored as a fraction of the work: a rank synchronised p-ways
  computes ``1 + sync_excess[p]`` times as long.
- ``sp_pair``: gloo's all-gather + reduce-scatter of the layer's activations (the
  sequence-parallel pair) over the all-reduce of the same tensor, timed side by side.
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
from engine.perfmodel.comm import all_reduce as price_all_reduce
from engine.perfmodel.model import Layout, Workload, _compute_seconds, _gemm_shapes

SYNC_ITERATIONS = 40  # synchronised work + all-reduce rounds timed per probe
CPU_LAYOUT = dict(fused_attention=False, threads=1)  # the trainer's CPU path (dropout 0.1)


def measure_compute_scale(w: Workload, micro_batch: int, spec: dict, repeats: int) -> float:
    """Measured forward+backward of the real model ÷ the model's compute price (tp = 1)."""
    from engine.models import build_model
    from engine.models.config import preset

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
        times = []
        for _ in range(max(3, repeats)):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    lay = Layout(1, 1, micro_batch, **CPU_LAYOUT)
    predicted = _compute_seconds(w, lay, cluster_from_dict(spec), 1.0)["total"]
    return statistics.median(times) / predicted


def _layer_work(w: Workload, micro_batch: int, tp: int):
    """One transformer layer's forward GEMMs at this TP size (one thread)."""
    F = torch.nn.functional
    shapes = _gemm_shapes(w, Layout(tp, 1, micro_batch))[:-1]  # the LM head is not a layer's
    per_layer = [(m, n, k) for m, n, k, _ in shapes]
    gemms = [(torch.randn(m, k), torch.randn(n, k)) for m, n, k in per_layer]

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
    alone = []
    for _ in range(5):
        t0 = time.perf_counter()
        work()
        alone.append(time.perf_counter() - t0)
    rounds = []
    dist.barrier()
    for _ in range(SYNC_ITERATIONS):
        t0 = time.perf_counter()
        work()
        dist.all_reduce(act)
        rounds.append(time.perf_counter() - t0)
    pair, single = [], []
    for _ in range(10):
        dist.barrier()
        t0 = time.perf_counter()
        flat_reduce_scatter(shard, act)
        flat_all_gather(act, shard)
        t1 = time.perf_counter()
        dist.all_reduce(act)
        pair.append(t1 - t0)
        single.append(time.perf_counter() - t1)
    out.put((rank, statistics.median(alone), rounds, statistics.median(pair),
             statistics.median(single)))  # fmt: skip
    dist.destroy_process_group()


def measure_sync(w: Workload, micro_batch: int, ranks: list[int], spec: dict) -> dict:
    """{"sync_excess": {p: fraction}, "sp_pair": {p: ratio}} over ``ranks`` gloo groups."""
    cluster = cluster_from_dict(spec)
    speeds = spec["device"].get("rank_speed") or {}
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
        alone = statistics.median(r[1] for r in results)
        # An iteration ends for everyone when the slowest rank's all-reduce does.
        slowest = [max(its) for its in zip(*(r[2] for r in results), strict=True)]
        link = cluster.intra_by_ranks.get(p, cluster.intra)
        n_bytes = micro_batch * w.seq * w.hidden * 4
        expected = alone / float(speeds.get(p, 1.0)) + price_all_reduce(
            n_bytes, p, link, cluster.collectives
        )
        excess[p] = round(max(0.0, statistics.median(slowest) - expected) / alone, 4)
        pair_ratio[p] = round(
            statistics.median(r[3] for r in results) / statistics.median(r[4] for r in results), 3
        )
    return {"sync_excess": excess, "sp_pair": pair_ratio}
