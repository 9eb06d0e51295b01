"""Expert parallelism (the ``ep`` split of the dp ranks; layers/expert_parallel.py) against
the unsplit model.

Two real gloo ranks at dp 2 × ep 2 (each holds half the experts and dispatches tokens to
the other's by all-to-all) train one step through the runtime's own pieces: the model
builder, the local step runner (which adds the router losses) and the all-reduce DP
strategy (which reduces expert gradients over the expert_grad group). The reference is the
unsplit model in this process, written out here: each rank's batch run as it would be at
dp 2 without experts split (the mean over the two of model loss + router losses), one
backward, the norm and one AdamW step. float64 throughout, router included
(``moe_router_dtype=fp64``): the two differ only in summation order (an expert's rows from
both ranks in one matmul, the norm summed in two parts), ~1e-16 relative, so every
comparison is held to 1e-10 absolute.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import parallel_state
from engine.config import (
    Config,
    OptimConfig,
    ParallelConfig,
    parallel_dims,
    validate,
)
from engine.data_parallel import GradSync, build_data_parallel
from engine.models import ModelConfig, build_model
from engine.runner import LocalRunner
from layers.moe import moe_losses
from layers.router import TopKRouter
from parallel_state.dims import LayoutError, ParallelDims
from tests.moe_util import EXPERTS, LLAMA, moe_cfg
from tests.multiproc import run_ranks

DEVICE = torch.device("cpu")
F64 = torch.float64
BATCH, SEQ, VOCAB = 2, 8, 64
TOL = dict(rtol=0, atol=1e-10)  # fp64, differing only in summation order (module docstring)
# A clip that bites (the norm is ~1), so the norm's expert part reaches the step.
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, clip_grad=0.05, impl="torch")

CASES = {
    # Softmax top-2 of 6 renormalised, dropless.
    "softmax_top2": dict(),
    # The same, each expert taking at most ⌈1.0 · T · k / E⌉ = 6 of a rank's 32 slots.
    "capacity": dict(moe_capacity_factor=1.0),
    # DeepSeek-V3's sigmoid router, Qwen2-MoE's gated shared expert, and whole-layer
    # recomputation (the dispatch and combine run again inside backward).
    "sigmoid_shared_recompute": dict(
        moe_router="sigmoid", moe_shared_ffn_hidden_size=8, recompute="full"
    ),
}


def _cfg(**overrides) -> ModelConfig:
    """test_moe's tiny MoE layers (6 experts, top-2, both layers) in a Llama, routed in fp64."""
    ep_keys = dict(moe_router_dtype="fp64", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    return moe_cfg(**{**LLAMA, **ep_keys, **overrides})


def _shards() -> torch.Tensor:
    """``[2, b, s+1]``: each dp rank's token windows."""
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, BATCH, SEQ + 1), generator=gen)


def _record_routing(model) -> list[list]:
    """Per router, the ``Routing`` of each forward, appended as they run (a recomputed
    forward's too, after the forward passes)."""
    records = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            records.append([])
            module.register_forward_hook(lambda m, i, out, seen=records[-1]: seen.append(out))
    return records


def _pairs(routing, offset: int) -> tuple[set, set]:
    """(kept, dropped) (token, expert) pairs of one forward, tokens numbered from ``offset``."""
    tokens, k = routing.experts.shape
    keep = torch.ones(tokens, k, dtype=torch.bool) if routing.keep is None else routing.keep
    kept, dropped = set(), set()
    for t in range(tokens):
        for j in range(k):
            (kept if keep[t, j] else dropped).add((offset + t, int(routing.experts[t, j])))
    return kept, dropped


def _dp(model, ps=None):
    groups = {}
    if ps is not None:
        groups = dict(
            grad_group=ps.group("grad"),
            tp_group=ps.group("tp"),
            expert_groups=(ps.group("expert"), ps.group("expert_grad")),
        )
    groups = {"grad_group": None, "tp_group": None, **groups}
    return build_data_parallel(model, OPTIM, device=DEVICE, **groups)


def _step(dp, model) -> dict:
    """Finish the gradients, take one clipped AdamW step: what both sides compare."""
    dp.finish_grads()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = dp.grad_norm()
    dp.step(lr=OPTIM.lr, max_norm=OPTIM.clip_grad, norm=norm)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(grads=grads, norm=norm, weights=weights)


def _ep_rank(cfg: ModelConfig, shards: torch.Tensor, ep: int) -> dict:
    ps = parallel_state.initialize(ParallelDims(tp=1, dp=2, ep=ep))
    torch.manual_seed(0)
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    records = _record_routing(model)
    runner = LocalRunner(model, ps, contextlib.nullcontext)
    if ep > 1:  # split experts reduced with the dense gradients would be wrong: refused
        with pytest.raises(ValueError, match="pass expert_grad_group=ps.group"):
            GradSync(model.parameters(), grad_group=ps.group("grad"))
    dp = _dp(model, ps)
    index = ps.rank_in("batch")
    model_losses = []  # the fp64 loss the runner backpropagates (it reports it in fp32)
    model.loss = lambda batch, loss=model.loss: model_losses.append(loss(batch)) or model_losses[-1]
    reported = runner.forward_backward([shards[index]], dp)
    loss, router = model_losses[0].detach(), sum(one.loss for one in moe_losses(model)).detach()
    torch.testing.assert_close(reported, loss.float(), rtol=0, atol=0)
    torch.testing.assert_close(runner.router_loss, router.float(), rtol=0, atol=0)
    out = _step(dp, model)
    tokens = BATCH * SEQ
    routing = [_pairs(forwards[0], index * tokens) for forwards in records]
    ep_rank = ps.rank_in("expert")
    experts = (ep_rank * EXPERTS // ep, (ep_rank + 1) * EXPERTS // ep)
    return dict(out, loss=loss, router=router, routing=routing, experts=experts)


def _reference(cfg: ModelConfig, shards: torch.Tensor) -> dict:
    """The unsplit model: the mean over the two ranks' batches of model loss + router
    losses, one backward, the norm and the step."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=F64, device=DEVICE)
    records = _record_routing(model)
    dp = _dp(model)
    losses, routers = [], []
    for batch in shards:
        losses.append(model.loss(batch))
        routers.append(sum(one.loss for one in moe_losses(model)))
    (sum(losses) / 2 + sum(routers) / 2).backward()
    tokens = BATCH * SEQ
    routing = [  # the forward passes of the two batches (recomputation's come after)
        [_pairs(forward, r * tokens) for r, forward in enumerate(forwards[:2])]
        for forwards in records
    ]
    loss, router = sum(losses).detach() / 2, sum(routers).detach() / 2
    return dict(_step(dp, model), loss=loss, router=router, routing=routing)


def _assert_matches(ranks: list[dict], ref: dict) -> None:
    """Every rank's loss, gradients, norm and stepped weights (its experts' slices) and the
    ranks' routing together equal the reference's."""
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / 2, ref["loss"], **TOL)
    torch.testing.assert_close(sum(r["router"] for r in ranks) / 2, ref["router"], **TOL)
    for r in ranks:
        torch.testing.assert_close(r["norm"], ref["norm"], **TOL)
        first, end = r["experts"]
        for kind in ("grads", "weights"):
            for name, value in ref[kind].items():
                want = value[first:end] if ".experts." in name else value
                torch.testing.assert_close(r[kind][name], want, **TOL, msg=f"{kind} {name}")
    for layer, per_rank in enumerate(ref["routing"]):
        for part in (0, 1):  # kept, dropped
            want = set().union(*(one[part] for one in per_rank))
            got = set().union(*(r["routing"][layer][part] for r in ranks))
            assert got == want, f"layer {layer}: routing differs ({('kept', 'dropped')[part]})"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_ep2_equals_the_unsplit_model(case):
    cfg, shards = _cfg(**CASES[case]), _shards()
    ranks = run_ranks(_ep_rank, 2, cfg, shards, 2)
    ref = _reference(cfg, shards)
    _assert_matches(ranks, ref)
    dropped = sum(len(d) for per_rank in ref["routing"] for _, d in per_rank)
    assert (dropped > 0) == ("moe_capacity_factor" in CASES[case]), dropped
    # Each rank held half the experts and its weights were a slice of the unsplit ones.
    assert [r["experts"] for r in ranks] == [(0, 3), (3, 6)]


def _bf16_exchanges(cfg: ModelConfig, shards: torch.Tensor) -> dict:
    """At dp 2 × ep 2 under bf16 autocast: the dtypes the experts' all-to-alls carried
    (forward and backward), and this rank's loss on its batch."""
    import layers.expert_parallel as expert_parallel

    ps = parallel_state.initialize(ParallelDims(tp=1, dp=2, ep=2))
    rank = ps.rank_in("batch")
    carried, real = [], expert_parallel._exchange
    expert_parallel._exchange = lambda rows, *a: carried.append(rows.dtype) or real(rows, *a)
    try:
        torch.manual_seed(0)
        model = build_model(cfg, ps)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(shards[rank])
        loss.backward()
    finally:
        expert_parallel._exchange = real
    tokens = [dtype for dtype in carried if dtype.is_floating_point]  # not the counts
    return {"carried": tokens, "loss": loss.item(), "rank": rank}


def test_ep2_exchanges_tokens_in_bf16_under_autocast():
    """Under bf16 autocast the tokens cross the expert-parallel all-to-all in bf16 (the
    experts' GEMM rounds them to bf16 anyway), half the bytes of the fp32 the norm gives,
    in the dispatch and in the combine, forward and backward: 2 layers × 4 exchanges. The
    loss equals the unsplit model's under the same autocast within 2^-8, one bf16 ulp:
    the same bf16 products, the experts' rows grouped differently, which a GEMM may tile
    differently (measured here: equal to the bit on both ranks)."""
    cfg, shards = _cfg(moe_router_dtype="fp32"), _shards()
    for found in run_ranks(_bf16_exchanges, 2, cfg, shards):
        assert found["carried"] == [torch.bfloat16] * 8, found
        torch.manual_seed(0)  # the unsplit model, as the ranks drew it
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            unsplit = build_model(cfg).loss(shards[found["rank"]]).item()
        assert abs(found["loss"] - unsplit) <= 2**-8 * abs(unsplit), (found, unsplit)


def test_expert_roles_are_carved_from_dp():
    dims = ParallelDims(tp=2, dp=4, ep=2)  # ranks (dp, tp): dp_rank · 2 + tp_rank
    assert dims.group_ranks("expert") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("expert_grad") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (dims.size_of("expert"), dims.size_of("expert_grad")) == (2, 2)
    one = ParallelDims(tp=1, dp=2)  # ep 1: every rank its own experts, reduced as dense
    assert one.group_ranks("expert_grad") == one.group_ranks("grad") == [[0, 1]]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            dict(dp_size=4, ep_size=3),
            "ep_size=3 does not divide dp_size=4 (expert parallelism is carved from the "
            "data-parallel ranks); choose an ep_size dividing 4",
        ),
        (
            dict(dp_size=4, ep_size=4),
            "model.moe_num_experts=6 is not divisible by ep_size=4 (each ep rank holds whole "
            "experts); choose an ep_size dividing 6",
        ),
        (
            dict(dp_size=2, ep_size=2, parallel=ParallelConfig(dp_shard="full", dp_replicate=2)),
            "ep_size=2 runs with one FSDP replica, not parallel.dp_replicate=2 (hybrid sharding "
            "does not yet replicate experts); set parallel.dp_replicate=1 or ep_size=1",
        ),
        # ZeRO-1 and FSDP shard the experts over the expert_grad group (test_moe_ep_zero.py).
        (dict(dp_size=2, ep_size=2, parallel=ParallelConfig(dp_shard="optimizer")), None),
        (dict(dp_size=2, ep_size=2, parallel=ParallelConfig(dp_shard="full")), None),
        (dict(dp_size=2, ep_size=2, parallel=ParallelConfig(dp_shard="gradients")), None),
        (
            dict(dp_size=2, ep_size=2, model=_cfg(mlp="dense")),
            "ep_size=2 splits the experts of model.mlp=moe; model.mlp=dense has none: set ep_size=1",
        ),
        # Checkpointing (on by default: every, save_final, resume) is no longer refused:
        # the experts are stored whole (tests/test_moe_checkpoint.py).
        (dict(dp_size=2, ep_size=2), None),
    ],
)
def test_bad_ep_sizes_are_refused_in_one_line_before_launch(sizes, message):
    # What engine.pretrain checks before it starts a rank: the layout, then the config.
    cfg = Config(**{"model": _cfg(), "tp_size": 1, **sizes})
    assert cfg.checkpoint.every and cfg.checkpoint.save_final and cfg.checkpoint.resume
    try:
        problems = validate(cfg, parallel_dims(cfg, sizes["dp_size"]))
    except LayoutError as err:
        problems = [str(err)]
    want = [message] if message else []
    assert [line for line in problems if "ep_size" in line] == want  # (this tiny
    # model's other problems with the default data and trainer sections do not matter here)
