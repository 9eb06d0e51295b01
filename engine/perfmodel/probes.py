"""Calibration probe of what summing single operations misses (CPU; needs torch).

The GEMM table and the element-wise bandwidth time each piece alone. ``compute_scale`` is
the real model's forward+backward (one rank, one thread, at each hidden size calibrated)
over the model's price of the same micro-batch: inside the model the operations
interleave with each other, the allocator and the autograd engine. It is timed on the
model's own work, not fitted to the validation points.

Two more probes were tried and dropped (docs/PERFMODEL.md, "Calibration probes"): the
wait of synchronised TP ranks and gloo's sequence-parallel pair over its all-reduce. Their
repeated calibrations disagreed by more than 2x, so they measured no stable property.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.perfmodel.cluster import cluster_from_dict
from engine.perfmodel.model import Layout, Workload, _compute_seconds

BLOCK_S = 1.0  # one timed block of the real model's steps
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
