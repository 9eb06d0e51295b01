"""Hybrid sharding (HSDP, ``parallel.dp_replicate``): dp 4 = 2 replicas × 2 FSDP shards
against the unsplit reference and plain FSDP, what each rank holds, checkpoints between
hybrid and the all-reduce, and the config's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parallel_state
from layers.utils import dp_sharded, local_part
from parallel_state.dims import ParallelDims
from tests.multiproc import run_ranks
from tests.test_fsdp import (
    CFG,
    _reference,
    _rel,
    _train,
    _unsplit,
    checkpoint_run_configs,
    resumes_against_saved,
)

R, DP = 2, 4  # 2 replicas of 2 shards


def _held(ps, model, out: dict) -> None:
    """Per parameter: its local numel and whole numel, the mesh it is placed on, and
    whether the other replica holds the very same shard (replicate group) while the other
    rank of this replica holds a different one (shard group)."""
    replicate, shard = ps.group("fsdp_replicate"), ps.group("fsdp_shard")
    rows = []
    for name, p in model.named_parameters():
        mine = local_part(p.detach()).contiguous()
        across = [torch.empty_like(mine) for _ in range(R)]
        dist.all_gather(across, mine, group=replicate)
        within = [torch.empty_like(mine) for _ in range(DP // R)]
        dist.all_gather(within, mine, group=shard)
        rows.append(
            {
                "name": name,
                "sharded": dp_sharded(p),
                "mesh": tuple(p.device_mesh.shape) if dp_sharded(p) else None,
                "local": mine.numel(),
                "whole": p.numel(),
                "replicated": all(torch.equal(t, mine) for t in across),
                "distinct": not torch.equal(within[0], within[1]),
            }
        )
    out["params"] = rows


def _hybrid_vs_reference() -> dict:
    ps = parallel_state.initialize(ParallelDims(1, DP, dp_shard="full", dp_replicate=R))
    torch.manual_seed(0)
    initial = _unsplit(torch.float64).full_state_dict()
    ref_losses, ref = _reference(initial)
    held: dict = {}
    groups = (ps.group("fsdp_shard"), ps.group("fsdp_replicate"))
    runs = {
        "hybrid": _train(
            ps,
            "full",
            CFG,
            initial,
            dtype=torch.float64,
            hybrid_groups=groups,
            after=lambda model, _: _held(ps, model, held),
        ),
        "full": _train(ps, "full", CFG, initial, dtype=torch.float64),
        "hybrid_zero2": _train(
            ps, "gradients", CFG, initial, dtype=torch.float64, hybrid_groups=groups
        ),
    }
    out = {
        "groups": (ps.ranks("fsdp_shard"), ps.ranks("fsdp_replicate")),
        "held": held["params"],
    }
    (hyb_losses, hyb, _), (full_losses, full, _), (z2_losses, z2, _) = runs.values()
    out["vs_reference"] = {
        "loss": max(abs(a - b) / b for a, b in zip(hyb_losses, ref_losses, strict=True)),
        "params": max(_rel(hyb[n], w) for n, w in ref.items()),
    }
    out["zero2_vs_reference"] = {
        "loss": max(abs(a - b) / b for a, b in zip(z2_losses, ref_losses, strict=True)),
        "params": max(_rel(z2[n], w) for n, w in ref.items()),
    }
    out["vs_full"] = {
        "loss": max(abs(a - b) / b for a, b in zip(hyb_losses, full_losses, strict=True)),
        "params": max(_rel(hyb[n], w) for n, w in full.items()),
    }
    parallel_state.destroy()
    return out


@pytest.mark.slow
def test_hybrid_2x2_matches_the_unsplit_reference_and_shards_2_way():
    """fp64, dp 4 = 2 replicas × 2 shards (tp 1), 5 steps of 2 accumulation micro-batches
    (test_fsdp's loop and reference): the losses and final weights equal the unsplit model
    under torch's AdamW and clip_grad_norm_ within test_fsdp's 1e-10 (only summation
    orders differ), and plain FSDP over all 4 ranks within the same; so does hybrid
    ZeRO-2 (dp_shard=gradients, parameters kept gathered over the micro-batches). Measured
    here: losses 1.4e-16 and weights 3.5e-13 from the reference, 2.6e-13 from plain FSDP. Every parameter is a
    DTensor on a (2, 2) mesh holding exactly half its elements (every dim 0 here is even,
    so FSDP pads nothing), the same half as the other replica's rank and a different half
    from the other rank of its own replica."""
    for rank, res in enumerate(run_ranks(_hybrid_vs_reference, DP, timeout=300)):
        print(
            f"rank {rank}: groups {res['groups']} ref {res['vs_reference']} full {res['vs_full']}"
        )
        shard, replicate = res["groups"]
        assert shard == [rank // 2 * 2, rank // 2 * 2 + 1] and replicate == [rank % 2, rank % 2 + 2]
        print(f"rank {rank}: hybrid ZeRO-2 vs reference {res['zero2_vs_reference']}")
        for which in ("vs_reference", "zero2_vs_reference", "vs_full"):
            r = res[which]
            assert r["loss"] <= 1e-10 and r["params"] <= 1e-10, (rank, which, r)
        for p in res["held"]:
            assert p["sharded"] and p["mesh"] == (R, DP // R), (rank, p)
            assert 2 * p["local"] == p["whole"], (rank, p)
            assert p["replicated"] and p["distinct"], (rank, p)


def _one_replica_vs_plain() -> dict:
    ps = parallel_state.initialize(ParallelDims(1, 2, dp_shard="full"))
    torch.manual_seed(0)
    initial = _unsplit(torch.float64).full_state_dict()
    groups = (ps.group("fsdp_shard"), ps.group("fsdp_replicate"))
    one = _train(ps, "full", CFG, initial, dtype=torch.float64, hybrid_groups=groups)
    plain = _train(ps, "full", CFG, initial, dtype=torch.float64)
    parallel_state.destroy()
    return {
        "losses_equal": one[0] == plain[0],
        "params_equal": all(torch.equal(one[1][n], w) for n, w in plain[1].items()),
    }


@pytest.mark.slow
def test_one_replica_is_plain_fsdp_bit_for_bit():
    """dp_replicate=1 (the default; the trainer passes the hybrid roles, whose replicate
    groups are then single ranks) trains exactly as plain FSDP: torch.equal losses and
    weights after 5 steps at dp 2."""
    for r in run_ranks(_one_replica_vs_plain, 2, timeout=300):
        assert r == {"losses_equal": True, "params_equal": True}, r


def _hybrid_checkpoints(cfgs: dict) -> dict:
    """Save under hybrid (2 × 2) at step 3; resume under dp_shard=none at dp 4, which saves
    step 5; resume that under hybrid again (the reverse)."""
    from engine.config import parallel_dims
    from engine.trainer import Trainer
    from tests.test_checkpoint import _gathered_moments

    def trainer(cfg):
        parallel_state.destroy()
        return Trainer(cfg, parallel_state.initialize(parallel_dims(cfg, DP)))

    saver = trainer(cfgs["save"])
    saver.fit()
    saved = {3: (saver.model.full_state_dict(), _gathered_moments(saver))}
    out = {"saver": {"mode": type(saver.dp).__name__, "mesh": tuple(saver.dp.mesh.shape)}}
    out |= resumes_against_saved(trainer, cfgs, ("none", "back"), saved, saves_step_5="none")
    parallel_state.destroy()
    return out


@pytest.mark.slow
def test_checkpoints_move_between_hybrid_and_none_exactly(tmp_path):
    """Saved under hybrid (dp 4 = 2 × 2, ZeRO-3 shards) at step 3 and resumed under
    dp_shard=none at dp 4: parameters and Adam moments torch.equal to what the hybrid run
    held (the checkpoint gathers each DTensor to its TP-local whole, the path plain FSDP
    takes); that run saves step 5 and hybrid resumes it exactly too."""
    config = checkpoint_run_configs(tmp_path, "tp_size=1", f"dp_size={DP}")

    def at(mode: str, replicas: int, steps: int, every: int = 0):
        layout = (f"parallel.dp_shard={mode}", f"parallel.dp_replicate={replicas}")
        return config(*layout, steps=steps, every=every)

    cfgs = {"save": at("full", R, 3, every=3), "none": at("none", 1, 5, every=5)}
    cfgs["back"] = at("full", R, 6)
    out = run_ranks(_hybrid_checkpoints, DP, cfgs, timeout=600)[0]
    print(out)
    assert out["saver"] == {"mode": "FullyShardedDP", "mesh": (R, DP // R)}
    assert out["none"]["mode"] == "AllReduceDP" and out["back"]["mode"] == "FullyShardedDP"
    for name in ("none", "back"):
        r = out[name]
        assert r["params_equal"] and r["moments_equal"], (name, r)
        assert r["step"] == (3 if name == "none" else 5), (name, r)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("parallel.dp_shard=full", "parallel.dp_replicate=3"),
            "parallel.dp_replicate=3 does not divide dp_size=4 (each replica is dp_size ÷ "
            "dp_replicate shards); choose a dp_replicate dividing 4",
        ),
        (
            ("parallel.dp_replicate=2",),
            "parallel.dp_replicate=2 replicates FSDP's shards, and parallel.dp_shard=none is not "
            "FSDP; set parallel.dp_shard=full (or gradients), or parallel.dp_replicate=1",
        ),
        (
            ("parallel.dp_shard=optimizer", "parallel.dp_replicate=2"),
            "parallel.dp_replicate=2 replicates FSDP's shards, and parallel.dp_shard=optimizer "
            "is not FSDP",
        ),
        (
            ("parallel.dp_shard=full", "parallel.dp_replicate=0"),
            "parallel.dp_replicate must be an integer >= 1, got 0; set parallel.dp_replicate "
            "to the HSDP replicas (1: none)",
        ),
    ],
    ids=["not_dividing_dp", "dp_shard_none", "dp_shard_optimizer", "zero"],
)
def test_a_bad_dp_replicate_is_refused_before_any_worker(
    overrides, message, capsys, tmp_path, monkeypatch
):
    """One line naming the value and the fix, exit 2, nothing started or written."""
    from engine.pretrain import prepare
    from tests.test_engine import compose_config

    monkeypatch.chdir(tmp_path)
    cfg = compose_config("tp_size=1", "dp_size=4", *overrides)
    with pytest.raises(SystemExit) as exit_info:
        prepare(cfg)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not any(tmp_path.iterdir())


def test_hybrid_roles_cut_the_grad_groups_into_replicas_of_neighbours():
    """The roles alone (no ranks): at tp 2 × dp 4 × cp 2 with 2 replicas each grad group
    of 8 is cut into 2 runs of 4 neighbours (the shard groups, whole cp pairs), and the
    replicate groups pair the ranks 4 apart in it; at R 1 the shard group is the grad group."""
    d = ParallelDims(2, 4, cp=2, dp_shard="full", dp_replicate=2)
    assert d.group_ranks("grad")[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert d.group_ranks("fsdp_shard")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.group_ranks("fsdp_replicate")[:2] == [[0, 8], [1, 9]]
    assert (d.size_of("fsdp_shard"), d.size_of("fsdp_replicate")) == (4, 2)
    plain = ParallelDims(1, 4, dp_shard="full")
    assert plain.group_ranks("fsdp_shard") == plain.group_ranks("grad")
    assert plain.group_ranks("fsdp_replicate") == [[r] for r in range(4)]


def test_the_preflight_shards_hsdp_state_over_one_replica():
    """The memory check's estimate under dp 4 = 2 × 2 (full) is ZeRO-3's at dp 2: 16/2
    bytes per parameter (4/2 gradients, 12/2 master and moments), not 16/4."""
    import dataclasses

    from engine import preflight
    from engine.config import Config

    def at(dp: int, replicas: int):
        cfg = Config(tp_size=1, dp_size=dp)
        parallel = dataclasses.replace(cfg.parallel, dp_shard="full", dp_replicate=replicas)
        cfg = dataclasses.replace(cfg, parallel=parallel)
        return preflight.estimate_rank_bytes(cfg, dp, fp32_activations=True)

    hybrid, two, four = at(4, 2), at(2, 1), at(4, 1)
    assert (hybrid.grads, hybrid.optimizer) == (two.grads, two.optimizer)
    assert hybrid.optimizer == 2 * four.optimizer and hybrid.grads == 2 * four.grads
