"""Mixture-of-experts observability (engine/moe_observe.py) and MoE model FLOPs.

The load figures are checked against counts made here from the router's own weights with
``torch.topk`` (not the router's ``stable_top_k``), the CV against std / mean written out
with the population std (÷ E), the dropped fraction against the per-expert overflow
max(0, c_e − C) at capacity factor 1.0, and moe_tiny's FLOPs against the arithmetic
written out below.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import flops
from engine.formulas import moe_mlp_forward_flops
from engine.moe_observe import MoEWindow, format_moe_line, load_cv, moe_scalars
from engine.trainer import model_groups
from layers.moe import MoEMLP, moe_losses
from parallel_state.dims import ParallelDims
from tests.moe_util import EXPERTS, H, moe_tiny_run
from tests.moe_util import moe_cfg as _cfg


class TwoLayers(nn.Module):
    """Two MoE MLPs named as a model's layers (``layers.0.mlp``, ``layers.1.mlp``)."""

    def __init__(self, cfg, tp_group=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"mlp": MoEMLP(cfg, tp_group=tp_group)}) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> None:
        for layer in self.layers:
            layer["mlp"](x)


def _hand_slots(router, tokens: torch.Tensor) -> torch.Tensor:
    """Token-slots per expert from ``torch.topk`` of the router's softmax (fp32)."""
    probs = F.linear(tokens.float(), router.weight.float()).softmax(-1)
    chosen = torch.topk(probs, router.top_k, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=router.num_experts)


def _batches(seed: int, count: int, tokens: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, 1, H, generator=g) for _ in range(count)]


def test_load_figures_are_the_hand_counts_of_the_routers_top_k():
    model = TwoLayers(_cfg())
    window = MoEWindow(model, torch.device("cpu"))
    assert window.layers == [0, 1] and window.num_experts == EXPERTS
    steps = [_batches(1, 2), _batches(2, 2)]  # two steps of two micro-batches of 24 tokens
    hand = torch.zeros(2, EXPERTS, dtype=torch.int64)
    aux, z = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for micro_batches in steps:
            for x in micro_batches:
                model(x)
                window.add(moe_losses(model))
                for i, layer in enumerate(model.layers):
                    router = layer["mlp"].router
                    hand[i] += _hand_slots(router, x.reshape(-1, H))
                    aux[i] += router.last_losses.aux.double()
                    z[i] += router.last_losses.z.double()
            window.end_step()
    layers = window.close(None, step=2)
    assert [one["layer"] for one in layers] == [0, 1]
    for i, one in enumerate(layers):
        counts = hand[i].double()
        assert counts.sum() == 4 * 24 * 2  # 4 forwards × 24 tokens × k=2 slots
        assert one["chosen_slots"] == counts.sum()
        per_step = counts / 2  # the window held 2 steps
        assert one["min_tokens"] == per_step.min() and one["max_tokens"] == per_step.max()
        # CV = population std / mean: sqrt(Σ (c_e − mean)² / E) / mean.
        mean = counts.sum().item() / EXPERTS
        std = math.sqrt(sum((c - mean) ** 2 for c in counts.tolist()) / EXPERTS)
        assert one["cv"] == pytest.approx(std / mean, rel=1e-12)
        assert one["cv"] > 0  # random routing is not perfectly balanced
        assert one["dropped"] == 0.0 and one["dropped_slots"] == 0  # dropless
        assert one["aux"] == pytest.approx(aux[i].item() / 4, rel=1e-12)
        assert one["z"] == pytest.approx(z[i].item() / 4, rel=1e-12)
    # The window starts afresh and keeps what it reported for the metrics file.
    assert window.forwards == window.steps == 0 and not window.slots.any()
    assert window.history == [{"step": 2, "layers": layers}]


def test_dropped_fraction_is_the_overflow_past_capacity_factor_one():
    model = TwoLayers(_cfg(moe_capacity_factor=1.0))
    with torch.no_grad():  # tilt routing towards expert 0, so that it overflows
        for layer in model.layers:
            layer["mlp"].router.weight[0] += 0.5
    window = MoEWindow(model, torch.device("cpu"))
    x = _batches(3, 1, tokens=30)[0] + 1.0  # a positive mean: row 0's + 0.5 raises its logit
    with torch.no_grad():
        model(x)
    window.add(moe_losses(model))
    window.end_step()
    layers = window.close(None, step=1)
    limit = math.ceil(1.0 * 30 * 2 / EXPERTS)  # C = ⌈factor · T · k / E⌉ = 10
    for layer, one in zip(model.layers, layers, strict=True):
        counts = _hand_slots(layer["mlp"].router, x.reshape(-1, H))
        overflow = sum(max(0, c - limit) for c in counts.tolist())
        assert overflow > 0
        assert one["dropped_slots"] == overflow
        assert one["dropped"] == pytest.approx(overflow / (30 * 2), rel=1e-12)
        assert one["max_tokens"] == counts.max()  # counted before dropping
    line = format_moe_line(layers)
    total = sum(one["dropped_slots"] for one in layers) / 120
    assert line.endswith(f"dropped {100 * total:.1f}%")


def _route_on_two_ranks() -> tuple[list[dict], torch.Tensor]:
    """One rank's window over its own batch, closed over both ranks; its own hand counts."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # tp 1 each
    model = TwoLayers(_cfg(), singles[dist.get_rank()])  # the same weights on both (seed 0)
    window = MoEWindow(model, torch.device("cpu"))
    (x,) = _batches(10 + dist.get_rank(), 1)
    with torch.no_grad():
        model(x)
    window.add(moe_losses(model))
    window.end_step()
    hand = torch.stack(
        [_hand_slots(layer["mlp"].router, x.reshape(-1, H)) for layer in model.layers]
    )
    return window.close(dist.group.WORLD, step=1), hand


@pytest.mark.slow
def test_counts_are_summed_over_the_ranks_that_route():
    from tests.multiproc import run_ranks

    (layers0, hand0), (layers1, hand1) = run_ranks(_route_on_two_ranks, 2)
    assert layers0 == layers1  # every rank of the group gets the global figures
    for i, one in enumerate(layers0):
        counts = (hand0[i] + hand1[i]).double()  # the global batch: both ranks' tokens
        assert one["chosen_slots"] == counts.sum() == 2 * 24 * 2
        assert (one["min_tokens"], one["max_tokens"]) == (counts.min(), counts.max())
        assert one["cv"] == pytest.approx(load_cv(counts), rel=1e-12)


def test_load_cv_uses_the_population_std():
    assert load_cv(torch.tensor([2, 2, 2, 2])) == 0.0
    # mean 2, deviations ±1: population std 1 (the sample std would be √(4/3)).
    assert load_cv(torch.tensor([1, 3, 1, 3])) == pytest.approx(0.5)
    assert load_cv(torch.zeros(4)) == 0.0


def test_the_console_line_and_the_scalars_aggregate_layers():
    layers = [
        dict(
            layer=0,
            aux=0.02,
            z=0.0004,
            cv=0.10,
            min_tokens=41,
            max_tokens=60,
            dropped=0.0,
            dropped_slots=0,
            chosen_slots=400,
        ),
        dict(
            layer=1,
            aux=0.04,
            z=0.0006,
            cv=0.14,
            min_tokens=45,
            max_tokens=63,
            dropped=0.05,
            dropped_slots=20,
            chosen_slots=400,
        ),
    ]
    assert format_moe_line(layers) == (
        "moe: aux 0.0300 z 0.0005 load cv 0.12 (min 41 max 63 tokens/expert) dropped 2.5%"
    )
    scalars = moe_scalars(layers)
    assert scalars["moe/layer1/cv"] == 0.14 and scalars["moe/layer0/max_tokens"] == 60
    assert len(scalars) == 12


def test_moe_tiny_flops_count_active_parameters():
    from tests.test_engine import compose_config

    cfg = compose_config("model=moe_tiny").model
    batch, seq = 16, 128
    # moe_tiny: h 128, 2 layers, 4 query heads of 32, 2 KV heads (K/V width 64), vocabulary
    # 8192 (padded 8192), both MLPs MoE: E 4, top-2, SwiGLU experts of width 176.
    # Per token and layer, forward, 2 FLOPs per multiply-accumulate:
    q_out = 2 * (2 * 128 * 128)  # query and output projections: 65536
    kv = 2 * (2 * 128 * 64)  # key and value projections: 32768
    attention = 4 * seq * 128  # QKᵀ and scores·V against all 128 positions: 65536
    router = 2 * 128 * 4  # the router GEMM h×E: 1024
    experts = 2 * 2 * (3 * 128 * 176)  # 2 experts × SwiGLU's 3 matrices h×176: 270336
    layer = q_out + kv + attention + router + experts  # 435200
    head = 2 * 128 * 8192  # LM head: 2097152
    per_token = 3 * (2 * layer + head)  # forward + backward: 8902656
    assert per_token == 8902656
    assert flops.model_flops(cfg, batch, seq) == batch * seq * per_token
    # The dense MLP it replaced (ffn 352, 3 matrices) would have counted 2·3·128·352 per
    # token and layer: the difference is exactly the experts' and router's.
    dense = dataclasses.replace(cfg, mlp="dense")
    diff = 3 * 2 * (router + experts - 2 * 3 * 128 * 352)
    assert flops.model_flops(cfg, batch, seq) - flops.model_flops(dense, batch, seq) == (
        batch * seq * diff
    )
    # Recomputation: 4 layer passes; moe_layer_freq 2: only layer 1 has experts.
    recompute = 4 * (2 * layer + 0) + 3 * head
    assert flops.model_flops(cfg, batch, seq, recompute=True) == batch * seq * recompute
    half = dataclasses.replace(cfg, moe_layer_freq=2)
    mixed = 3 * (2 * layer - router - experts + 2 * 3 * 128 * 352 + head)
    assert flops.model_flops(half, batch, seq) == batch * seq * mixed


def test_shared_expert_and_gate_flops():
    # Qwen2-MoE style: + a shared SwiGLU expert of width 64 and its h×1 sigmoid gate.
    got = moe_mlp_forward_flops(
        10, 16, num_experts=8, top_k=2, expert_ffn=12, matrices=3, shared_ffn=64, shared_gate=True
    )
    assert got == 2 * 10 * (16 * 8 + 2 * 3 * 16 * 12 + 3 * 16 * 64 + 16)


def test_the_watchdog_names_the_expert_group_of_the_ep_all_to_alls():
    dims = ParallelDims(1, 4, ep=2)
    ps = SimpleNamespace(dims=dims, size=dims.size_of)
    assert model_groups(ps) == ("grad", "expert")
    assert dims.live_axes(*model_groups(ps)) == ["dp", "expert"]
    one = ParallelDims(1, 4)  # no ep: as before
    assert model_groups(SimpleNamespace(dims=one, size=one.size_of)) == ("grad",)
    assert one.live_axes("grad") == ["dp"] and ParallelDims(1, 1).live_axes("grad") == ["dp"]


@pytest.mark.slow
def test_pretrain_moe_tiny_prints_the_moe_line(tmp_path):
    from tests.corpus import build_test_corpus
    from tests.launch_util import run_pretrain

    (tmp_path / "corpus").mkdir()
    prefix, tokenizer = build_test_corpus(tmp_path / "corpus")
    metrics = tmp_path / "m.json"
    out = run_pretrain(
        [
            *moe_tiny_run(prefix, tokenizer, 4),
            "trainer.log_every=2",
            "checkpoint.every=0",
            "checkpoint.save_final=false",
            f"trainer.metrics_file={metrics}",
        ],
        tmp_path,
        300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    pattern = re.compile(
        r"moe: aux \d+\.\d{4} z \d+\.\d{4} load cv \d+\.\d{2} "
        r"\(min \d+ max \d+ tokens/expert\) dropped 0\.0%"
    )
    moe = [i for i, line in enumerate(lines) if line.startswith("moe:")]
    assert len(moe) == 2, out.stdout
    for i, step in zip(moe, (2, 4), strict=True):
        assert pattern.fullmatch(lines[i]), lines[i]
        assert lines[i - 1].startswith(f"step     {step}/4"), lines[i - 1]
    windows = json.loads(metrics.read_text())["summary"]["moe"]
    assert [w["step"] for w in windows] == [2, 4]
    for w in windows:
        assert [one["layer"] for one in w["layers"]] == [0, 1]
        # 2 steps × global batch 16 × 32 tokens × top-2
        assert all(one["chosen_slots"] == 2 * 16 * 32 * 2 for one in w["layers"])
