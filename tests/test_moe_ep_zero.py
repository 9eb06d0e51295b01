"""Expert parallelism under ZeRO-1 and FSDP2 (``parallel.dp_shard=optimizer``, ``full``)
against the unsplit model.

Both shard dense parameters' state over the DP group and the split experts' over the
``expert_grad`` group (the dp ÷ ep ranks holding the same experts): ZeRO-1 reduce-scatters
each bucket over its own group (experts divided by the whole dp: their gradient already
sums the ep ranks' tokens), FSDP makes each layer's experts a unit of their own on that
group (their average there divided by ep more); both sum the gradient norm once over DP.
Real gloo ranks train two clipped AdamW steps of two micro-batches each (the first under
``no_sync``: accumulation) through the runtime's pieces (the model builder, the local step
runner with its router losses, ``build_data_parallel``) at

- dp 2 × ep 2: each rank holds 3 of the 6 experts whole (an expert_grad group of one)
  and half of the dense state (ZeRO-1 and FSDP ``full``);
- dp 4 × ep 2 (ZeRO-1): each expert's state is also sliced over two ranks.

The reference is test_moe_ep's: the unsplit model in this process, each step the mean over
every rank's micro-batches of model loss + router losses, one backward, the norm and an
AdamW step of the all-reduce path. float64 throughout (router included): the sides differ
only in summation order, ~1e-16 relative, so losses, norms, every updated weight and the
Adam moments are held to 1e-10 absolute. The dp 2 runs also save a checkpoint and resume
it at ep 1 (experts then sharded over both ranks): the moments are stored whole, as at
ep 1, and read back exactly (``torch.equal``: they only move between files and ranks).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import parallel_state
from engine.checkpoint import ShardReader, full_optimizer_state, load_checkpoint, save_checkpoint
from engine.data_parallel import build_data_parallel
from engine.models import build_model
from engine.runner import LocalRunner
from layers.moe import moe_losses
from layers.utils import tp_local
from parallel_state.dims import ParallelDims
from tests.moe_util import EXPERTS
from tests.multiproc import run_ranks
from tests.test_moe_ep import BATCH, OPTIM, SEQ, VOCAB, _cfg

DEVICE = torch.device("cpu")
F64 = torch.float64
STEPS, MICRO = 2, 2
TOL = dict(rtol=0, atol=1e-10)  # fp64, differing only in summation order (docstring)


def _data(dp: int) -> torch.Tensor:
    """``[STEPS, dp, MICRO, b, s+1]``: each step's token windows, MICRO per dp index."""
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (STEPS, dp, MICRO, BATCH, SEQ + 1), generator=gen)


def _recording_losses(model) -> tuple[list, list]:
    """(model losses, router losses): appended at each ``model.loss`` call, in fp64 (the
    runner reports them in fp32)."""
    losses, routers = [], []

    def loss(batch, inner=model.loss):
        losses.append(inner(batch))
        routers.append(sum(one.loss for one in moe_losses(model)))
        return losses[-1]

    model.loss = loss
    return losses, routers


def _mean(values: list) -> torch.Tensor:
    return sum(v.detach() for v in values) / len(values)


def _build(cfg, dp_size: int, ep: int, dp_shard: str):
    """A fresh mesh, model (seed 0) and DP strategy at dp ``dp_size`` × ep ``ep``."""
    parallel_state.destroy()
    ps = parallel_state.initialize(ParallelDims(tp=1, dp=dp_size, ep=ep, dp_shard=dp_shard))
    torch.manual_seed(0)
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    dp = build_data_parallel(
        model,
        OPTIM,
        device=DEVICE,
        dp_shard=dp_shard,
        grad_group=ps.group("grad"),
        tp_group=ps.group("tp"),
        expert_groups=(ps.group("expert"), ps.group("expert_grad")),
    )
    return ps, model, dp


def _clipped_step(dp, model) -> dict:
    """Finish the gradients, take one clipped AdamW step; the norm and the new weights."""
    dp.finish_grads()
    norm = dp.grad_norm()
    dp.step(lr=OPTIM.lr, max_norm=OPTIM.clip_grad, norm=norm)
    dp.wait_params()  # ZeRO-1 all-gathers the updated slices asynchronously
    weights = {n: tp_local(p).detach().clone() for n, p in model.named_parameters()}
    return dict(norm=norm, weights=weights)  # (FSDP's gathered over its group: tp_local)


def _ep_rank(cfg, data, dp_size: int, ep: int, dp_shard: str, root: str | None) -> dict:
    """STEPS steps at dp ``dp_size`` × ep ``ep`` under ``dp_shard``: per step the rank's fp64
    model and router losses, the norm and the weights; then the whole optimizer state
    (experts gathered over ep). With ``root``: saved there and resumed at ep 1 (the same
    ``dp_shard``)."""
    ps, model, dp = _build(cfg, dp_size, ep, dp_shard)
    assert dp.shards_optimizer
    runner = LocalRunner(model, ps, contextlib.nullcontext)
    losses, routers = _recording_losses(model)
    index, steps = ps.rank_in("batch"), []
    for windows in data:
        losses.clear()
        routers.clear()
        dp.zero_grad()
        runner.forward_backward(list(windows[index]), dp)
        out = _clipped_step(dp, model)
        steps.append(dict(out, loss=_mean(losses), router=_mean(routers)))
    ep_rank = ps.rank_in("expert")
    out = dict(steps=steps, state=full_optimizer_state(model, dp))
    out["experts"] = (ep_rank * EXPERTS // ep, (ep_rank + 1) * EXPERTS // ep)
    if root is not None:
        save_checkpoint(root, STEPS, model=model, optimizer=dp, ps=ps, state={}, keep=1)
        ps, model, dp = _build(cfg, dp_size, 1, dp_shard)
        load_checkpoint(root, model=model, optimizer=dp, ps=ps, log=lambda msg: None)
        out["resumed"] = full_optimizer_state(model, dp)
    return out


def _reference(cfg, data: torch.Tensor) -> dict:
    """The unsplit model and the all-reduce path: each step the mean over the dp batches of
    model loss + router losses, one backward, the norm and the step."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=F64, device=DEVICE)
    dp = build_data_parallel(model, OPTIM, device=DEVICE, grad_group=None, tp_group=None)
    losses, routers = _recording_losses(model)
    steps = []
    for windows in data:
        losses.clear()
        routers.clear()
        dp.zero_grad()
        for batch in windows.flatten(0, 1):  # every rank's micro-batches
            model.loss(batch)
        ((sum(losses) + sum(routers)) / len(losses)).backward()
        steps.append(dict(_clipped_step(dp, model), loss=_mean(losses), router=_mean(routers)))
    return dict(steps=steps, state=full_optimizer_state(model, dp))


def _assert_matches(ranks: list[dict], ref: dict) -> None:
    """Each step's mean losses, every rank's norm and weights (its experts' slices), and the
    final Adam moments (whole) equal the reference's."""
    for step, want in enumerate(ref["steps"]):
        for key in ("loss", "router"):
            got = sum(r["steps"][step][key] for r in ranks) / len(ranks)
            torch.testing.assert_close(got, want[key], **TOL, msg=f"step {step + 1} {key}")
        for r in ranks:
            mine = r["steps"][step]
            torch.testing.assert_close(mine["norm"], want["norm"], **TOL)
            first, end = r["experts"]
            for name, value in want["weights"].items():
                value = value[first:end] if ".experts." in name else value
                torch.testing.assert_close(mine["weights"][name], value, **TOL, msg=name)
    moments = [n for n in ref["state"] if n.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and any(".experts." in n for n in moments)
    for r in ranks:
        assert r["state"].keys() == ref["state"].keys()
        for name in moments:
            torch.testing.assert_close(r["state"][name], ref["state"][name], **TOL, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("dp_shard", ["optimizer", "full"])
def test_ep2_equals_the_unsplit_model_and_saves_whole_moments(tmp_path, dp_shard):
    cfg, data = _cfg(), _data(2)
    ranks = run_ranks(_ep_rank, 2, cfg, data, 2, 2, dp_shard, str(tmp_path), timeout=300)
    ref = _reference(cfg, data)
    _assert_matches(ranks, ref)
    assert [r["experts"] for r in ranks] == [(0, 3), (3, 6)]
    # The checkpoint stores every expert's moments whole (6 rows), as the unsplit run's
    # state; resumed at ep 1 (the same dp_shard) each rank reads exactly the files back.
    reader = ShardReader(Path(tmp_path) / f"step_{STEPS:08d}")
    files = {n: reader.read(n) for n, s in reader.specs.items() if s.kind == "optim"}
    assert files.keys() == ref["state"].keys()
    experts = [n for n in files if ".experts." in n]
    assert experts and all(files[n].shape[0] == EXPERTS for n in experts)
    for name, value in files.items():
        torch.testing.assert_close(value, ref["state"][name], **TOL, msg=name)
    for r in ranks:
        assert r["resumed"].keys() == files.keys()
        for name, value in files.items():
            assert torch.equal(r["resumed"][name], value), name


@pytest.mark.slow
def test_dp4_ep2_zero1_slices_each_experts_state_over_its_expert_grad_group():
    cfg, data = _cfg(), _data(4)
    ranks = run_ranks(_ep_rank, 4, cfg, data, 4, 2, "optimizer", None, timeout=300)
    _assert_matches(ranks, _reference(cfg, data))
    # Ranks 0 and 2 (dp_rank % ep = 0) hold experts 0-2, ranks 1 and 3 experts 3-5.
    assert [r["experts"] for r in ranks] == [(0, 3), (3, 6), (0, 3), (3, 6)]
