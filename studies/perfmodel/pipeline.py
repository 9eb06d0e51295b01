"""Pipeline-parallel terms: the bubble, the micro-batches a stage holds, the stage hand-off.

p stages, m micro-batches per step, v virtual stages (layer chunks) per rank; f, b, w the
times of one micro-batch's forward, input gradient and weight gradient on one stage
(relative; equal by default, the zero-bubble paper's assumption):

- bubble (idle over ideal time m·(f + b + w)): (p−1)/m for GPipe and 1F1B, (p−1)/(v·m)
  interleaved; the zero-bubble schedules (:func:`bubble_fraction`) fill it with the weight
  gradients they defer;
- activations held by the first stage, in micro-batches of its l/p layers: m (GPipe),
  min(m, p) (1F1B, and the zero-bubble schedules, whose deferred weight gradients keep
  only what the weight pass reads), and for interleaved 1F1B Megatron's warm-up of
  2(p−1) + (v−1)p chunks of l/(p·v) layers plus the one in flight, i.e. p + (p−1)/v
  micro-batches' worth;
- hand-off per micro-batch and stage boundary: b·s·h activations forward and their
  gradient backward (÷ t under sequence parallelism), v times per micro-batch interleaved
  (twice under a V);
- which link a boundary crosses: ranks are ordered pp, dp, tp (TP fastest), so stage k is
  the ranks [k·t·d, (k+1)·t·d); a boundary inside a node runs on the intra-node fabric, one
  between nodes on each GPU's share of the node's network.
"""

from __future__ import annotations

import math

from studies.perfmodel.cluster_spec import ClusterSpec, Link

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


def stage_chunks(schedule: str, v: int = 1) -> int:
    """Layer chunks per rank: v for the interleaved schedules, 2 under a V, else 1."""
    if schedule in ("zbv", "dualpipev"):
        return 2
    return v if schedule in ("interleaved_1f1b", "zero_bubble") else 1


def bubble_fraction(
    p: int, m: int, schedule: str, v: int = 1, *, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> float:
    """Idle time over ideal time m·(f + b + w) of one step's pipeline.

    The schedules that split the backward (torch's orders, timed with these unit costs by
    tests/test_pipeline_zb.py) leave, per stage of warm-up, one chunk's (1/c of a stage's)
    max(f, f + b − w) idle: a weight gradient fills what the input gradient leaves, but
    nothing fills the first forward's trip down the pipe (the last rank starts (p−1)·f/c
    late whatever the order). ZB-V does better where the backward outweighs the weight
    pass: max(f, b, f + b − 2w). With equal times: 1F1B (p−1)/m, interleaved zero bubble
    (p−1)/(3·v·m) (v = 1: the paper's ZB-H1, one third of 1F1B's), DualPipeV (p−1)/(6m),
    ZB-V (p−1)/(6m), the warm-up alone (the paper counts ZB-V's bubble as 0)."""
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        return (p - 1) / (stage_chunks(schedule, v) * m)
    idle = max(f, b, f + b - 2 * w) if schedule == "zbv" else max(f, f + b - w)
    return (p - 1) * idle / (stage_chunks(schedule, v) * m * (f + b + w))


def in_flight_micro_batches(p: int, m: int, schedule: str, v: int = 1) -> float:
    """Micro-batches of activations the first stage holds at its peak (in units of its
    l/p layers)."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("interleaved_1f1b", "zero_bubble") and v > 1:
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
    return 2 * stage_chunks(schedule, v) * (link.latency_s + n_bytes / link.bandwidth_Bps)


def stage_layers(layers: int, pp: int) -> int:
    """Layers per stage (the layout check makes ``pp`` divide ``layers``)."""
    return math.ceil(layers / pp)
