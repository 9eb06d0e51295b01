"""The sigmoid router's auxiliary-loss-free balancing (DeepSeek-V3) in training: after
every step each router's bias moves by γ · sign(mean load − load), the load counted over
the whole global batch (every micro-batch of every dp rank), and checkpoints keep it.

The reference is written out here: the unsplit model in this process, the bias moved by
hand from the experts its router hook saw (``torch.bincount`` of the chosen indices, not
the router's own counts). γ = 2⁻⁶ is a power of two, so the biases are exact sums and must
match bitwise; a bias of ±2⁻⁶ on the tiny model's sigmoid scores (0.5 ± ~0.05) changes
which experts win, so a bias moved wrongly (not at all, by one rank's load, by one micro-batch's) changes the
routing, the losses and the weights of the following steps. float64 throughout; the two
sides differ only in summation order (~1e-16 relative), held to 1e-10.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch

import parallel_state
from engine.models import build_model
from engine.runner import LocalRunner
from layers.moe import moe_losses
from layers.router import TopKRouter, load_router_biases, router_biases
from parallel_state.dims import ParallelDims
from tests.moe_util import EXPERTS, moe_tiny_run
from tests.multiproc import run_ranks
from tests.test_moe_ep import BATCH, OPTIM, SEQ, VOCAB, _cfg, _dp

DEVICE = torch.device("cpu")
F64 = torch.float64
GAMMA = 2.0**-6  # a power of two: the biases are exact sums
STEPS, MICRO, DP = 3, 2, 2
TOL = dict(rtol=0, atol=1e-10)


def _sigmoid_cfg():
    return _cfg(moe_router="sigmoid", moe_bias_update_rate=GAMMA)


def _data() -> torch.Tensor:
    """``[STEPS, DP, MICRO, b, s+1]``: each step's micro-batches of each dp rank."""
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (STEPS, DP, MICRO, BATCH, SEQ + 1), generator=gen)


def _step(dp) -> None:
    dp.finish_grads()
    dp.step(lr=OPTIM.lr, max_norm=OPTIM.clip_grad, norm=dp.grad_norm())


def _dp2_rank(cfg, data) -> dict:
    ps = parallel_state.initialize(ParallelDims(tp=1, dp=DP))
    torch.manual_seed(0)
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    runner, dp = LocalRunner(model, ps, contextlib.nullcontext), _dp(model, ps)
    losses = []  # the fp64 model loss of each micro-batch, as the runner computes it
    model.loss = lambda batch, loss=model.loss: losses.append(loss(batch)) or losses[-1]
    out = {"losses": [], "biases": []}
    for step in range(STEPS):
        losses.clear()
        dp.zero_grad()
        runner.forward_backward(list(data[step, ps.rank_in("batch")]), dp)
        _step(dp)
        out["losses"].append(torch.stack(losses).detach())
        out["biases"].append(router_biases(model))
    out["weights"] = model.full_state_dict()
    return out


def _reference(cfg, data) -> dict:
    """Each step: the mean over all DP·MICRO micro-batches of model loss + router losses,
    one backward and step, then every router's bias moved by the chosen experts' counts."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=F64, device=DEVICE)
    dp = _dp(model)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    chosen = [[] for _ in routers]
    for router, seen in zip(routers, chosen, strict=True):
        router.register_forward_hook(lambda m, i, out, seen=seen: seen.append(out.experts))
    biases = [torch.zeros(EXPERTS, dtype=torch.float32) for _ in routers]
    out = {"losses": [], "biases": []}
    for step in range(STEPS):
        for seen in chosen:
            seen.clear()
        dp.zero_grad()
        batches = data[step].reshape(DP * MICRO, BATCH, SEQ + 1)
        losses, objective = [], 0.0
        for batch in batches:
            losses.append(model.loss(batch))
            objective = objective + losses[-1] + sum(one.loss for one in moe_losses(model))
        (objective / len(batches)).backward()
        _step(dp)
        for router, seen, bias in zip(routers, chosen, biases, strict=True):
            load = torch.bincount(torch.cat(seen).reshape(-1), minlength=EXPERTS).float()
            bias += cfg.moe_bias_update_rate * torch.sign(load.mean() - load)
            router.expert_bias.copy_(bias)  # the reference's own bias, set by hand
        out["losses"].append(torch.stack(losses).detach())
        names = [n for n, m in model.named_modules() if isinstance(m, TopKRouter)]
        out["biases"].append({n: b.tolist() for n, b in zip(names, biases, strict=True)})
    out["weights"] = model.full_state_dict()
    return out


@pytest.mark.slow
def test_dp2_moves_the_bias_by_the_global_batch_load_as_the_hand_reference():
    cfg, data = _sigmoid_cfg(), _data()
    ranks = run_ranks(_dp2_rank, DP, cfg, data)
    ref = _reference(cfg, data)
    for step in range(STEPS):
        for rank in ranks:  # every rank's routers moved alike, bitwise as the reference's
            assert rank["biases"][step] == ref["biases"][step], step
        got = torch.stack([r["losses"][step] for r in ranks])  # [DP, MICRO]
        want = ref["losses"][step].reshape(DP, MICRO)
        torch.testing.assert_close(got, want, **TOL)
    for name, value in ref["weights"].items():
        for rank in ranks:
            torch.testing.assert_close(rank["weights"][name], value, **TOL, msg=name)
    # The biases moved (not all alike: the load differed between experts) and kept
    # moving: the sign rule pushes an over-loaded expert back, so they oscillate.
    first = ref["biases"][0]
    assert all(len(set(v)) > 1 for v in first.values()), first
    assert len({json.dumps(b, sort_keys=True) for b in ref["biases"]}) > 1, ref["biases"]


def test_a_step_without_the_update_would_differ():
    """The reference's bias matters: the same three steps with the bias held at zero route
    other experts (so the comparison above can fail)."""
    cfg, data = _sigmoid_cfg(), _data()
    moved = _reference(cfg, data)
    held = _reference(_cfg(moe_router="sigmoid", moe_bias_update_rate=0.0), data)
    assert torch.equal(moved["losses"][0], held["losses"][0])  # the first step: no bias yet
    assert not torch.equal(moved["losses"][1], held["losses"][1])


def _pretrain(tmp_path, ckpt, steps: int, corpus) -> None:
    from tests.launch_util import run_pretrain

    prefix, tokenizer = corpus
    out = run_pretrain(
        [
            *moe_tiny_run(prefix, tokenizer, steps),
            "model.moe_router=sigmoid",
            f"model.moe_bias_update_rate={GAMMA}",
            "checkpoint.every=1",
            "checkpoint.keep=4",
            f"checkpoint.dir={ckpt}",
        ],
        tmp_path,
        300,
        # One intra-op thread, as run_ranks and test_checkpoint's resume test run theirs:
        # a resume is bitwise only where both runs sum alike, and MKL's two-thread sums
        # are not reproducible between processes (CI once saw the resumed run's weights
        # differ in the last bits, its biases equal).
        OMP_NUM_THREADS="1",
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_training_saves_the_biases_and_a_resume_continues_them_bitwise(tmp_path):
    """moe_tiny with a sigmoid router on one rank: 2 steps in one run, then a copy of its
    step-1 checkpoint resumed to step 2. The checkpoints' trainer state holds the biases;
    the resumed run's step-2 biases and weights are the uninterrupted run's, bitwise (a
    resume that lost the biases would route step 2 otherwise); the final export and the
    training checkpoint both give them to a model loaded for inference."""
    from engine.checkpoint.convert import resolve
    from engine.checkpoint.storage import read_index
    from engine.inference import ModelSource
    from tests.corpus import build_test_corpus

    (tmp_path / "corpus").mkdir()
    corpus = build_test_corpus(tmp_path / "corpus")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _pretrain(tmp_path, whole, 2, corpus)
    parts.mkdir()  # the run as it stood after step 1: its step-1 checkpoint alone
    shutil.copytree(whole / "step_00000001", parts / "step_00000001")
    (parts / "latest").write_text("step_00000001\n")
    _pretrain(tmp_path, parts, 2, corpus)

    def biases(root, step):
        return read_index(resolve(root / f"step_{step:08d}"))["trainer_state"]["router_bias"]

    assert biases(whole, 1) != biases(whole, 2)
    assert biases(parts, 2) == biases(whole, 2)
    assert all(len(set(v)) > 1 for v in biases(whole, 1).values())
    for source in (ModelSource(ckpt=str(whole)), ModelSource(ckpt=str(whole / "final"))):
        cfg, state = source.load()
        model = build_model(cfg, device=DEVICE)
        model.load_full_state_dict(state)
        assert router_biases(model) == biases(whole, 2), source
    _, resumed = ModelSource(ckpt=str(parts)).load()
    for name, value in ModelSource(ckpt=str(whole)).load()[1].items():
        assert torch.equal(resumed[name], value), name


def test_router_biases_round_trip_and_refuse_another_expert_count():
    cfg = _sigmoid_cfg()
    model = build_model(cfg, dtype=F64, device=DEVICE)
    for i, router in enumerate(m for m in model.modules() if isinstance(m, TopKRouter)):
        router.expert_bias.copy_(torch.arange(EXPERTS) * 0.1 + i)
    saved = json.loads(json.dumps(router_biases(model)))  # as the index stores them
    other = build_model(cfg, dtype=F64, device=DEVICE)
    load_router_biases(other, saved)
    assert router_biases(other) == router_biases(model)
    state = other.full_state_dict() | {
        n + ".expert_bias": torch.tensor(v, dtype=torch.float32) for n, v in saved.items()
    }
    third = build_model(cfg, dtype=F64, device=DEVICE)
    third.load_full_state_dict(state)
    assert router_biases(third) == router_biases(model)
    name = next(iter(saved))
    with pytest.raises(ValueError, match=f"{name}: the checkpoint holds 5 expert biases for 6"):
        load_router_biases(third, {name: [0.0] * 5})
