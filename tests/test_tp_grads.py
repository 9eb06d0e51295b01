"""layers.tp_grads: the TP sum of partial gradients, against a hand-computed sum."""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.tp_grads import sum_partial_grads_
from tests.multiproc import run_ranks


def _summed() -> list[list[float]]:
    rank = dist.get_rank()
    # Two tensors of different shapes (a matrix and a 1-D slice of a larger buffer, as
    # ZeRO passes): rank r holds (r + 1) × the base values.
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    grads = [base * (rank + 1), (torch.arange(10.0) * (rank + 1))[2:5]]
    sum_partial_grads_(grads, dist.group.WORLD)
    sum_partial_grads_([], dist.group.WORLD)  # nothing to sum: no collective, no error
    return [g.flatten().tolist() for g in grads]


def test_partial_grads_are_summed_over_the_tp_group():
    # Over 2 ranks: (1 + 2) × base. Exact in fp32 (small integers), so compared exactly.
    for result in run_ranks(_summed, 2):
        assert result[0] == [3.0 * v for v in range(6)]
        assert result[1] == [3.0 * v for v in (2, 3, 4)]


def test_one_rank_group_leaves_grads_alone():
    g = torch.ones(3)
    sum_partial_grads_([g], None)  # None: a one-rank group, so no process group is needed
    torch.testing.assert_close(g, torch.ones(3), rtol=0, atol=0)
