"""The planner's newer search axes: the zero-bubble and V pipeline schedules, HSDP replicas
and optimizer offload, checked against hand-derived bytes, seconds and bubble fractions
(torch-free, no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from studies.perfmodel.cluster_spec import CLUSTER_DIR, cluster_from_dict, load_cluster
from studies.perfmodel.model import Layout, Workload, memory_terms, params_per_rank, predict
from studies.perfmodel.plan_cli import build_parser
from studies.perfmodel.search import search

H100 = load_cluster("dgx_h100")  # 8 GPUs a node, 80 GiB each
# A small GPT: pricing one layout takes well under a millisecond.
W = Workload(hidden=1024, layers=8, heads=16, vocab=32000, seq=1024, global_batch=16)
GIB = 2**30
MARGIN = 1.10  # memory_model.FRAGMENTATION on top of the summed terms


@pytest.mark.parametrize("mode", ["optimizer", "gradients", "full"])
def test_offload_removes_exactly_the_optimizer_state(mode):
    lay = Layout(tp=1, dp=8, micro_batch=1, dp_shard=mode)
    on, off = memory_terms(W, lay), memory_terms(W, replace(lay, offload="optimizer"))
    p = params_per_rank(W, 1)
    # bf16 under every sharded mode: fp32 master + two fp32 moments = 12 B a parameter, 1/8 each
    assert on.optimizer == pytest.approx(p * 12 / 8, rel=1e-12)  # float sums only
    assert off.optimizer == 0.0
    assert (off.weights, off.gradients, off.activations) == (
        on.weights,
        on.gradients,
        on.activations,
    )
    saved = (
        predict(W, lay, H100).memory_gib_per_gpu
        - predict(W, replace(lay, offload="optimizer"), H100).memory_gib_per_gpu
    )
    assert saved == pytest.approx(p * 12 / 8 * MARGIN / GIB, rel=1e-9)


def test_offload_step_pays_the_host_link_and_cpu_adam():
    lay = Layout(tp=1, dp=8, micro_batch=1, dp_shard="optimizer", offload="optimizer")
    shard = params_per_rank(W, 1) / 8
    # by hand at the documented defaults: fp32 gradients down + bf16 parameters up at
    # 64 GB/s, Adam over 12 B of state a parameter at 4 GB/s
    expected = shard * (4 + 2) / 64e9 + shard * 12 / 4e9
    assert predict(W, lay, H100).breakdown["optimizer_s"] == pytest.approx(expected, rel=1e-12)
    raw = yaml.safe_load((CLUSTER_DIR / "dgx_h100.yaml").read_text())
    raw.update(name="slow_host", host={"link_GBps": 16, "adam_GBps": 1})
    slow = cluster_from_dict(raw)
    expected = shard * 6 / 16e9 + shard * 12 / 1e9
    assert predict(W, lay, slow).breakdown["optimizer_s"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match=r"slow_host\.host\.link_GBps=0 must be"):
        cluster_from_dict({**raw, "host": {"link_GBps": 0}})


def test_hsdp_shard_memory_is_full_sharding_over_dp_over_r():
    hsdp = memory_terms(W, Layout(tp=1, dp=8, micro_batch=1, dp_shard="full", dp_replicate=2))
    four = memory_terms(W, Layout(tp=1, dp=4, micro_batch=1, dp_shard="full"))
    assert (hsdp.weights, hsdp.gradients, hsdp.optimizer) == (
        four.weights,
        four.gradients,
        four.optimizer,
    )
    p = params_per_rank(W, 1)
    # ZeRO-3 over the replica's 8 ÷ 2 = 4 ranks: 4 B gradients + 12 B state, ÷ 4
    assert hsdp.gradients + hsdp.optimizer == pytest.approx(p * 16 / 4, rel=1e-12)


def test_search_tries_hsdp_at_the_nodes_a_dp_group_spans():
    only = {"pp": (1,), "dp_shard": ("full",), "recompute": ("none",)}
    res = search(W, H100, 16, micro_batch=1, only=only)
    # tp 1, dp 16 spans 2 nodes of 8: R = 2 (8 shards a node), and R = 1
    replicas = {c.layout.dp_replicate for c in res.feasible if c.layout.tp == 1}
    assert replicas == {1, 2}
    # dp 9 spans 2 nodes (8 + 1): R = 2 does not divide it, and the search says so
    w9 = replace(W, global_batch=18)
    res = search(w9, H100, 9, micro_batch=1, only=only)
    reasons = [r.reason for r in res.rejected if r.option == "dp_replicate=2"]
    assert reasons == ["does not divide: dp_replicate=2 does not divide dp=9"]


def _bubble(c) -> float:
    b = c.prediction.breakdown
    return b["pp_bubble_s"] / (b["compute_s"] + b["pp_p2p_s"])  # tp 1: busy = compute + p2p


def test_search_picks_a_v_schedule_where_the_bubble_says_so():
    # pp 4, m = 16 micro-batches of 1, equal f, b, w: 1F1B's bubble 3/16, interleaved (v 2)
    # 3/32, ZB-H1 3/48, ZB-V and DualPipeV 3/96; the hand-offs are NVLink-small at this size
    res = search(W, H100, 4, micro_batch=1, only={"pp": (4,), "recompute": ("none",)})
    best = res.feasible[0]
    assert best.layout.schedule in ("zbv", "dualpipev") and best.layout.virtual_stages == 2
    assert _bubble(best) == pytest.approx(3 / 96, rel=1e-9)  # float sums only
    one = next(c for c in res.feasible if c.layout.schedule == "1f1b")
    assert _bubble(one) == pytest.approx(3 / 16, rel=1e-9)
    assert one.prediction.tokens_per_s < best.prediction.tokens_per_s


def test_search_lists_the_schedules_it_rejects_with_the_runtime_rules():
    only = {"pp": (4,), "recompute": ("none",)}
    # m = 4 < 2·pp: DualPipeV needs 8 micro-batches a step (engine.pipeline.split)
    res = search(replace(W, global_batch=4), H100, 4, micro_batch=1, only=only)
    why = {r.option: r.reason for r in res.rejected}
    assert (
        "needs at least 2 × pp_size=4 = 8 micro-batches per step, got 4"
        in why["schedule=dualpipev"]
    )
    assert all(c.layout.schedule != "dualpipev" for c in res.feasible)
    # 12 layers do not cut into the V's 2 × 4 stages
    res = search(replace(W, layers=12), H100, 4, micro_batch=1, only=only)
    why = {r.option: r.reason for r in res.rejected}
    for v in ("zbv", "dualpipev"):
        assert "layers=12 is not divisible by 8 stage chunks" in why[f"schedule={v}"]
    # the split-backward schedules do not run under ZeRO-3 yet
    res = search(W, H100, 8, micro_batch=1, only={**only, "dp_shard": ("full",)})
    why = {r.option: r.reason for r in res.rejected if r.option}
    for s in ("schedule=zero_bubble v=1", "schedule=zbv", "schedule=dualpipev"):
        assert "dp_shard=full is not built yet" in why[s]
    assert {c.layout.schedule for c in res.feasible} == {"1f1b", "interleaved_1f1b"}


def test_a_model_that_fits_only_offloaded_is_found_offloaded():
    only = {"pp": (1,), "recompute": ("full",)}
    roomy = 1e6  # GiB: everything fits; the smallest on-device and offloaded footprints
    on = search(W, H100, 2, memory_gib=roomy, micro_batch=1, only={**only, "offload": ("none",)})
    off = search(
        W, H100, 2, memory_gib=roomy, micro_batch=1, only={**only, "offload": ("optimizer",)}
    )
    least_on = min(c.prediction.memory_gib_per_gpu for c in on.feasible)
    least_off = min(c.prediction.memory_gib_per_gpu for c in off.feasible)
    assert least_off < least_on
    limit = (least_on + least_off) / 2
    without = search(
        W, H100, 2, memory_gib=limit, micro_batch=1, only={**only, "offload": ("none",)}
    )
    assert not without.feasible
    assert all("does not fit" in r.reason for r in without.rejected)
    found = search(W, H100, 2, memory_gib=limit, micro_batch=1, only=only)
    assert found.feasible and all(c.layout.offload == "optimizer" for c in found.feasible)
    assert all(c.layout.dp_shard != "none" for c in found.feasible)
    # the same modes on the device are listed as rejected, and why
    misses = [r for r in found.rejected if r.option == "offload=none"]
    assert misses and all("does not fit" in r.reason for r in misses)


def test_search_help_names_the_new_axes():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["search"].format_help()
    for word in ("zero_bubble", "zbv", "dualpipev", "dp_replicate", "--offload", "host link"):
        assert word in text


def test_each_ranked_layouts_step_shares_sum_to_100_and_track_the_breakdown():
    """The search's "compute 94%, TP comm 6%, ..." of every feasible layout (pp, tp, dp,
    schedules, offload): the printed whole percents sum to 100, each within a point of its
    part's exact share of the step. Rounded one by one they printed 99 % (README's tp 2
    row: 94 + 5 + 0 + 0) or 101 %."""
    names = {
        "compute": "compute_s",
        "TP comm": "tp_comm_s",
        "CP exposed": "cp_comm_exposed_s",
        "EP all-to-all": "ep_a2a_s",
        "PP bubble": "pp_bubble_s",
        "p2p": "pp_p2p_s",
        "DP exposed": "dp_comm_exposed_s",
        "optimizer": "optimizer_s",
    }
    result = search(W, H100, 16)
    assert len(result.feasible) > 20
    for cand in result.feasible:
        printed = cand.reason.split("; ", 1)[1]
        shares = dict(part.rsplit(" ", 1) for part in printed.split(", "))
        percents = {name: int(pct.rstrip("%")) for name, pct in shares.items()}
        assert sum(percents.values()) == 100, printed
        b, step = cand.prediction.breakdown, cand.prediction.step_time_s
        for name, pct in percents.items():
            assert abs(pct - 100 * b[names[name]] / step) < 1, (name, printed)


def _shared(memory_gib: float) -> object:
    """dgx_h100 with its memory declared the node's, shared by its 8 ranks (a CPU host)."""
    raw = yaml.safe_load((CLUSTER_DIR / "dgx_h100.yaml").read_text())
    raw.update(name="host")
    raw["device"] = {**raw["device"], "memory_gib": memory_gib, "memory_shared": True}
    return cluster_from_dict(raw)


def test_a_shared_memory_node_splits_its_memory_over_its_ranks():
    """``device.memory_shared`` (what tools/calibrate.py writes for a CPU host): before, a
    CPU spec's whole RAM counted as each rank's, so 16 ranks of 15.6 GiB "fit" 23.5 GiB.
    By hand: a rank holds the node's memory over min(gpus, gpus_per_node) ranks."""
    host = _shared(16.0)
    assert host.rank_memory_bytes(4) == 4 * GIB
    assert host.rank_memory_bytes(8) == host.rank_memory_bytes(64) == 2 * GIB
    assert H100.rank_memory_bytes(4) == H100.rank_memory_bytes(64) == 80 * GIB
    res = search(W, host, 4, micro_batch=1, only={"offload": ("none",)})
    fits = [c.prediction.memory_gib_per_gpu for c in res.feasible]
    assert fits and max(fits) <= 4.0
    # the same search over the device-memory reading keeps layouts above a rank's share
    loose = search(W, _unshared(16.0), 4, micro_batch=1, only={"offload": ("none",)})
    assert max(c.prediction.memory_gib_per_gpu for c in loose.feasible) > 4.0
    with pytest.raises(ValueError, match=r"host\.device\.memory_shared='yes' must be true"):
        raw = yaml.safe_load((CLUSTER_DIR / "dgx_h100.yaml").read_text())
        cluster_from_dict(
            {**raw, "name": "host", "device": {**raw["device"], "memory_shared": "yes"}}
        )


def _unshared(memory_gib: float) -> object:
    raw = yaml.safe_load((CLUSTER_DIR / "dgx_h100.yaml").read_text())
    raw["device"] = {**raw["device"], "memory_gib": memory_gib}
    return cluster_from_dict(raw)


def test_plan_on_a_shared_memory_node_notes_the_share_and_refuses_offload(capsys):
    """``plan.py predict`` on the calibrated CPU spec: a layout over a rank's share is
    noted as such (23.5 GiB over 16 ranks), and --offload optimizer, which would move the
    state within the memory it is counted against, is one line."""
    from studies.perfmodel.plan_cli import main

    cpu = load_cluster("cpu_2core")
    assert cpu.memory_shared and cpu.gpus_per_node >= 16
    argv = ["predict", "--model", "gpt_1.3b", "--global-batch", "512", "--gpus", "16"]
    assert main([*argv, "--tp", "2", "--cluster", "cpu_2core"]) == 0
    share = cpu.memory_bytes / 16 / GIB
    assert (
        f"GiB/GPU over the {share:.1f} GiB each of 16 rank(s) has of a cpu_2core node's shared "
        f"{cpu.memory_bytes / GIB:.1f} GiB" in capsys.readouterr().out
    )
    argv += ["--dp-shard", "full", "--offload", "optimizer", "--cluster", "cpu_2core"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "plan: --offload optimizer moves optimizer state to host memory, which on cpu_2core "
        "is the memory its ranks already share (device.memory_shared); drop --offload\n"
    )
