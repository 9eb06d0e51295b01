"""engine/comm.py: the run-level collectives, on real gloo ranks, against hand-computed values.

Values are small integers and halves, exact in float64, so every comparison is exact.
"""

from __future__ import annotations

import torch

import parallel_state
from engine import comm
from tests.multiproc import run_ranks


def _on_a_2x2_mesh() -> dict:
    ps = parallel_state.initialize(2, 2)  # ranks [[0, 1], [2, 3]]: dp groups {0, 2}, {1, 3}
    cpu = torch.device("cpu")
    counts = comm.sum_(torch.tensor([float(ps.rank), 1.0]), ps.dp_group)
    return {
        "mean_dp": comm.mean(float(ps.rank), ps.dp_group, cpu),
        "mean_world": comm.mean(float(ps.rank), comm.world(ps), cpu),
        "sum_dp": counts.tolist(),
        "any_only_rank3": comm.any_rank(ps.rank == 3, comm.world(ps), cpu),
        "any_tp_of_rank3": comm.any_rank(ps.rank == 3, ps.tp_group, cpu),
        "gathered": comm.all_gather_object({"r": ps.rank}, comm.world(ps)),
        "from_dp0": comm.broadcast_object(f"from {ps.rank}", ps.dp_group),
        "barrier": comm.barrier(comm.world(ps)),
    }


def test_run_level_collectives_on_four_ranks():
    out = run_ranks(_on_a_2x2_mesh, 4)
    for rank, got in enumerate(out):
        partner = rank ^ 2  # the other rank of this rank's DP group
        assert got["mean_dp"] == (rank + partner) / 2
        assert got["mean_world"] == 1.5  # (0 + 1 + 2 + 3) / 4
        assert got["sum_dp"] == [rank + partner, 2.0]
        assert got["any_only_rank3"] is True
        assert got["any_tp_of_rank3"] is (rank in (2, 3))  # only rank 3's TP group sees it
        assert got["gathered"] == [{"r": r} for r in range(4)]
        assert got["from_dp0"] == f"from {min(rank, partner)}"  # DP rank 0 of the group
        assert got["barrier"] is None


def test_a_single_process_communicates_nothing():
    """Group None (no torch.distributed): each helper returns its own input."""
    cpu = torch.device("cpu")
    if not torch.distributed.is_initialized():  # as in a plain test process
        assert comm.world() is None
    assert comm.mean(2.5, None, cpu) == 2.5
    assert comm.any_rank(False, None, cpu) is False
    t = torch.tensor([3.0])
    assert comm.sum_(t, None) is t and t.item() == 3.0
    assert comm.all_gather_object("x", None) == ["x"]
    assert comm.broadcast_object("x", None) == "x"
    comm.barrier(None)
