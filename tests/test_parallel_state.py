"""The (dp, tp) mesh: rank layout, group membership, errors, launcher detection, RNG streams."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallel_state
from parallel_state.dims import ParallelDims
from parallel_state.launcher import detect_launch, first_slurm_host
from tests.multiproc import run_ranks

LAYOUTS = [(2, 2), (4, 1), (1, 4)]


def _layouts() -> dict:
    seen = {}
    for tp, dp in LAYOUTS:
        # The short form (sizes) and the mesh value (ParallelDims) must build the same mesh.
        ps = parallel_state.initialize(
            ParallelDims(tp, dp) if tp == dp else tp, dp if tp != dp else None
        )
        # Prove the groups really contain those ranks: a sum over each group of the global
        # ranks must equal the sum of the membership it claims.
        t = torch.tensor([float(ps.rank)])
        dist.all_reduce(t, group=ps.tp_group)
        d = torch.tensor([float(ps.rank)])
        dist.all_reduce(d, group=ps.dp_group)
        seen[(tp, dp)] = {
            "tp_rank": ps.tp_rank,
            "dp_rank": ps.dp_rank,
            "tp_ranks": dist.get_process_group_ranks(ps.tp_group),
            "dp_ranks": dist.get_process_group_ranks(ps.dp_group),
            "tp_sum": t.item(),
            "dp_sum": d.item(),
            "sizes": (ps.tp_size, ps.dp_size, ps.world_size),
            "get_is_current": parallel_state.get() is ps,
            "groups_by_axis": {a: ps.group(a) for a in ("pp", "dp", "tp")}
            == {"pp": ps.pp_group, "dp": ps.dp_group, "tp": ps.tp_group},
            # Today every role spans the dp axis alone: its group is the DP group itself.
            "roles": {
                role: (
                    ps.group(role) is ps.dp_group,
                    ps.ranks(role),
                    ps.rank_in(role),
                    ps.size(role),
                )
                for role in ("grad", "batch", "loss", "replica")
            },
        }
        parallel_state.destroy()
    return seen


def test_rank_layout_and_group_membership():
    results = run_ranks(_layouts, 4)
    expected_tp_groups = {
        (2, 2): [[0, 1], [2, 3]],
        (4, 1): [[0, 1, 2, 3]],
        (1, 4): [[0], [1], [2], [3]],
    }
    expected_dp_groups = {
        (2, 2): [[0, 2], [1, 3]],
        (4, 1): [[0], [1], [2], [3]],
        (1, 4): [[0, 1, 2, 3]],
    }
    for rank, seen in enumerate(results):
        for (tp, dp), s in seen.items():
            assert s["tp_rank"] == rank % tp and s["dp_rank"] == rank // tp
            tp_group = next(g for g in expected_tp_groups[(tp, dp)] if rank in g)
            dp_group = next(g for g in expected_dp_groups[(tp, dp)] if rank in g)
            assert s["tp_ranks"] == tp_group, (tp, dp, rank)
            assert s["dp_ranks"] == dp_group, (tp, dp, rank)
            assert s["tp_sum"] == sum(tp_group) and s["dp_sum"] == sum(dp_group)
            assert s["sizes"] == (tp, dp, 4) and s["get_is_current"]
            assert s["groups_by_axis"]
            for role, (same, ranks, index, size) in s["roles"].items():
                assert same and ranks == dp_group, (role, tp, dp, rank)
                assert (index, size) == (dp_group.index(rank), dp), (role, tp, dp, rank)


def _bad_sizes() -> list[str]:
    messages = []
    for tp, dp in [(3, None), (2, 3), (0, None), (2, 0), (-1, 2)]:
        with pytest.raises(ValueError) as info:
            parallel_state.initialize(tp, dp)
        messages.append(str(info.value))
        assert not parallel_state.is_initialized()
    parallel_state.initialize(2)  # a valid layout still works afterwards: nothing hung
    return messages


def test_invalid_sizes_fail_before_any_collective():
    messages = run_ranks(_bad_sizes, 4, timeout=60)[0]
    assert "world size 4 is not divisible by tp_size 3" in messages[0]
    assert "2 × 3 = 6 does not equal the world size 4" in messages[1]
    assert "tp_size must be an integer >= 1, got 0" in messages[2]
    assert "dp_size must be an integer >= 1, got 0" in messages[3]
    assert "tp_size must be an integer >= 1, got -1" in messages[4]


def _cross_node(env: dict) -> list[str]:
    import os

    os.environ.update(env)  # as torchrun would set them on a 2-process-per-node job
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_state.initialize(4, 1)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_tp_group_spanning_nodes_warns():
    env = {"LOCAL_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "4"}
    messages = run_ranks(_cross_node, 4, env)
    for m in messages:
        assert len(m) == 1 and "tp_size 4 does not fit in the 2 processes of one node" in m[0]


def test_initialize_takes_the_mesh_value_and_keeps_its_flags():
    ps = parallel_state.initialize(ParallelDims(1, 1, sequence_parallel=True, dp_shard="optimizer"))
    try:
        assert ps.dims == ParallelDims(1, 1, sequence_parallel=True, dp_shard="optimizer")
        roles = {"grad", "batch", "loss", "replica", "expert", "expert_grad", "embedding"}
        roles |= {"fsdp_shard", "fsdp_replicate"}  # HSDP's (one replica here)
        assert set(ps.groups) == {"pp", "dp", "cp", "tp", *roles}
        assert ps.groups["tp"] is ps.tp_group and ps.group("embedding") is None  # pp 1
    finally:
        parallel_state.destroy()


def test_single_process_initialize_and_destroy():
    ps = parallel_state.initialize(1)
    try:
        assert (ps.tp_size, ps.dp_size, ps.rank, ps.world_size) == (1, 1, 0, 1)
        # parallel_state picks NCCL and the first GPU when CUDA is present, else gloo on CPU.
        expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        assert ps.device == expected
        with pytest.raises(RuntimeError, match="already initialized"):
            parallel_state.initialize(1)
    finally:
        parallel_state.destroy()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        parallel_state.get()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {
                "RANK": "5",
                "WORLD_SIZE": "8",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "n0",
                "MASTER_PORT": "1234",
            },
            ("torchrun", 5, 8, 1, 4, "n0", 1234),
        ),
        (
            {
                "SLURM_PROCID": "3",
                "SLURM_NTASKS": "16",
                "SLURM_LOCALID": "3",
                "SLURM_TASKS_PER_NODE": "8(x2)",
                "SLURM_JOB_NODELIST": "gpu[007-008]",
            },
            ("slurm", 3, 16, 3, 8, "gpu007", 29500),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            ("mpi", 2, 4, 2, 4, "127.0.0.1", 29500),
        ),
        ({}, ("none", 0, 1, 0, 1, "127.0.0.1", 29500)),
    ],
)
def test_detect_launch(env, expected):
    info = detect_launch(env)
    got = (
        info.launcher,
        info.rank,
        info.world_size,
        info.local_rank,
        info.local_world_size,
        info.master_addr,
        info.master_port,
    )
    assert got == expected


def test_launcher_errors_and_slurm_nodelist():
    assert first_slurm_host("node12") == "node12"
    assert first_slurm_host("a[3,5-9],b1") == "a3"
    multi_node_mpi = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    with pytest.raises(ValueError, match="needs MASTER_ADDR"):
        detect_launch(multi_node_mpi)
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})


def _dropout_masks(seed: int) -> dict:
    ps = parallel_state.initialize(2, 1)
    ps.seed(seed)
    x = torch.ones(4096)
    replicated = F.dropout(x, 0.5)
    with ps.rng.fork():
        sharded = F.dropout(x, 0.5)
    replicated_after = F.dropout(x, 0.5)
    return {"replicated": replicated, "sharded": sharded, "after": replicated_after}


def test_rng_tracker_streams():
    a0, a1 = run_ranks(_dropout_masks, 2, 11)
    b0, _ = run_ranks(_dropout_masks, 2, 11)
    # Replicated regions: identical masks on every TP rank.
    assert torch.equal(a0["replicated"], a1["replicated"])
    assert torch.equal(a0["after"], a1["after"])
    # Sharded regions: each TP rank its own mask (P[equal] = 2^-4096 for independent masks).
    assert not torch.equal(a0["sharded"], a1["sharded"])
    # Reproducible from one seed.
    for key in a0:
        assert torch.equal(a0[key], b0[key])
    # The fork left the default stream where it was: the draw after it equals the second
    # draw of a plain stream seeded the same way.
    torch.manual_seed(11)
    F.dropout(torch.ones(4096), 0.5)
    assert torch.equal(a0["after"], F.dropout(torch.ones(4096), 0.5))


def test_rng_tracker_snapshot_restore():
    from parallel_state.random import RNGTracker

    tracker = RNGTracker("cpu")
    tracker.seed(3, tp_rank=0)
    states = tracker.get_states()
    with tracker.fork():
        first = torch.rand(8)
    default_first = torch.rand(8)
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.rand(8), first)
    assert torch.equal(torch.rand(8), default_first)
    with pytest.raises(KeyError, match="never seeded"), tracker.fork("other"):
        pass


def test_backend_for_gives_each_rank_a_gpu_or_stays_on_the_cpu(monkeypatch):
    """The one backend rule, on a pretend node with one GPU (and with none): NCCL only
    when every local rank has a GPU of its own (NCCL refuses two ranks on one device)."""
    import torch

    from parallel_state import backend_for

    monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backend_for("auto", 1) == "nccl" and backend_for("auto", None) == "nccl"
    assert backend_for("cpu", 1) == "gloo"
    with pytest.warns(RuntimeWarning, match="4 ranks on this node share 1 GPU"):
        assert backend_for("auto", 4) == "gloo"
    with pytest.raises(ValueError, match="needs a GPU per rank, but 4 ranks on this node see 1"):
        backend_for("cuda", 4)
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")  # each task is shown its own GPU
    assert backend_for("cuda", 4) == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert backend_for("auto", 4) == "gloo"
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        backend_for("cuda", 1)
    with pytest.raises(ValueError, match="trainer.device='tpu' is not one of auto, cuda, cpu"):
        backend_for("tpu", 1)


def test_ranks_by_role_need_no_process_group():
    """``ranks`` answers from the layout alone: at pp 4 × tp 2 the embedding role is the
    first and last stage of a rank's pipeline (hand-listed from the grid view(pp, dp, tp))."""
    from parallel_state.random import RNGTracker

    dims = ParallelDims(2, 1, 4)  # grid[p, 0, t] = 2p + t
    cpu = torch.device("cpu")

    def state(rank: int) -> parallel_state.ParallelState:
        grid = torch.tensor(dims.rank_grid())
        coords = dims.coords_of(rank)
        return parallel_state.ParallelState(dims, rank, coords, {}, cpu, grid, RNGTracker(cpu))

    assert state(0).ranks("embedding") == [0, 6] and state(7).ranks("embedding") == [1, 7]
    assert state(3).ranks("embedding") == []  # a middle stage holds no embedding copy
    assert state(3).ranks("pp") == [1, 3, 5, 7] and state(3).ranks("tp") == [2, 3]
    assert state(5).ranks("grad") == [5] and state(5).rank_in("pp") == 2


def test_a_mesh_used_as_a_context_tears_down_however_the_block_ends():
    with parallel_state.initialize(1) as ps:
        assert parallel_state.get() is ps
    assert not parallel_state.is_initialized()
    with pytest.raises(RuntimeError, match="inside"), parallel_state.initialize(1):
        raise RuntimeError("raised inside the block")
    assert not parallel_state.is_initialized()
    parallel_state.initialize(1).__exit__(None, None, None)  # the plain form still works
    assert not parallel_state.is_initialized()
