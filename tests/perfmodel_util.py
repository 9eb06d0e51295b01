"""The hand cluster the performance-model tests price against: round numbers, so every
expected value can be worked out by hand."""

from __future__ import annotations

from studies.perfmodel.cluster_spec import ClusterSpec, Link
from studies.perfmodel.in_model import parse

ALPHA, BW = 1e-5, 1e9  # 10 µs, 1 GB/s: round numbers for hand arithmetic
LINK = Link(BW, ALPHA)


def hand_cluster(**in_model) -> ClusterSpec:
    """64 cores, 1e11 FLOP/s, 1e10 B/s, every efficiency 1, ring collectives on LINK, with
    the measured ``in_model`` tables given (none by default)."""
    return ClusterSpec(
        "hand",
        64,
        LINK,
        LINK,
        peak_flops=1e11,
        mem_bandwidth_Bps=1e10,
        memory_bytes=2**34,
        gemm_efficiency=1.0,
        memory_efficiency=1.0,
        network_efficiency=1.0,
        collectives=("ring",),
        cores=64,
        in_model=parse(in_model) if in_model else {},
    )
