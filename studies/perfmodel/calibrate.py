"""Measure what the performance model needs on this machine's CPU ranks (needs torch).

- GEMM throughput for the model's own shapes (one thread; what a second thread adds);
- streaming bandwidth (an out-of-place add), the model's element-wise bandwidth and host
  time per autograd operator;
- all-reduce and all-gather time per group size and message size over gloo processes,
  fitted to α + β·bytes;
- short trainer runs (studies/perfmodel/in_model.py): compute scale, TP, DP-wait and
  optimizer terms as training sees them.

Not on GPUs yet (bf16 GEMMs, NCCL): their specs come from datasheets and published runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import yaml

from engine.tool_args import ArgumentParser, int_list, positive_int
from studies.perfmodel import in_model_runs
from studies.perfmodel.concurrency import TARGET_S, measure_rank_speed
from studies.perfmodel.model import (
    Layout,
    Workload,
    elementwise_bytes,
    gemm_shapes,
    score_bytes,
)
from studies.perfmodel.probes import median_seconds, probe_gflops, worker_context


def modelgemm_shapes(w: Workload, tps: list[int], micro_batches: list[int]) -> tuple[set, set]:
    """Forward (m, n, k) of the model's linear layers, and of its attention matmuls per head."""
    linear, attention = set(), set()
    d = w.hidden // w.heads
    for tp in tps:
        for mb in micro_batches:
            linear.update((m, n, k) for m, n, k, _ in gemm_shapes(w, Layout(tp, 1, mb)))
    attention.update({(w.seq, w.seq, d), (w.seq, d, w.seq)})
    return linear, attention


def measure_gemms(
    shapes: tuple[set, set], device: torch.device, dtype: torch.dtype, repeats: int
) -> list:
    """[m, n, k, TFLOP/s] rows, keyed as studies.perfmodel prices them.

    A linear layer (m, n, k) is timed as its three real ops: forward x·Wᵀ (row m, n, k),
    input gradient g·W (row m, k, n) and weight gradient gᵀ·x (row k, n, m). Attention
    matmuls, and their backward shapes, are timed as plain products.
    """
    linear, attention = shapes
    rows: dict[tuple[int, int, int], float] = {}

    def tflops(fn: Callable[[], object], m: int, n: int, k: int) -> float:
        return round(2 * m * n * k / median_seconds(fn, repeats) / 1e12, 6)

    for m, n, k in sorted(linear):
        x, wt = (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(n, k, device=device, dtype=dtype),
        )
        g = torch.randn(m, n, device=device, dtype=dtype)
        rows[(m, n, k)] = tflops(lambda x=x, wt=wt: torch.nn.functional.linear(x, wt), m, n, k)
        rows[(m, k, n)] = tflops(lambda g=g, wt=wt: g @ wt, m, n, k)
        rows[(k, n, m)] = tflops(lambda g=g, x=x: g.t() @ x, m, n, k)
    for m, n, k in sorted(attention):
        for mm, nn_, kk in {(m, n, k), (m, k, n), (k, n, m)}:
            a = torch.randn(mm, kk, device=device, dtype=dtype)
            b = torch.randn(kk, nn_, device=device, dtype=dtype)
            rows.setdefault((mm, nn_, kk), tflops(lambda a=a, b=b: a @ b, mm, nn_, kk))
    return [[m, n, k, tf] for (m, n, k), tf in sorted(rows.items())]


def measure_stream_Bps(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Bytes read + written per second by an out-of-place add of 8M elements."""
    x = torch.randn(8 * 2**20, device=device, dtype=dtype)
    y, out = torch.randn_like(x), torch.empty_like(x)
    seconds = median_seconds(lambda: torch.add(x, y, out=out), repeats)
    return 3 * x.numel() * x.element_size() / seconds


def measure_elementwise_Bps(w: Workload, micro_batch: int, repeats: int) -> float:
    """Effective bandwidth of the model's own element-wise work, in the model's byte count.

    One layer's LayerNorms, dropout-adds and GeLU, the unfused attention's softmax and
    dropout, and the fp32 cross-entropy over the logits, forward and backward (fp32, tp=1),
    timed together; the bytes are what studies.perfmodel charges for them.
    """
    F = torch.nn.functional
    lay = Layout(1, 1, micro_batch)
    tokens, f, v = micro_batch * w.seq, w.ffn_size, w.padded_vocab(1)
    x = torch.randn(tokens, w.hidden, requires_grad=True)
    hid = torch.randn(tokens, f, requires_grad=True)
    scores = torch.randn(micro_batch * w.heads, w.seq, w.seq, requires_grad=True)
    logits = torch.randn(tokens, v, requires_grad=True)
    target = torch.randint(0, v, (tokens,))

    def step() -> None:
        y = F.dropout(F.layer_norm(x, (w.hidden,)), 0.1) + x
        y = F.dropout(F.layer_norm(y, (w.hidden,)), 0.1) + y
        z = F.gelu(hid, approximate="tanh")
        p = F.dropout(torch.softmax(scores, -1), 0.1)
        loss = F.cross_entropy(logits, target) + y.sum() + z.sum() + p.sum()
        loss.backward()

    layer_bytes, logit_bytes = elementwise_bytes(w, lay)
    modeled = 3 * (layer_bytes + score_bytes(w, lay)) + logit_bytes
    return modeled / median_seconds(step, repeats)


def measure_op_overhead_s(repeats: int) -> float:
    """Host seconds per tiny autograd operator (forward and its backward counted as two)."""
    x = torch.ones(4, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()

    return median_seconds(chain, repeats) / 100


def thread_efficiency(repeats: int, size: int = 512) -> float:
    """Extra throughput a second thread adds to a CPU GEMM (0 none, 1 perfect)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = median_seconds(lambda: a @ b, repeats)
        torch.set_num_threads(2)
        two = median_seconds(lambda: a @ b, repeats)
    finally:
        torch.set_num_threads(before)
    return max(0.0, min(1.0, one / two - 1.0))


def _timed_collective(fn: Callable[[], object], n_bytes: int, repeats: int) -> float:
    """Median seconds per call; every rank makes the same number of calls (collectives match)."""
    calls = 50 if n_bytes <= 2**16 else 10 if n_bytes <= 2**20 else 3
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _comm_worker(rank: int, world: int, store_path: str, sizes: list[int], out, repeats: int):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = []
    for n in sizes:
        t = torch.ones(n // 4)
        ar = _timed_collective(lambda t=t: dist.all_reduce(t), n, repeats)
        shard = torch.ones(n // 4 // world)
        parts = [torch.empty_like(shard) for _ in range(world)]
        ag = _timed_collective(lambda s=shard, p=parts: dist.all_gather(p, s), n, repeats)
        results.append((n, ar, ag))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure_collectives(world: int, sizes: list[int], repeats: int) -> list[tuple]:
    """(bytes, all-reduce s, all-gather s) per size over ``world`` gloo processes."""
    ctx = worker_context("torch.distributed", __name__)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, os.path.join(tmp, "store"), sizes, queue, repeats)
        procs = [ctx.Process(target=_comm_worker, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = queue.get(timeout=300)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():  # a rank that died leaves the others waiting
                    p.kill()
    return results


def fit_ring(results: list[tuple], world: int) -> tuple[float, float]:
    """Least-squares α (s) and bandwidth (B/s) of t = 2(p−1)α + 2n(p−1)/p / bw (all-reduce)."""
    xs = [2 * n * (world - 1) / world for n, _, _ in results]
    ys = [ar for _, ar, _ in results]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    if slope <= 0:  # noise swamped the size dependence: take the largest message alone
        slope = ys[-1] / xs[-1]
    alpha = max(0.0, (my - slope * mx) / (2 * (world - 1)))
    return alpha, 1.0 / slope


def now_utc() -> str:
    """Timestamp for the source fields."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def build_parser(
    description: str | None = None, formatter=argparse.HelpFormatter
) -> argparse.ArgumentParser:
    """The command line of tools/calibrate.py."""
    p = ArgumentParser(description=description, formatter_class=formatter)
    p.add_argument("--model", default="gpt_tiny", help="configs/model preset whose GEMMs to time")
    p.add_argument(
        "--hidden",
        type=int_list(),
        default=None,
        help="comma list of hidden sizes whose GEMMs to time too (default: the preset's)",
    )
    p.add_argument("--seq", type=positive_int, default=128, help="sequence length (data.seq_len)")
    p.add_argument(
        "--micro-batch", type=int_list(), default="1,2,4", help="comma list of micro-batches"
    )
    p.add_argument("--tp", type=int_list(), default="1,2,4", help="comma list of TP sizes")
    p.add_argument(
        "--ranks",
        type=int_list(2),  # the ring fit needs 2 or more processes
        default="2,4",
        help="comma list of gloo group sizes to time (each >= 2)",
    )
    p.add_argument("--name", default=None, help="cluster name (default: the output file stem)")
    p.add_argument("--quick", action="store_true", help="few shapes and repeats (tests)")
    p.add_argument(
        "--no-in-model",
        action="store_true",
        help="skip the trainer runs that price collectives as training sees them",
    )
    p.add_argument(
        "--in-model-steps",
        type=int,
        default=None,
        help=f"steps of each trainer run (default {in_model_runs.STEPS}, "
        f"{in_model_runs.QUICK_STEPS} with --quick; at least {in_model_runs.MIN_STEPS}: "
        "two logging windows, the first of which is the warm-up)",
    )
    p.add_argument(
        "--rank-speed-seconds",
        type=float,
        default=TARGET_S,
        help=f"seconds of one timed block of the rank-speed measurement (default {TARGET_S}; "
        "shorter blocks read a burst figure, too fast: for tests that check the pipeline only)",
    )
    p.add_argument("--out", required=True, help="cluster YAML to write")
    return p


def _comm_section(ranks: list[int], quick: bool) -> tuple[dict, list[dict]]:
    sizes = [2**12, 2**18] if quick else [2**12, 2**14, 2**16, 2**18, 2**20, 2**22]
    fits, raw = {}, []
    for world in ranks:
        results = measure_collectives(world, sizes, 3 if quick else 5)
        alpha, bw = fit_ring(results, world)
        fits[world] = (alpha, bw)
        raw.append(
            {
                "ranks": world,
                "alpha_us": round(alpha * 1e6, 2),
                "bandwidth_GBps": round(bw / 1e9, 4),
                "samples": [[n, round(ar * 1e6, 1), round(ag * 1e6, 1)] for n, ar, ag in results],
            }
        )
    alpha, bw = fits[min(ranks)]
    by_ranks = {
        p: {"bandwidth_GBps": round(b / 1e9, 4), "latency_us": round(a * 1e6, 2)}
        for p, (a, b) in fits.items()
    }
    return {
        "bandwidth_GBps": round(bw / 1e9, 4),
        "latency_us": round(alpha * 1e6, 2),
        "by_ranks": by_ranks,
    }, raw


def _workload(args: argparse.Namespace) -> Workload:
    """The preset's model at ``--seq``, fp32, as studies.perfmodel prices it."""
    from studies.perfmodel.presets import preset_fields

    fields = {**preset_fields(args.model), "seq": args.seq}
    return Workload(**fields, global_batch=1, precision="fp32")


def _sweep(args: argparse.Namespace, w: Workload) -> tuple[list[int], list[int], list[int]]:
    """TP sizes, micro-batches and hidden sizes to time; ``--quick`` also cuts ``args.ranks``
    to its first group size."""
    tps, mbs = args.tp, args.micro_batch
    if args.quick:
        # the largest micro-batch: the CI points run micro-batch 4
        tps, mbs, args.ranks = tps[:2], mbs[-1:], args.ranks[:1]
    hiddens = args.hidden or [w.hidden]
    return tps, mbs, hiddens


def _measure_device(w: Workload, tps, mbs, hiddens, repeats: int) -> dict:
    """The one-rank figures: GEMM table, bandwidths, operator overhead, threads, probe."""
    shapes: tuple[set, set] = (set(), set())
    for h in hiddens:  # e.g. a wider variant of the preset, priced by the same table
        linear, attention = modelgemm_shapes(replace(w, hidden=h), tps, mbs)
        shapes[0].update(linear)
        shapes[1].update(attention)
    torch.set_num_threads(1)
    probe_before = probe_gflops()
    gemms = measure_gemms(shapes, torch.device("cpu"), torch.float32, repeats)
    stream = measure_stream_Bps(torch.device("cpu"), torch.float32, repeats)
    effective = measure_elementwise_Bps(w, max(mbs), repeats)
    overhead = measure_op_overhead_s(repeats)
    cores = os.cpu_count() or 1
    thread_eff = thread_efficiency(repeats) if cores > 1 else 0.0
    probe = (probe_before + probe_gflops()) / 2
    return {
        "gemms": gemms,
        "stream": stream,
        "effective": effective,
        "overhead": overhead,
        "cores": cores,
        "thread_eff": thread_eff,
        "probe": probe,
    }


def _device_section(m: dict, speeds, src: str) -> dict:
    """The spec's ``device:`` mapping from the measured one-rank figures."""
    gemms = m["gemms"]
    return {
        "peak_tflops": round(sorted(r[3] for r in gemms)[int(0.9 * (len(gemms) - 1))], 6),
        "mem_bandwidth_TBps": round(m["effective"] / 1e12, 6),
        "stream_bandwidth_TBps": round(m["stream"] / 1e12, 6),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "memory_shared": True,  # the host's RAM, which every rank on it shares
        "op_overhead_us": round(m["overhead"] * 1e6, 2),
        "cores": m["cores"],
        "thread_efficiency": round(m["thread_eff"], 3),
        "rank_speed": speeds,
        "gemm_table": gemms,
        "source": f"fp32, one thread; peak = 90th percentile of the GEMMs; mem_bandwidth = "
        "the model's element-wise ops (LayerNorm, GeLU, dropout-add, softmax, "
        f"cross-entropy) in the model's byte count; rank_speed = one rank's "
        "speed while p ranks (1 thread each) compute at once, see "
        f"studies/perfmodel/concurrency.py; {src}",
    }


def calibrate_cpu(args: argparse.Namespace) -> dict:
    """The cluster spec of this CPU machine, every figure measured here."""
    repeats = 3 if args.quick else 7
    w = _workload(args)
    tps, mbs, hiddens = _sweep(args, w)
    measured = _measure_device(w, tps, mbs, hiddens, repeats)
    rank_counts = args.ranks
    speeds = measure_rank_speed(
        w, max(mbs), rank_counts, repeats=2, block_s=args.rank_speed_seconds
    )
    intra, raw = _comm_section(rank_counts, args.quick)
    src = f"measured by tools/calibrate.py on this machine, {now_utc()}"
    spec = {
        "name": args.name or os.path.splitext(os.path.basename(args.out))[0],
        "gpus_per_node": 64,  # ranks on this one machine: any number (they share the cores)
        "max_nodes": 1,
        "precision": "fp32",
        "collectives": ["ring"],
        "overlap_efficiency": 0.0,
        "probe_gflops": round(measured["probe"], 3),  # 256³ GEMM, one thread, while calibrating
        "overlap_source": "CPU: gloo's reductions need the cores the backward pass is using",
        "intra_node": {
            **intra,
            "source": f"gloo all-reduce over {','.join(map(str, rank_counts))} processes, "
            f"ring fit per group size; {src}",
        },
        "inter_node": {
            "bandwidth_Gbps": round(intra["bandwidth_GBps"] * 8, 4),
            "latency_us": intra["latency_us"],
            "source": "one machine: no network; copy of intra_node",
        },
        "device": _device_section(measured, speeds, src),
        "efficiency": {
            "gemm": 1.0,
            "memory": 1.0,
            "network": 1.0,
            "source": "1.0: the figures above are already achieved values",
        },
        "collective_samples": raw,
    }
    if not args.no_in_model:  # the trainer's own runs, at micro-batches the validation skips
        steps = args.in_model_steps or (
            in_model_runs.QUICK_STEPS if args.quick else in_model_runs.STEPS
        )
        found = in_model_runs.measure(w, hiddens, spec, args.quick, steps)
        spec["device"]["compute_scale"] = found["compute_scale"]
        spec["in_model"] = {
            "source": f"engine.pretrain, {steps} steps per run; {src}",
            **found["in_model"],
        }
    return spec


def main(argv: list[str], description: str | None = None, formatter=None) -> int:
    """CLI entry of tools/calibrate.py: measure and write the YAML atomically."""
    args = build_parser(description, formatter or argparse.HelpFormatter).parse_args(argv)
    from pathlib import Path

    from engine.preflight import probe_writable

    if not 0 < args.rank_speed_seconds < float("inf"):
        print(
            f"calibrate: --rank-speed-seconds {args.rank_speed_seconds} must be a finite "
            "number > 0",
            file=sys.stderr,
        )
        return 2
    steps = args.in_model_steps
    if steps is not None and steps < in_model_runs.MIN_STEPS:
        print(
            f"calibrate: --in-model-steps {steps} must be >= {in_model_runs.MIN_STEPS} (two "
            "logging windows of 2 steps: the first is the warm-up)",
            file=sys.stderr,
        )
        return 2
    if steps is not None and args.no_in_model:
        print(
            f"calibrate: --in-model-steps {steps} does nothing with --no-in-model (no trainer "
            "runs); drop one of them",
            file=sys.stderr,
        )
        return 2
    problem = probe_writable(Path(args.out), directory=False)
    if problem:  # known now, not after minutes of measuring
        print(f"calibrate: --out {args.out} cannot be written: {problem}", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        print("GPU calibration: run on CPU ranks only in this version", file=sys.stderr)
    try:
        spec = calibrate_cpu(args)
    except (ValueError, RuntimeError, subprocess.SubprocessError) as err:  # a trainer run failed
        print(f"calibrate: {err}", file=sys.stderr)
        return 2
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(
            "# Written by tools/calibrate.py: every figure measured on the machine named below.\n"
        )
        yaml.safe_dump(spec, fh, sort_keys=False, default_flow_style=None, width=100)
    os.replace(tmp, args.out)
    print(
        f"wrote {args.out}: GEMM up to {spec['device']['peak_tflops'] * 1e3:.1f} GFLOP/s, "
        f"stream {spec['device']['mem_bandwidth_TBps'] * 1e3:.2f} GB/s, all-reduce "
        f"{spec['intra_node']['bandwidth_GBps']:.2f} GB/s α={spec['intra_node']['latency_us']} µs"
    )
    return 0
