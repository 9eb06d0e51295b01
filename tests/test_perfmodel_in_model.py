"""The in-model calibration terms (studies/perfmodel/in_model.py) against real counts and
hand-computed prices.

The collective count is checked on a real 2-rank step (a timer counts every TP collective
the model makes), not against the formula's own code. The prices are hand-computed from
the α-β formulas (ring all-reduce 2(p−1)α + 2n(p−1)/p/bw); tolerance rel 1e-9, float
rounding only.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from studies.perfmodel import Layout, Workload, predict
from studies.perfmodel.cluster_spec import cluster_from_dict
from studies.perfmodel.in_model import (
    lookup,
    nearest,
    parameter_tensors,
    tp_collectives,
)
from studies.perfmodel.in_model_runs import fit_tp
from tests.multiproc import run_ranks
from tests.perfmodel_util import ALPHA, BW, hand_cluster

W = Workload(hidden=128, layers=2, heads=4, vocab=8192, seq=128, global_batch=16, precision="fp32")


class _Counter:
    """A CommTimer that only counts the collectives it is handed."""

    def __init__(self) -> None:
        self.calls = 0

    def begin(self) -> None:
        self.calls += 1

    def end(self, token: None) -> None:
        pass


def _small_gpt(layers: int, **overrides):
    """A 32-wide, 4-head GPT of ``layers`` layers (256 tokens, 16 positions)."""
    from engine.models import ModelConfig

    return ModelConfig(
        arch="gpt",
        vocab_size=256,
        hidden_size=32,
        num_layers=layers,
        num_heads=4,
        max_positions=16,
        **overrides,
    )


def _count_tp_collectives(layers: int, recompute: str) -> int:
    from engine.models import build_model
    from layers.utils import attach_comm_timer

    # dropout 0: it does not change the collectives, and needs no TP-aware RNG tracker here
    cfg = _small_gpt(layers, recompute=recompute, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, tp_group=dist.group.WORLD, device=torch.device("cpu"))
    counter = _Counter()
    attach_comm_timer(model, counter)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return counter.calls


@pytest.mark.slow
@pytest.mark.parametrize("layers,recompute", [(2, "none"), (3, "none"), (2, "full"), (3, "full")])
def test_tp_collective_count_matches_a_real_step(layers, recompute):
    """One micro-batch's forward + backward at tp = 2 makes exactly the collectives the
    model prices (4 per layer, 5 under full recompute, plus embedding, LM-head input and
    the cross-entropy's two): 12 at two layers, 14 with full recompute."""
    counts = run_ranks(_count_tp_collectives, 2, layers, recompute, timeout=120)
    assert counts == [tp_collectives(layers, recompute)] * 2
    assert (tp_collectives(2), tp_collectives(2, "full")) == (12, 14)  # read off real steps


def _ring(n: float, p: int) -> float:
    return 2 * (p - 1) * ALPHA + 2 * n * (p - 1) / p / BW


def test_in_model_tp_cost_replaces_the_alpha_beta_price():
    """tp = 2, micro-batch 4: 16/4 = 4 micro-batches of 12 collectives each. Measured
    1 ms per collective plus 0.5 of the micro-batch's compute at 2 ranks; TP time per
    micro-batch is then 12 ms + 0.5 × (compute per micro-batch), compute unchanged."""
    lay = Layout(2, 1, 4, fused_attention=False)
    cl = hand_cluster(tp=[[2, "ar", 2, 1000.0, 0.5], [2, "ar", 4, 3000.0, 0.0]])
    plain = predict(W, lay, hand_cluster()).breakdown
    got = predict(W, lay, cl).breakdown
    assert got["compute_s"] == pytest.approx(plain["compute_s"], rel=1e-9)
    assert got["tp_comm_s"] == pytest.approx(4 * 12e-3 + 0.5 * got["compute_s"], rel=1e-9)
    # without the measurement: 10 big all-reduces of b·s·h fp32 values, the cross-entropy's
    # row max (b·s fp32) and its stacked [sum of exp; target logit] (2·b·s fp32)
    n, tokens = 4 * 128 * 128 * 4, 4 * 128
    alpha_beta = 10 * _ring(n, 2) + _ring(tokens * 4, 2) + _ring(2 * tokens * 4, 2)
    assert plain["tp_comm_s"] == pytest.approx(4 * alpha_beta, rel=1e-9)
    # tp = 2 beside a second pair (4 ranks on the machine) takes the 4-rank row:
    # 16/(2·4) = 2 micro-batches of 12 collectives at 3 ms
    lay4 = Layout(2, 2, 4, fused_attention=False)
    assert predict(W, lay4, cl).breakdown["tp_comm_s"] == pytest.approx(2 * 12 * 3e-3, rel=1e-9)
    # a TP group across nodes (one rank per node) keeps the α-β price of the network: the
    # in-model terms were measured inside one machine
    spread, spread_plain = replace(cl, gpus_per_node=1), replace(hand_cluster(), gpus_per_node=1)
    assert predict(W, lay, spread).breakdown["tp_comm_s"] == pytest.approx(
        predict(W, lay, spread_plain).breakdown["tp_comm_s"], rel=1e-9
    )
    # sequence parallelism has no "sp" row here: it keeps its α-β price
    sp = Layout(2, 1, 4, sequence_parallel=True, fused_attention=False)
    assert predict(W, sp, cl).breakdown["tp_comm_s"] == pytest.approx(
        predict(W, sp, hand_cluster()).breakdown["tp_comm_s"], rel=1e-9
    )


def test_tp_fit_splits_the_loss_into_its_two_parts():
    """Two runs with losses 12·a + f·c for a = 2 ms, f = 0.25 at c = 10 and 40 ms: the
    exact solution; a fit that would need a negative part puts it all on the collectives."""
    a, f = 2e-3, 0.25
    runs = [(12 * a + f * 0.010, 12, 0.010), (12 * a + f * 0.040, 12, 0.040)]
    assert fit_tp(runs) == pytest.approx((a, f), rel=1e-9)
    falling = [(0.030, 12, 0.010), (0.020, 12, 0.040)]  # more compute, less loss: noise
    assert fit_tp(falling) == pytest.approx((0.025 / 12, 0.0), rel=1e-9)
    assert fit_tp(runs[:1]) == pytest.approx(((12 * a + f * 0.010) / 12, 0.0), rel=1e-9)


def test_in_model_dp_wait_and_optimizer_extra_are_added():
    """The DP wait (keyed by DP size and ranks) is added to the exposed DP time and to the
    total (it is spent inside the collective, so exposed <= total still holds); the
    optimizer's extra per parameter tensor (keyed by ranks) times the 12·2 + 4 = 28
    tensors of a 2-layer GPT to the optimizer; both at the nearest rank count."""
    lay = Layout(1, 2, 4, fused_attention=False)
    cl = hand_cluster(
        dp_wait_us=[[2, 2, 5000.0], [4, 4, 20000.0]],
        optimizer_us_per_tensor=[[1, 10.0], [2, 100.0], [4, 250.0]],
    )
    plain = predict(W, lay, hand_cluster()).breakdown
    got = predict(W, lay, cl).breakdown
    assert got["dp_comm_exposed_s"] == pytest.approx(plain["dp_comm_exposed_s"] + 5e-3, rel=1e-9)
    assert got["dp_comm_total_s"] == pytest.approx(plain["dp_comm_total_s"] + 5e-3, rel=1e-9)
    assert got["dp_comm_exposed_s"] <= got["dp_comm_total_s"]
    for shard in ("full", "gradients"):  # the FSDP pricing takes the same wait
        sharded = replace(lay, dp_shard=shard)
        base = predict(W, sharded, hand_cluster()).breakdown
        waited = predict(W, sharded, cl).breakdown
        assert waited["dp_comm_total_s"] == pytest.approx(base["dp_comm_total_s"] + 5e-3)
        assert waited["dp_comm_exposed_s"] == pytest.approx(base["dp_comm_exposed_s"] + 5e-3)
    assert got["optimizer_s"] == pytest.approx(plain["optimizer_s"] + 28 * 100e-6, rel=1e-9)
    eight = Layout(1, 8, 2, fused_attention=False)  # 8 ranks: no dp=8 row, no wait
    base8 = predict(W, eight, hand_cluster()).breakdown
    got8 = predict(W, eight, cl).breakdown
    assert got8["dp_comm_exposed_s"] == pytest.approx(base8["dp_comm_exposed_s"], rel=1e-9)
    assert got8["optimizer_s"] == pytest.approx(base8["optimizer_s"] + 28 * 250e-6, rel=1e-9)
    four_layers = replace(W, layers=4)  # 12·4 + 4 = 52 tensors
    assert predict(four_layers, lay, cl).breakdown["optimizer_s"] == pytest.approx(
        predict(four_layers, lay, hand_cluster()).breakdown["optimizer_s"] + 52 * 100e-6,
        rel=1e-9,
    )


def test_lookup_takes_the_nearest_rank_count():
    rows = [[2, "ar", 2, 1000.0], [2, "ar", 4, 3000.0], [4, "ar", 4, 6000.0]]
    assert lookup(rows, (2, "ar"), 2) == pytest.approx(1e-3)
    assert lookup(rows, (2, "ar"), 3) == pytest.approx(3e-3)  # a tie goes to more ranks
    assert lookup(rows, (2, "ar"), 16) == pytest.approx(3e-3)
    assert lookup(rows, (4, "ar"), 2) == pytest.approx(6e-3)
    assert lookup(rows, (8, "ar"), 8) is None
    assert lookup(rows, (2, "sp"), 2) is None


def test_parameter_tensor_count_matches_the_model():
    """parameter_tensors against the tensors a real GPT holds (torch counts them)."""
    from engine.models import build_model

    for layers in (2, 4):
        cfg = _small_gpt(layers)
        model = build_model(cfg, device=torch.device("cpu"))
        assert len(list(model.parameters())) == parameter_tensors(layers)


def test_cluster_yaml_in_model_section_round_trips():
    raw = {
        "name": "x",
        "gpus_per_node": 1,
        "intra_node": {"bandwidth_GBps": 1},
        "inter_node": {"bandwidth_Gbps": 8},
        "device": {"peak_tflops": 0.1, "mem_bandwidth_TBps": 0.01, "memory_gib": 16},
        "in_model": {"source": "hand", "tp": [[2, "sp", 2, 2500.0, 0.1]], "runs": [{"run": "tp2"}]},
    }
    cl = cluster_from_dict(raw)
    assert nearest(cl.in_model["tp"], (2, "sp"), 2) == (2, "sp", 2, 2500.0, 0.1)
    assert cluster_from_dict({k: v for k, v in raw.items() if k != "in_model"}).in_model == {}
