"""Pipeline-parallel terms: the bubble, the micro-batches a stage holds, the stage hand-off.

p stages, m micro-batches per step, v virtual stages (layer chunks) per rank:

- bubble (idle over ideal time): (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved;
- activations held by the first stage, in micro-batches of its l/p layers: m (GPipe),
  min(m, p) (1F1B), and for interleaved 1F1B Megatron's warm-up of 2(p−1) + (v−1)p chunks
  of l/(p·v) layers plus the one in flight, i.e. p + (p−1)/v micro-batches' worth;
- hand-off per micro-batch and stage boundary: b·s·h activations forward and their
  gradient backward (÷ t under sequence parallelism), v times per micro-batch interleaved;
- which link a boundary crosses: ranks are ordered pp, dp, tp (TP fastest), so stage k is
  the ranks [k·t·d, (k+1)·t·d); a boundary inside a node runs on the intra-node fabric, one
  between nodes on each GPU's share of the node's network.
"""

from __future__ import annotations

import math

from studies.perfmodel.cluster_spec import ClusterSpec, Link

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def bubble_fraction(p: int, m: int, schedule: str, v: int = 1) -> float:
    """Idle time over ideal time of one step's pipeline."""
    if p <= 1:
        return 0.0
    chunks = v if schedule == "interleaved_1f1b" else 1
    return (p - 1) / (chunks * m)


def in_flight_micro_batches(p: int, m: int, schedule: str, v: int = 1) -> float:
    """Micro-batches of activations the first stage holds at its peak (in units of its
    l/p layers)."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        return min(float(m), p + (p - 1) / v)
    return float(min(m, p))


def p2p_bytes(b: int, s: int, h: int, act_bytes: int, t: int, *, sp: bool) -> float:
    """Bytes one rank sends across one stage boundary per micro-batch in one direction."""
    return b * s * h * act_bytes / (t if sp else 1)


def boundary_crosses_nodes(pp: int, stage_ranks: int, gpus_per_node: int) -> bool:
    """Whether some stage boundary lies between two nodes (stage k holds ranks
    [k·stage_ranks, (k+1)·stage_ranks))."""
    return any((k * stage_ranks) % gpus_per_node == 0 for k in range(1, pp)) or (
        stage_ranks > gpus_per_node
    )


def p2p_link(pp: int, stage_ranks: int, cluster: ClusterSpec) -> Link:
    """The link the slowest stage boundary crosses: every GPU of a node sends to its peer
    at once, so one between nodes gets 1/gpus_per_node of the node's network."""
    eff = cluster.network_efficiency
    if pp > 1 and boundary_crosses_nodes(pp, stage_ranks, cluster.gpus_per_node):
        share = cluster.inter.bandwidth_Bps / cluster.gpus_per_node
        return Link(share * eff, cluster.inter.latency_s)
    return Link(cluster.intra.bandwidth_Bps * eff, cluster.intra.latency_s)


def p2p_seconds_per_micro_batch(
    n_bytes: float, schedule: str, v: int, link: Link, pp: int
) -> float:
    """Send + receive time one rank spends per micro-batch on the critical path: the
    activation forward and its gradient backward, once per layer chunk it holds."""
    if pp <= 1:
        return 0.0
    chunks = v if schedule == "interleaved_1f1b" else 1
    return 2 * chunks * (link.latency_s + n_bytes / link.bandwidth_Bps)


def stage_layers(layers: int, pp: int) -> int:
    """Layers per stage (the layout check makes ``pp`` divide ``layers``)."""
    return math.ceil(layers / pp)
