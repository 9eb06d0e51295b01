"""MoE through pipeline stages (issue 41): the router losses of every stage reach backward.

Two real gloo ranks at pp 2 (one MoE layer per stage) train one step of two
micro-batches (1F1B; also two stages a rank under interleaved 1F1B and ZB-V) through the runtime's pieces: ``PipelineModel``, ``PipelineRunner`` (whose
stage chunks attach their layers' router losses to their outputs) and the all-reduce DP
strategy. The reference is the unsplit model with the same weights on the same rank,
trained by the local step runner (which adds the router losses to each micro-batch's
loss). float64 throughout, router included: the two differ only in where sums are
grouped (the norm summed per stage, a micro-batch's router losses summed per stage),
~1e-16 relative, so every comparison is held to 1e-10 absolute, except the runners'
``router_loss``, which both keep in float32 (summed in another order: 1e-7 absolute covers
a few ulps of a value near 0.03). A lost router gradient is O(1e-3) at these
coefficients, far above either.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import parallel_state
from engine import comm
from engine.config import OptimConfig
from engine.data_parallel import build_data_parallel
from engine.models import build_model
from engine.pipeline import PipelineModel, PipelineRunner
from engine.runner import LocalRunner
from layers.router import router_biases
from parallel_state.dims import ParallelDims
from studies.verification.layouts import solo_group
from tests.moe_util import LLAMA, moe_cfg
from tests.multiproc import run_ranks

F64, DEVICE = torch.float64, torch.device("cpu")
BATCH, SEQ, VOCAB, MICRO = 2, 8, 64, 2
TOL = dict(rtol=0, atol=1e-10)  # fp64, sums grouped differently (module docstring)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, clip_grad=0.05, impl="torch")
KEYS = dict(moe_router_dtype="fp64", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def _micro_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return list(torch.randint(0, VOCAB, (MICRO, BATCH, SEQ + 1), generator=gen))


def _step(dp, model, runner, ps) -> dict:
    """Finish the gradients, take one clipped AdamW step; the full grads and weights."""
    dp.finish_grads()
    for _, _, hook in runner.post_reduction(dp):
        hook()
    grads = model.full_grad_dict()  # collective over the stages
    norm = runner.global_norm(dp.grad_norm())
    dp.step(lr=OPTIM.lr, max_norm=OPTIM.clip_grad, norm=norm)
    window = runner.moe_window.close(ps.group("loss"), 1)  # the moe line's figures
    biases = {}  # the sigmoid routers' biases the step moved, of every stage
    for part in comm.all_gather_object(router_biases(model), ps.group("pp")):
        biases |= part
    return dict(
        grads=grads, norm=norm, weights=model.full_state_dict(), window=window, biases=biases
    )


def _local(model, ps, micro: list) -> dict:
    """The unsplit ``model`` through the local runner; the fp64 mean model loss it
    backpropagates (read as it runs)."""
    solo = solo_group(ps)
    dp = build_data_parallel(
        model, OPTIM, grad_group=solo, tp_group=solo, device=DEVICE, expert_groups=(solo, solo)
    )
    runner = LocalRunner(model, ps, contextlib.nullcontext)
    seen = []  # each micro-batch's model loss, fp64

    def loss(batch, inner=model.loss):
        seen.append(inner(batch))
        return seen[-1]

    model.loss = loss
    runner.forward_backward(micro, dp)
    out = _step(dp, model, runner, ps)
    return dict(out, loss=sum(s.detach() for s in seen) / MICRO, router_loss=runner.router_loss)


def _pipelined(model, ps, micro: list, schedule: str, virtual: int) -> dict:
    stages = PipelineModel(
        model,
        pp_rank=ps.pp_rank,
        pp_size=2,
        pp_group=ps.pp_group,
        virtual=virtual,
        schedule=schedule,
        embedding_group=ps.group("embedding"),
    )
    dp = build_data_parallel(
        stages,
        OPTIM,
        grad_group=ps.group("grad"),
        tp_group=ps.tp_group,
        device=DEVICE,
        expert_groups=(ps.group("expert"), ps.group("expert_grad")),
    )
    runner = PipelineRunner(stages, schedule=schedule, microbatches=MICRO, ps=ps)
    with dp.no_sync():
        loss = runner.train(micro)  # the fp64 mean (forward_backward reports it in fp32)
    out = _step(dp, stages, runner, ps)
    return dict(out, loss=torch.tensor(loss, dtype=F64), router_loss=runner.router_loss)


def _pp_rank(cfg, micro: list, attach: bool, schedule: str = "1f1b", virtual: int = 1) -> dict:
    """Rank 0: the pipelined step's results and the local runner's (None elsewhere)."""
    from engine.pipeline import stages as stages_module

    if not attach:  # the bug this guards against: no stage adds its router losses
        stages_module.attach_router_loss = lambda hidden, router_loss, scale: hidden
    ps = parallel_state.initialize(ParallelDims(1, 1, 2))
    models = []
    for tp_group in (ps.tp_group, solo_group(ps)):  # the same seed: the same weights
        ps.seed(0)
        models.append(build_model(cfg, tp_group=tp_group, rng=ps.rng, dtype=F64, device=DEVICE))
    got = _pipelined(models[0], ps, micro, schedule, virtual)
    want = _local(models[1], ps, micro)
    rank = ps.rank
    parallel_state.destroy()
    return (got, want) if rank == 0 else None


def _mismatches(got: dict, want: dict, kind: str) -> list[str]:
    return [
        name
        for name, value in want[kind].items()
        if not torch.allclose(got[kind][name], value, **TOL)
    ]


def _run(attach: bool, schedule: str = "1f1b", virtual: int = 1, **keys) -> tuple[dict, dict]:
    cfg = moe_cfg(**{**LLAMA, **KEYS, "num_layers": 2 * virtual, **keys})  # one MoE layer a stage
    micro = _micro_batches()
    return run_ranks(_pp_rank, 2, cfg, micro, attach, schedule, virtual, timeout=180)[0]


def _assert_equal(got: dict, want: dict) -> None:
    """Loss, router loss, norm, every gradient and stepped weight, and the moe line's
    figures of every layer: the pipelined step's are the local runner's."""
    torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    torch.testing.assert_close(got["router_loss"], want["router_loss"], rtol=0, atol=1e-7)
    torch.testing.assert_close(got["norm"], want["norm"], **TOL)
    assert got["grads"].keys() == want["grads"].keys()
    for kind in ("grads", "weights"):
        for name, value in want[kind].items():
            torch.testing.assert_close(got[kind][name], value, **TOL, msg=f"{kind} {name}")
    # The moe line sees both stages' layers, with the local runner's figures.
    assert [one["layer"] for one in got["window"]] == [one["layer"] for one in want["window"]]
    for mine, theirs in zip(got["window"], want["window"], strict=True):
        for key, value in theirs.items():
            assert abs(mine[key] - value) <= 1e-10, (mine["layer"], key, mine[key], value)
    # The router loss is the weighted mean of the window's (fp64) aux and z losses.
    from_window = sum(0.01 * one["aux"] + 0.001 * one["z"] for one in want["window"])
    assert abs(float(want["router_loss"]) - from_window) <= 1e-7
    assert got["biases"] == want["biases"]  # bitwise: the same loads, the same ± γ steps


@pytest.mark.slow
def test_pp2_router_losses_reach_every_stage_as_in_the_unsplit_model():
    """DeepSeek-V3's sigmoid router: each stage also moves its router's bias by the
    step's load, as the local runner does (tests/test_moe_bias.py checks that by hand)."""
    got, want = _run(attach=True, moe_router="sigmoid", moe_bias_update_rate=2.0**-6)
    routers = [name for name in want["grads"] if name.endswith("router.weight")]
    assert len(routers) == 2 and [one["layer"] for one in got["window"]] == [0, 1]
    assert len(want["biases"]) == 2 and all(any(v) for v in want["biases"].values())
    _assert_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_two_chunks_per_rank_and_split_backward_add_the_router_losses_alike(schedule):
    """Two stages a rank (4 layers): interleaved 1F1B, and ZB-V, whose backward is split
    into the input and the weight gradients (the attach's output must not be a view:
    torch detaches it in place)."""
    _assert_equal(*_run(attach=True, schedule=schedule, virtual=2))


@pytest.mark.slow
def test_without_the_attach_the_router_gradients_differ():
    """The same step with the stage's attach made the identity: the model loss is still
    the unsplit one, but both stages' routers miss their losses' gradients."""
    got, want = _run(attach=False)
    torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    wrong = _mismatches(got, want, "grads")
    routers = [name for name in want["grads"] if name.endswith("router.weight")]
    assert set(routers) <= set(wrong), wrong
    for name in routers:
        assert (got["grads"][name] - want["grads"][name]).abs().max() > 1e-6


def test_pp_refuses_only_the_router_losses_pooled_over_the_model():
    """Per-layer router losses run at pp > 1; an aux loss pooled over the whole model's
    layers spans the stages and is refused, in one line naming the value and the fix."""
    from engine.config import Config, parallel_dims, validate

    cfg = Config(pp_size=2, tp_size=1, dp_size=1)
    m = cfg.model
    m.mlp, m.moe_num_experts, m.moe_top_k, m.moe_ffn_hidden_size = "moe", 4, 2, 8
    m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.linear_bias = 0.01, 0.001, False

    def problems():
        return validate(cfg, parallel_dims(cfg, None))

    assert problems() == []  # layer pooling (the default)
    m.moe_aux_loss_pooling = "model"
    assert problems() == [
        "pp_size=2 adds each stage's router losses per layer, not pooled over the model: "
        "set model.moe_aux_loss_pooling=layer, or pp_size=1"
    ]
    m.moe_aux_loss_coeff = 0.0  # only z losses: the same per layer either way
    assert problems() == []
