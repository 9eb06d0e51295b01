"""Time of GEMMs and of memory-bound element-wise work on one device.

A GEMM of (m×k)·(k×n) does 2·m·n·k FLOPs and moves at least (m·k + k·n + m·n) elements.
Without a measured table its time is a roofline: the larger of FLOPs ÷ (peak × GEMM
efficiency) and bytes ÷ (memory bandwidth × memory efficiency). The GEMM efficiency is
e_max · Π d/(d + TILE) · k/(k + k0): the shape factor charges small dimensions for partly
empty tiles, and k/(k + k0) a fixed cost per output tile (filling the operand pipeline,
the epilogue that converts and writes the tile), worth k0 steps of the reduction loop, that
the tile's k/TILE loop steps amortise (docs/PERFMODEL.md, "Cluster specs"). With a
``gemm_table`` measured by tools/calibrate.py, the throughput of the nearest measured shape
(in log space) is used instead.
"""

from __future__ import annotations

import math

from studies.perfmodel.cluster_spec import ClusterSpec

TILE = 64  # a typical tensor-core tile edge; dims far above it run at full efficiency


def _shape_factor(m: int, n: int, k: int) -> float:
    return (m / (m + TILE)) * (n / (n + TILE)) * (k / (k + TILE))


def reduction_factor(cluster: ClusterSpec, k: float) -> float:
    """Share of a tile's time spent in its reduction loop of length ``k``: k/(k + k0),
    1 where the spec sets no per-tile fixed cost (``gemm_k0`` 0)."""
    return k / (k + cluster.gemm_k0)


def gemm_efficiency(cluster: ClusterSpec, m: int, n: int, k: int) -> float:
    """Fraction of peak an (m×k)·(k×n) GEMM reaches: the ceiling, partly empty tiles and
    the per-tile fixed cost amortised over the reduction length k."""
    return cluster.gemm_efficiency * _shape_factor(m, n, k) * reduction_factor(cluster, k)


def _table_flops(cluster: ClusterSpec, m: int, n: int, k: int) -> float:
    """FLOP/s of the measured shape nearest to (m, n, k) in log space."""

    def distance(row: tuple[int, int, int, float]) -> float:
        return sum(abs(math.log(a / b)) for a, b in zip(row[:3], (m, n, k), strict=True))

    return min(cluster.gemm_table, key=distance)[3]


def gemm_seconds(
    cluster: ClusterSpec, m: int, n: int, k: int, elem_bytes: int, speed: float = 1.0
) -> float:
    """Seconds for one (m×k)·(k×n) GEMM; ``speed`` scales the device (CPU thread share)."""
    flops = 2.0 * m * n * k
    if cluster.gemm_table:
        return flops / (_table_flops(cluster, m, n, k) * speed)
    compute = flops / (cluster.peak_flops * gemm_efficiency(cluster, m, n, k))
    traffic = elem_bytes * (m * k + k * n + m * n)
    memory = traffic / (cluster.mem_bandwidth_Bps * cluster.memory_efficiency)
    return max(compute, memory) / speed


def gemm_pass_seconds(
    cluster: ClusterSpec, m: int, n: int, k: int, elem_bytes: int, speed: float = 1.0
) -> tuple[float, float]:
    """(forward, backward) seconds of a linear map's GEMM: backward is the input gradient
    (m×n)·(n×k) and the weight gradient (k×m)·(m×n), priced at their own shapes."""
    forward = gemm_seconds(cluster, m, n, k, elem_bytes, speed)
    backward = gemm_seconds(cluster, m, k, n, elem_bytes, speed) + gemm_seconds(
        cluster, k, n, m, elem_bytes, speed
    )
    return forward, backward


def stream_seconds(cluster: ClusterSpec, n_bytes: float, speed: float = 1.0) -> float:
    """Seconds for memory-bound work that reads and writes ``n_bytes`` in total."""
    return n_bytes / (cluster.mem_bandwidth_Bps * cluster.memory_efficiency * speed)


def rank_speed(cluster: ClusterSpec, ranks_per_node: int, threads: int | None = None) -> float:
    """Relative compute speed of one rank when ranks share a CPU's cores (1.0 on GPUs).

    Calibration measures one thread. A rank gets ``threads``, by default cores // ranks;
    extra threads add ``thread_efficiency`` each, and more ranks than cores time-share.
    Where calibration measured single-thread ranks computing side by side
    (``cluster.rank_speed``, studies/perfmodel/concurrency.py), that measurement is used.
    """
    if cluster.cores is None:
        return 1.0
    threads = threads or max(1, cluster.cores // ranks_per_node)
    if threads == 1 and ranks_per_node in cluster.rank_speed:
        return cluster.rank_speed[ranks_per_node]
    speed = 1.0 + (threads - 1) * cluster.thread_efficiency
    return speed * min(1.0, cluster.cores / (ranks_per_node * threads))
