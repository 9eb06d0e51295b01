"""The plan channel of a server split over TP ranks: the scheduling rank (TP rank 0) sends
each forward's :class:`apps.serving.engine.StepPlan`, the other ranks receive it.

A plan is a few small tensors and ints, sent as one pickled object
(``engine.comm.broadcast_object``) over a gloo group of its own: the model's TP group
carries the forward's collectives, and its timeout (10 minutes) would end an idle server,
whose other ranks wait in a receive for as long as no request comes. This group's
timeout is a year. ``None`` is the last message: the server stopped, the ranks return.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from engine.comm import broadcast_object
from parallel_state.groups import group_rank, same_ranks_group

IDLE_TIMEOUT = timedelta(days=365)  # a receive waits for the next request this long


class PlanChannel:
    """Rank 0 of ``tp_group`` :meth:`send` s, every other rank :meth:`receive` s. Every
    rank of the world must construct it together (it makes a process group)."""

    def __init__(self, tp_group: dist.ProcessGroup) -> None:
        self.group = same_ranks_group(tp_group, timeout=IDLE_TIMEOUT)
        self.is_source = group_rank(tp_group) == 0

    def send(self, plan) -> None:
        """Send ``plan`` (a StepPlan, or ``None``: stop) to the other ranks."""
        assert self.is_source, "only TP rank 0 schedules"
        broadcast_object(plan, self.group)

    def receive(self):
        """The next plan from TP rank 0 (``None``: the server stopped)."""
        return broadcast_object(None, self.group)
