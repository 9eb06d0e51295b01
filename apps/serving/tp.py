"""The plan channel of a server split over TP ranks: the scheduling rank (TP rank 0) sends
each forward's :class:`apps.serving.engine.StepPlan`, the other ranks receive it.

A plan is a few small tensors and ints, sent as one pickled object
(``broadcast_object_list``) over a gloo group of its own: the model's TP group carries the
forward's collectives, and its timeout (10 minutes) would end an idle server, whose other
ranks wait in a receive for as long as no request comes. This group's timeout is a year.
``None`` is the last message: the server stopped, the ranks return.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=365)  # a receive waits for the next request this long


class PlanChannel:
    """Rank 0 of ``tp_group`` :meth:`send` s, every other rank :meth:`receive` s. Every
    rank of the world must construct it together (it makes a process group)."""

    def __init__(self, tp_group) -> None:
        ranks = dist.get_process_group_ranks(tp_group)
        self.group = dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
        self.src = ranks[0]
        self.is_source = dist.get_rank() == self.src

    def send(self, plan) -> None:
        """Send ``plan`` (a StepPlan, or ``None``: stop) to the other ranks."""
        assert self.is_source, "only TP rank 0 schedules"
        dist.broadcast_object_list([plan], src=self.src, group=self.group)

    def receive(self):
        """The next plan from TP rank 0 (``None``: the server stopped)."""
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]
