"""α-β costs of collectives, and which link a TP or DP group crosses.

For p ranks and n bytes per rank, α the per-message latency and β = 1/bandwidth:

- ring all-reduce: 2(p−1)·α + 2·n·(p−1)/p·β
- tree all-reduce (pipelined, as NCCL does for small messages / many nodes): 2·log₂p·α + 2·n·β
- ring all-gather or reduce-scatter (n = the full, gathered size): (p−1)·α + n·(p−1)/p·β

The library picks the cheaper algorithm among those the cluster lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from studies.perfmodel.cluster_spec import ClusterSpec, Link


def ring_all_reduce(n_bytes: float, p: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``n_bytes`` over ``p`` ranks."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.latency_s + 2 * n_bytes * (p - 1) / p / link.bandwidth_Bps


def tree_all_reduce(n_bytes: float, p: int, link: Link) -> float:
    """Seconds for a pipelined (double binary) tree all-reduce."""
    if p <= 1:
        return 0.0
    return 2 * math.log2(p) * link.latency_s + 2 * n_bytes / link.bandwidth_Bps


def ring_all_gather(n_bytes: float, p: int, link: Link) -> float:
    """Seconds for a ring all-gather (or reduce-scatter) whose full result is ``n_bytes``."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.latency_s + n_bytes * (p - 1) / p / link.bandwidth_Bps


ring_reduce_scatter = ring_all_gather

_ALL_REDUCE = {"ring": ring_all_reduce, "tree": tree_all_reduce}


def all_reduce(n_bytes: float, p: int, link: Link, algorithms: tuple[str, ...]) -> float:
    """The cheapest of ``algorithms`` (the library's choice) for this size and group."""
    return min(_ALL_REDUCE[a](n_bytes, p, link) for a in algorithms)


@dataclass(frozen=True)
class GroupPlacement:
    """Where one group's ranks sit: how many nodes it spans and how many such groups share a node."""

    size: int
    nodes: int
    groups_per_node: int


def place_groups(tp: int, dp: int, gpus_per_node: int) -> tuple[GroupPlacement, GroupPlacement]:
    """TP and DP group placement for the mesh's rank layout (parallel_state.dims: TP fastest).

    TP ranks are consecutive (inside a node while tp ≤ gpus_per_node); DP ranks are
    ``tp`` apart, so a DP group has ``gpus_per_node // tp`` members per node and the ``tp``
    DP groups of a node share its network.
    """
    tp_nodes = max(1, math.ceil(tp / gpus_per_node))
    tp_groups_per_node = max(1, gpus_per_node // tp)
    dp_per_node = max(1, gpus_per_node // tp)
    dp_nodes = max(1, math.ceil(dp / dp_per_node))
    dp_groups_per_node = min(tp, gpus_per_node)
    return (
        GroupPlacement(tp, tp_nodes, tp_groups_per_node),
        GroupPlacement(dp, dp_nodes, dp_groups_per_node),
    )


def group_link(group: GroupPlacement, cluster: ClusterSpec) -> Link:
    """The effective link of a group: the intra-node fabric, or its share of the node network.

    A group inside one node runs at the per-rank intra-node bandwidth. A group across nodes
    is limited by the node's network divided among the groups that cross it at once, and
    pays the inter-node latency. Both are scaled by the cluster's network efficiency.
    """
    eff = cluster.network_efficiency
    if group.nodes <= 1:
        link = cluster.intra_by_ranks.get(group.size, cluster.intra)
        return Link(link.bandwidth_Bps * eff, link.latency_s)
    share = cluster.inter.bandwidth_Bps / group.groups_per_node
    return Link(min(share, cluster.intra.bandwidth_Bps) * eff, cluster.inter.latency_s)


def parameter_server_time(n_bytes: float, workers: int, servers: int, link: Link) -> float:
    """One synchronous step's gradient exchange through ``servers`` parameter servers.

    The servers together receive workers·n bytes of gradients and send workers·n bytes of
    parameters; sharded evenly, each server's link carries 2·workers·n/servers bytes.
    """
    return 2 * workers * n_bytes / servers / link.bandwidth_Bps + 2 * link.latency_s


def async_staleness(workers: int) -> float:
    """Mean staleness τ (in updates) of an asynchronous gradient: the others' updates since its read."""
    return float(max(0, workers - 1))
