"""The mixture-of-experts layer at tp > 1 (``layers.moe.MoEMLP``) against the unsplit model.

Real gloo ranks train one step through the runtime's own pieces (the model builder, the
local step runner with its router losses, the all-reduce DP strategy with its TP sum of
the sequence-parallel partial gradients): at tp 2 with sequence parallelism (each expert's
columns split over the two TP ranks, the router's logits computed per sequence block and
gathered), and at tp 2 × ep 2 (dp 2: the ep all-to-alls run within each TP rank's own ep
group). The reference is test_moe_ep's unsplit model in this process (the mean over the
two token windows of model loss + router losses, one backward, the norm and one clipped
AdamW step). float64 throughout, router included: the sides differ only in summation
order (an expert's output summed over its TP slices, a gradient over sequence blocks), so
loss, router loss, every gradient gathered to full shape, the norm and the stepped
weights are held to 1e-10 absolute, and the routing (each kept and dropped (token,
expert) pair) must be the same sets on every TP rank. A checkpoint saved at tp 2 loads at
tp 1 with every tensor equal (``torch.equal``): experts are stored whole, gathered over
TP and ep.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import parallel_state
from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.models import ModelConfig, build_model
from engine.runner import LocalRunner
from engine.trainer import model_groups
from layers.moe import moe_losses
from layers.param_roles import mark_tp_dim
from parallel_state.dims import ParallelDims
from studies.verification.layouts import VerifySpec, compare_layouts
from tests.multiproc import run_ranks
from tests.test_moe_checkpoint import _equal, _files, _state
from tests.test_moe_ep import (
    BATCH,
    OPTIM,
    SEQ,
    TOL,
    VOCAB,
    _cfg,
    _dp,
    _pairs,
    _record_routing,
    _reference,
    _shards,
)

DEVICE = torch.device("cpu")
F64 = torch.float64
STEP = 1  # the checkpoint's step

# Softmax top-2 renormalised, Qwen2-MoE's gated shared expert (its own TP-split MLP),
# sequence parallelism (the logits and the gate's input are per sequence block), and a
# capacity that drops slots: the drops must be those of every token of the window.
TP_CASE = dict(moe_shared_ffn_hidden_size=8, sequence_parallel=True, moe_capacity_factor=1.0)
# The same, dropless (the routing without a keep mask).
TP_EP_CASE = dict(moe_shared_ffn_hidden_size=8, sequence_parallel=True)
# The layout verifier's MoE comparison at tp 2 × dp 2 × ep 2, sequence parallel, drops.
LAYOUT = dict(tp_size=2, dp_size=2, ep_size=2, sequence_parallel=True)
VERIFY = VerifySpec(model="llama", num_heads=4, experts=4, capacity_factor=1.0, **LAYOUT)


def _tp_rank(cfg: ModelConfig, shards: torch.Tensor, dims: ParallelDims, root: str) -> dict:
    """One step at ``dims``: this dp rank's windows (at dp 1 both, as micro-batches). Returns
    its fp64 loss and router loss, full gradients, norm, full stepped weights, routing
    pairs, and the state it saved under ``root``."""
    ps = parallel_state.initialize(dims)
    torch.manual_seed(0)
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    records = _record_routing(model)
    runner = LocalRunner(model, ps, contextlib.nullcontext)
    dp = _dp(model, ps)
    index, dp_size = ps.rank_in("batch"), ps.size("batch")
    numbers = list(range(index, len(shards), dp_size))  # the windows this rank runs
    losses, routers = [], []  # fp64 model and router losses of each micro-batch
    model_loss = model.loss

    def loss_of(batch):
        losses.append(model_loss(batch))
        routers.append(sum(one.loss for one in moe_losses(model)).detach())
        return losses[-1]

    model.loss = loss_of
    runner.forward_backward([shards[n] for n in numbers], dp)
    dp.finish_grads()
    grads = model.full_grad_dict()
    norm = dp.grad_norm()
    dp.step(lr=OPTIM.lr, max_norm=OPTIM.clip_grad, norm=norm)
    tokens = BATCH * SEQ
    routing = [  # per layer, the pairs of each window this rank ran
        [_pairs(forward, n * tokens) for n, forward in zip(numbers, forwards, strict=True)]
        for forwards in records
    ]
    save_checkpoint(Path(root), STEP, model=model, optimizer=dp, ps=ps, state={}, keep=1)
    return dict(
        loss=sum(one.detach() for one in losses) / len(losses),
        router=sum(routers) / len(routers),
        grads=grads,
        norm=norm,
        weights=model.full_state_dict(),
        routing=routing,
        saved=_state(model, dp),
        ranks=(ps.rank_in("tp"), index),
        fc1=tuple(model.get_parameter("layers.0.mlp.experts.fc1").shape),
    )


def _load_at_tp1(cfg: ModelConfig, root: str) -> dict:
    """The checkpoint under ``root`` loaded into a tp 1, dp 1 model: its full state."""
    ps = parallel_state.initialize(ParallelDims(tp=1, dp=1))
    torch.manual_seed(1)  # other initial weights: the load must overwrite them all
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    dp = _dp(model, ps)
    load_checkpoint(Path(root), model=model, optimizer=dp, ps=ps, log=lambda msg: None)
    return _state(model, dp)


def _save_replicated_experts(cfg: ModelConfig, root: str) -> dict:
    """A tp 1 checkpoint whose index records the experts replicated over TP (``tp_dim``
    None), as those written before the experts split over TP did: its full state."""
    ps = parallel_state.initialize(ParallelDims(tp=1, dp=1))
    torch.manual_seed(0)
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    for name, p in model.named_parameters():
        if ".experts." in name:
            mark_tp_dim(p, None)
    dp = _dp(model, ps)  # no step taken: no optimizer state to store
    save_checkpoint(Path(root), STEP, model=model, optimizer=dp, ps=ps, state={}, keep=1)
    return model.full_state_dict()


def _load_at_tp2(cfg: ModelConfig, root: str) -> dict:
    """The checkpoint under ``root`` loaded at tp 2: the full weights and this rank's
    expert slices."""
    ps = parallel_state.initialize(ParallelDims(tp=2, dp=1))
    torch.manual_seed(1)  # other initial weights: the load must overwrite them all
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    load_checkpoint(Path(root), model=model, optimizer=_dp(model, ps), ps=ps, log=lambda m: None)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    return dict(full=model.full_state_dict(), experts=experts, tp_rank=ps.rank_in("tp"))


def _assert_matches(ranks: list[dict], ref: dict, dp_size: int) -> None:
    """Each TP rank of each dp rank against the unsplit reference (module docstring)."""
    loss = sum(r["loss"] for r in ranks) / len(ranks)  # every TP rank's is its dp rank's
    torch.testing.assert_close(loss, ref["loss"], **TOL)
    router = sum(r["router"] for r in ranks) / len(ranks)
    torch.testing.assert_close(router, ref["router"], **TOL)
    for r in ranks:
        torch.testing.assert_close(r["norm"], ref["norm"], **TOL)
        for kind in ("grads", "weights"):
            assert r[kind].keys() == ref[kind].keys()
            for name, want in ref[kind].items():
                # The unsplit model pads its vocabulary in memory (to 128 rows at tp 1, 256
                # at tp 2); the full dicts hold the true rows only.
                want = want[:VOCAB] if ("embedding.word." in name or "lm_head." in name) else want
                torch.testing.assert_close(r[kind][name], want, **TOL, msg=f"{kind} {name}")
    for layer, per_window in enumerate(ref["routing"]):
        for tp_rank in range(len(ranks) // dp_size):  # each TP rank routes every token
            mine = [r for r in ranks if r["ranks"][0] == tp_rank]
            for part in (0, 1):  # kept, dropped
                want = set().union(*(one[part] for one in per_window))
                got = set().union(*(w[part] for r in mine for w in r["routing"][layer]))
                assert got == want, f"layer {layer}, tp rank {tp_rank}: routing differs"


def _check_checkpoint(cfg: ModelConfig, ranks: list[dict], root: Path) -> None:
    """The files hold the run's full state, and a tp 1 model loads exactly that."""
    files = _files(root / f"step_{STEP:08d}")
    experts = [n for n in files if ".experts." in n]
    assert experts and all(files[n].shape[0] == 6 for n in experts)  # whole, every expert
    for r in ranks:
        _equal(r["saved"]["tensors"], files, "the files against the tp 2 run")
    loaded = run_ranks(_load_at_tp1, 1, cfg, str(root))[0]
    _equal(loaded["tensors"], files, "loaded at tp 1")
    assert loaded["steps"] == ranks[0]["saved"]["steps"]


@pytest.mark.slow  # two ranks and a checkpoint round trip: ~5 s on idle cores
def test_tp2_sequence_parallel_equals_the_unsplit_model_and_its_checkpoint_loads_at_tp1(
    tmp_path,
):
    cfg, shards = _cfg(**TP_CASE), _shards()
    ranks = run_ranks(_tp_rank, 2, cfg, shards, ParallelDims(tp=2, dp=1), str(tmp_path))
    ref = _reference(cfg, shards)
    _assert_matches(ranks, ref, dp_size=1)
    dropped = sum(len(d) for per_window in ref["routing"] for _, d in per_window)
    assert dropped > 0  # the capacity bit: the drops were compared too
    # Each TP rank held half of every expert's gate/up columns (6 experts, h 16, 2 × 12).
    assert [r["fc1"] for r in ranks] == [(6, 16, 12)] * 2
    _check_checkpoint(cfg, ranks, tmp_path)


@pytest.mark.slow
def test_tp2_ep2_equals_the_unsplit_model_and_its_checkpoint_loads_at_tp1(tmp_path):
    cfg, shards = _cfg(**TP_EP_CASE), _shards()
    dims = ParallelDims(tp=2, dp=2, ep=2)
    ranks = run_ranks(_tp_rank, 4, cfg, shards, dims, str(tmp_path))
    ref = _reference(cfg, shards)
    _assert_matches(ranks, ref, dp_size=2)
    assert [r["fc1"] for r in ranks] == [(3, 16, 12)] * 4  # 3 experts, half their columns
    _check_checkpoint(cfg, ranks, tmp_path)


def _verify():
    parallel_state.initialize(VERIFY.dims)
    try:
        report = compare_layouts(VERIFY)
        return report and (report.ok, report.rows, report.notes)
    finally:
        parallel_state.destroy()


@pytest.mark.slow
def test_the_verifier_runs_moe_at_tp2_ep2():
    # tools/verify_equivalence.py --model llama --tp-size 2 --dp-size 2 --ep-size 2
    # --heads 4 --sequence-parallel --capacity-factor 1.0: fp64, summation order only.
    ok, rows, notes = run_ranks(_verify, 4, timeout=600)[0]
    worst = max(r.max_rel for r in rows)
    assert ok and worst <= 1e-14, [r for r in rows if r.max_rel > 1e-14]
    kinds = {r.kind for r in rows}
    assert {"routes", "dropped", "weights", "aux loss", "z loss", "output", "grad"} <= kinds
    names = {r.name for r in rows}  # the experts' rows (summed over TP), the split experts
    assert {"layers.0.mlp.experts", "layers.1.mlp", "layers.0.mlp.experts.fc1"} <= names
    dropped = [int(n.split(", ")[1].split()[0]) for n in notes]
    assert len(rows) == 51 and len(notes) == 2 and all(d > 0 for d in dropped), notes


@pytest.mark.slow
def test_a_checkpoint_with_replicated_experts_loads_at_tp2(tmp_path):
    # Its index says the experts are whole on every TP rank; the model's layers say how
    # they are cut now (engine.checkpoint.state.as_held_by).
    cfg = _cfg(**TP_EP_CASE)
    saved = run_ranks(_save_replicated_experts, 1, cfg, str(tmp_path))[0]
    index = (tmp_path / f"step_{STEP:08d}" / "index.json").read_text()
    assert '"tp_dim": null' in index
    ranks = run_ranks(_load_at_tp2, 2, cfg, str(tmp_path))
    for r in ranks:
        _equal(r["full"], saved, "loaded at tp 2")
        for name, local in r["experts"].items():  # fc1 [E, h, 2f]: columns; fc2: rows
            dim = 2 if name.endswith("fc1") else 1
            want = saved[name].chunk(2, dim=dim)[r["tp_rank"]]
            assert torch.equal(local, want), name


def test_the_watchdog_names_tp_and_the_expert_group_at_tp2_ep2():
    # The trainer's stall watchdog names the groups a model's collectives wait on: at
    # tp 2 × ep 2 the MoE layers' f and g (tp) and their all-to-alls (expert).
    dims = ParallelDims(tp=2, dp=2, ep=2)
    ps = SimpleNamespace(dims=dims, size=dims.size_of)
    assert model_groups(ps) == ("tp", "expert")
    assert dims.live_axes(*model_groups(ps)) == ["tp", "expert"]
    tp_only = ParallelDims(tp=2, dp=2)  # no ep: as before
    assert model_groups(SimpleNamespace(dims=tp_only, size=tp_only.size_of)) == ("tp",)
