"""optim=muon (engine/muon.py): a tp=2 and a dp=2 run against one process stepping the
unsplit model with torch's own ``torch.optim.Muon`` and ``AdamW``, a save/resume that
continues bitwise (and fails when the momentum is not restored), and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import parallel_state
from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.config import Config, OptimConfig, parallel_dims, validate
from engine.data_parallel import build_data_parallel
from engine.data_parallel.interface import PlainOptimizerState
from engine.models import build_model
from tests.multiproc import run_ranks
from tests.rank_bodies import case_result, run_cases
from tests.torch_reference import alone_group, tiny_gpt

CFG = tiny_gpt(500)
# clip_grad below the gradient norm, so every step clips (over both optimizers' params).
MUON = OptimConfig(algorithm="muon", lr=2e-2, weight_decay=0.1, clip_grad=0.3)
STEPS = 3


def _batch(step: int) -> torch.Tensor:
    """One global batch of 4 sequences of 17 tokens."""
    return torch.randint(0, 500, (4, 17), generator=torch.Generator().manual_seed(100 + step))


def _reference(cfg=CFG, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The unsplit fp64 model, whole batch: torch.optim.Muon on the 2-D weights of
    ``layers.*``, torch's AdamW on the rest (decay on matrices), clip_grad_norm_ over all.
    None of meshtron's optimizer, clipping or gradient code."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64, tp_group=alone_group())
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n.startswith("layers.") and p.dim() == 2]
    rest = [p for n, p in named if not (n.startswith("layers.") and p.dim() == 2)]
    muon = torch.optim.Muon(
        hidden,
        lr=MUON.lr,
        weight_decay=MUON.weight_decay,
        momentum=MUON.muon_momentum,
        ns_steps=MUON.muon_ns_steps,
        adjust_lr_fn=MUON.muon_adjust_lr,
    )
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": MUON.weight_decay},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=MUON.lr,
        betas=(MUON.beta1, MUON.beta2),
        eps=MUON.eps,
    )
    params = [p for _, p in named]
    for step in range(steps):
        x = _batch(step)
        model(x[:, :-1], x[:, 1:]).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, MUON.clip_grad)
        muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _strategy(model, ps, optim: OptimConfig = MUON):
    return build_data_parallel(
        model,
        optim,
        grad_group=ps.dp_group,
        tp_group=ps.tp_group,
        device=torch.device("cpu"),
        bucket_size_mb=0.01,
    )


def _train(model, dp, ps, first: int, last: int) -> None:
    """Steps ``first .. last - 1``: this DP rank's rows of each global batch."""
    dp_size = dist.get_world_size(ps.dp_group)
    rows = 4 // dp_size
    for step in range(first, last):
        x = _batch(step)[rows * ps.dp_rank : rows * (ps.dp_rank + 1)]
        model(x[:, :-1], x[:, 1:]).mean().backward()
        dp.finish_grads()
        dp.step(lr=MUON.lr, max_norm=MUON.clip_grad, norm=dp.grad_norm())
        dp.zero_grad()


def _split_vs_reference(tp: int, dp: int, kv_heads: int | None = None) -> dict:
    cfg = tiny_gpt(500, num_kv_heads=kv_heads)
    ps = parallel_state.initialize(tp, dp)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64, tp_group=ps.tp_group)
    strategy = _strategy(model, ps)
    _train(model, strategy, ps, 0, STEPS)
    got = model.full_state_dict()
    ref = _reference(cfg)
    out = {
        "optimizer": type(strategy.optimizer).__name__,
        "muon_params": sum(len(g["params"]) for g in strategy.optimizer.param_groups if g["muon"]),
        "errors": {n: _error(got[n], w) for n, w in ref.items()},
        # How far the run moved, so a run that updated nothing cannot pass.
        "moved": max((ref[n] - w).abs().max().item() for n, w in _initial(cfg).items()),
    }
    parallel_state.destroy()
    return out


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|Δ| / max|want| (the reference's vocabulary padding rows cut off)."""
    want = want[: got.shape[0]] if got.dim() else want
    return ((got - want).abs().max() / want.abs().max()).item()


def _initial(cfg) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64, tp_group=alone_group())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# (tp, dp, kv_heads, Muon matrices) of each split run; every one takes 2 ranks.
SPLITS = {"tp2": (2, 1, None, 8), "dp2": (1, 2, None, 8), "tp2-one-kv-head": (2, 1, 1, 10)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Every 2-rank body of this file in one launch of the ranks (tests/rank_bodies.py):
    the three split runs and the resume. Each test reads its own body's result."""
    cases = {name: (_split_vs_reference, (tp, dp, kv)) for name, (tp, dp, kv, _) in SPLITS.items()}
    cases["resume"] = (_resume, (str(tmp_path_factory.mktemp("muon") / "ckpt"),))
    return run_ranks(run_cases, 2, cases, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
def test_split_muon_matches_torch_muon_on_the_unsplit_model(two_ranks, split):
    """fp64, 3 steps, within 1e-10 of torch.optim.Muon + AdamW on one process.

    Why 1e-10 and not bitwise: a TP-split matmul (and the DP all-reduce) sums the gradient
    in another order, so gradients differ in the last fp64 bits (~1e-16 relative). Muon
    casts its update to bf16 for Newton-Schulz; a 1e-16 difference crosses a bf16
    rounding boundary with probability ~2^-44 per element, so the bf16 input, and with it
    the whole Newton-Schulz output, is bitwise the reference's, gathered in the unsplit
    layout. What remains is the fp64 differences of the momentum and AdamW's parameters,
    amplified by Adam's first steps to ~1e-13 at most. A wrong gather (another layout, a
    shard orthogonalized alone, the lr adjusted for the shard's shape) moves a matrix by
    ~lr ~ 1e-2 relative to its ~0.1 entries: eleven orders above the bound.

    With one KV head at tp=2 both TP ranks hold the whole key/value projection (GQA's
    replicas): the gather keeps one copy, so it is orthogonalized as the unsplit model's."""
    matrices = SPLITS[split][3]
    for res in case_result(two_ranks, split):
        assert res["optimizer"] == "TPMuon" and res["muon_params"] == matrices, res
        assert res["moved"] > 1e-3, res
        worst = max(res["errors"].values())
        assert worst <= 1e-10, res["errors"]


def _resume(root: str) -> dict:
    """tp=2: 4 steps straight; 2 steps, save, a fresh model (another seed) loads, 2 more;
    and the same resume with the momentum buffers dropped after loading."""
    ps = parallel_state.initialize(2, 1)

    def fresh(seed: int):
        torch.manual_seed(seed)
        model = build_model(CFG, dtype=torch.float64, tp_group=ps.tp_group)
        return model, _strategy(model, ps)

    model, dp = fresh(0)
    _train(model, dp, ps, 0, 4)
    straight = model.full_state_dict()

    model, dp = fresh(0)
    _train(model, dp, ps, 0, 2)
    save_checkpoint(root, 2, model=model, optimizer=dp, ps=ps, state={})
    saved_keys = sorted({k for st in dp.optimizer.state.values() for k in st})

    out = {"saved_keys": saved_keys}
    for drop in (False, True):
        model, dp = fresh(7)
        loaded = load_checkpoint(root, model=model, optimizer=dp, ps=ps, log=print)
        if drop:
            for st in dp.optimizer.state.values():
                st.pop("momentum_buffer", None)
        _train(model, dp, ps, loaded.step, 4)
        out["dropped" if drop else "kept"] = _compare(model.full_state_dict(), straight)
    # The same checkpoint at tp=1 × dp=2: the momentum is stored at full shape, cut anew.
    parallel_state.destroy()
    ps = parallel_state.initialize(1, 2)
    model, dp = fresh(7)
    loaded = load_checkpoint(root, model=model, optimizer=dp, ps=ps, log=print)
    _train(model, dp, ps, loaded.step, 4)
    out["at_tp1_dp2"] = _compare(model.full_state_dict(), straight)
    parallel_state.destroy()
    return out


def _compare(got: dict, want: dict) -> dict:
    return {
        "bitwise": all(torch.equal(got[k], want[k]) for k in want),
        "max_diff": max((got[k] - want[k]).abs().max().item() for k in want),
    }


@pytest.mark.slow
def test_muon_resumes_bitwise_and_needs_its_momentum(two_ranks):
    """Saved at step 2 and resumed into a model initialized from another seed, the run
    ends bitwise equal to the uninterrupted one; resumed without the momentum buffers it
    does not (so the test can fail, and the momentum is part of what a resume restores).
    Resumed at tp=1 × dp=2 instead it ends within 1e-12 (another summation order of the
    gradients, as in the split-run test; 5e-15 absolute measured)."""
    for res in case_result(two_ranks, "resume"):
        assert "momentum_buffer" in res["saved_keys"] and "exp_avg" in res["saved_keys"], res
        assert res["kept"]["bitwise"], res
        assert not res["dropped"]["bitwise"] and res["dropped"]["max_diff"] > 1e-4, res
        assert res["at_tp1_dp2"]["max_diff"] <= 1e-12, res


def test_muon_with_dp_sharding_is_refused_at_the_config():
    """ZeRO-1 and FSDP hand a rank flat gradient slices: one line, before any worker."""
    for shard in ("optimizer", "gradients", "full"):
        cfg = Config(optim=MUON)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard=shard))
        problems = validate(cfg, parallel_dims(cfg, 4))
        assert any("optim=muon" in p and f"dp_shard={shard}" in p for p in problems), problems
    cfg = Config(optim=MUON)
    assert not [p for p in validate(cfg, parallel_dims(cfg, 4)) if "muon" in p]


def test_muon_settings_out_of_range_are_refused():
    cfg = Config(
        optim=dataclasses.replace(
            MUON, muon_momentum=1.0, muon_ns_steps=0, muon_adjust_lr="rms", impl="apex"
        )
    )
    problems = " | ".join(validate(cfg, parallel_dims(cfg, 4)))
    for key in ("optim.muon_momentum=1.0", "optim.muon_ns_steps=0", "optim.muon_adjust_lr='rms'"):
        assert key in problems, problems
    assert "optim=muon runs torch's AdamW" in problems, problems
    cfg = Config(optim=dataclasses.replace(MUON, algorithm="lion"))
    assert "optim.algorithm='lion' is not one of adamw, muon" in validate(
        cfg, parallel_dims(cfg, 4)
    )


@pytest.mark.slow
def test_adamw_state_is_refused_by_muon():
    """A checkpoint of an AdamW run loaded into Muon, or of a Muon run into AdamW, stops
    with one line instead of continuing from moments of another algorithm."""
    from engine.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(CFG, dtype=torch.float64, tp_group=None)
    adamw = build_optimizer(
        model, dataclasses.replace(MUON, algorithm="adamw"), torch.device("cpu")
    )
    muon = build_optimizer(model, MUON, torch.device("cpu"))
    x = _batch(0)
    model(x[:, :-1], x[:, 1:]).mean().backward()
    adamw.step()
    muon.step()
    plain = {p: dict(adamw.state[p]) for p in model.parameters()}
    mixed = {p: dict(muon.state[p]) for p in model.parameters()}
    with pytest.raises(ValueError, match="optim.algorithm"):
        PlainOptimizerState(muon).load_param_states(plain)
    # ... before anything was replaced: Muon's state is the same tensors as before.
    assert all(muon.state[p][k] is v for p in mixed for k, v in mixed[p].items())
    with pytest.raises(ValueError, match="resume it with optim=muon"):
        PlainOptimizerState(adamw).load_param_states(mixed)
