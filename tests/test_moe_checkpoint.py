"""Mixture-of-experts checkpoints are independent of the expert-parallel split.

A checkpoint written at ep 2 (each of two dp ranks holding 3 of the 6 experts) holds every
expert tensor whole, as one written at ep 1 does: the same names, shapes and index entries,
each rank writing its own experts' rows. It resumes at ep 1, at ep 2 and at dp 1, weights
and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) read back bit for bit, and the
steps after the resume follow the uninterrupted run. At dp 4 a 4-expert model's checkpoint
written at ep 4 resumes at ep 2 and ep 1 alike.

Trained in float64 through the runtime's pieces (test_moe_ep's tiny Llama MoE, the local
step runner with its router losses, the all-reduce DP strategy, ``save_checkpoint`` and
``load_checkpoint``). Two sides run the same steps at the same dp but another ep differ
only in summation order (an expert's rows from both ranks in one matmul at ep 2, its
gradient summed over the ranks at ep 1; dp 1 sums its two micro-batches' gradients
locally), ~1e-16 relative per step, so those comparisons are held to 1e-10 absolute;
what only moves between files and ranks (a load, a resume at the saving layout) is
compared with ``torch.equal``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallel_state
from engine.checkpoint import ShardReader, full_optimizer_state, load_checkpoint, save_checkpoint
from engine.checkpoint.layout import MODEL, TensorSpec, assign_writers, local_box
from engine.checkpoint.state import param_states
from engine.data_parallel import build_data_parallel
from engine.models import build_model
from engine.runner import LocalRunner
from parallel_state.dims import ParallelDims
from tests.multiproc import run_ranks
from tests.test_moe_ep import BATCH, OPTIM, SEQ, VOCAB, _cfg

DEVICE = torch.device("cpu")
F64 = torch.float64
SAVED, STEPS = 2, 4  # train 2 steps, save, train 2 more
TOL = dict(rtol=0, atol=1e-10)  # another ep or dp: another summation order (docstring)


def _data(dp: int = 2) -> torch.Tensor:
    """``[STEPS, dp, b, s+1]``: each step's token windows, one per dp index."""
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (STEPS, dp, BATCH, SEQ + 1), generator=gen)


def _state(model, dp) -> dict:
    """Full-shape weights, Adam moments (experts gathered over ep) and each parameter's step."""
    steps = {name: float(param_states(dp)[p]["step"]) for name, p in model.named_parameters()}
    params = {f"model/{n}": t for n, t in model.full_state_dict().items()}
    return dict(tensors={**params, **full_optimizer_state(model, dp)}, steps=steps)


def _run(cfg, data, dp_size: int, ep: int, root: Path, *, save: bool, resume: bool) -> dict:
    """One run at dp ``dp_size`` × ep ``ep`` on this world: optionally resume from ``root``,
    train to step STEPS (saving step SAVED under ``root`` when ``save``). Returns the mean
    fp64 loss of each step it ran and the full state after the resume and at SAVED."""
    parallel_state.destroy()
    ps = parallel_state.initialize(ParallelDims(tp=1, dp=dp_size, ep=ep))
    torch.manual_seed(0)
    model = build_model(cfg, ps, dtype=F64, device=DEVICE)
    groups = (ps.group("expert"), ps.group("expert_grad"))
    dp = build_data_parallel(
        model,
        OPTIM,
        device=DEVICE,
        grad_group=ps.group("grad"),
        tp_group=ps.group("tp"),
        expert_groups=groups,
    )
    runner = LocalRunner(model, ps, contextlib.nullcontext)
    losses = []  # the fp64 model loss of each micro-batch, as the runner computes it
    model.loss = lambda batch, loss=model.loss: losses.append(loss(batch)) or losses[-1]
    out, start = {"losses": {}}, 0
    if resume:
        loaded = load_checkpoint(root, model=model, optimizer=dp, ps=ps, log=lambda msg: None)
        start = loaded.step
        out["resumed"] = _state(model, dp)
    index = ps.rank_in("batch")
    for step in range(start, STEPS):
        # This rank's window; at dp 1 every window, as micro-batches.
        micro = [data[step][index]] if dp_size > 1 else list(data[step])
        losses.clear()
        dp.zero_grad()
        runner.forward_backward(micro, dp)
        dp.finish_grads()
        dp.step(lr=OPTIM.lr, max_norm=OPTIM.clip_grad, norm=dp.grad_norm())
        mine = float(sum(loss.detach() for loss in losses) / len(losses))
        every = [mine] if dp_size == 1 else _gather(mine)
        out["losses"][step + 1] = sum(every) / len(every)
        if save and step + 1 == SAVED:
            out["saved"] = _state(model, dp)
            save_checkpoint(root, SAVED, model=model, optimizer=dp, ps=ps, state={}, keep=1)
    return out


def _gather(value: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _saves_then_resumes(cfg, data, tmp: str, dp_size: int, saves, resumes) -> dict:
    """At dp ``dp_size``: a run from scratch at each ep of ``saves``, saving under tmp/epN
    (its result "epN"); then each (saved ep, ep) of ``resumes``, that checkpoint resumed at
    ep (its result "epS_at_epN")."""
    root, out = Path(tmp), {}
    for ep in saves:
        out[f"ep{ep}"] = _run(cfg, data, dp_size, ep, root / f"ep{ep}", save=True, resume=False)
    for saved, ep in resumes:
        folder = root / f"ep{saved}"
        out[f"ep{saved}_at_ep{ep}"] = _run(cfg, data, dp_size, ep, folder, save=False, resume=True)
    return out


def _two_ranks(cfg, data, tmp: str) -> dict:
    """dp 2 runs: save at ep 2 and at ep 1, then each checkpoint resumed at the other ep (and
    the ep 2 one at ep 2 again)."""
    return _saves_then_resumes(cfg, data, tmp, 2, saves=(2, 1), resumes=((2, 1), (2, 2), (1, 2)))


def _four_ranks(cfg, data, tmp: str) -> dict:
    """dp 4 runs of a 4-expert model: save at ep 4 (one expert per rank) and at ep 1, then
    the ep 4 checkpoint resumed at ep 2 and at ep 1, and the ep 1 one at ep 4."""
    return _saves_then_resumes(cfg, data, tmp, 4, saves=(4, 1), resumes=((4, 2), (4, 1), (1, 4)))


def _each_resume_reads_back(runs: list[dict], files: dict, resumes) -> None:
    """Each resume "epS_at_epN" of ``resumes`` read back exactly the files that run epS
    saved (``files["epS"]``), on every rank, step counts included."""
    for name in resumes:
        saved = name.split("_at_")[0]
        for rank in runs:
            _equal(rank[name]["resumed"]["tensors"], files[saved], f"{name} resumed")
            assert rank[name]["resumed"]["steps"] == rank[saved]["saved"]["steps"], name


def _one_rank(cfg, data, tmp: str) -> dict:
    """The ep 2 checkpoint resumed at dp 1 (both windows of a step as two micro-batches)."""
    return _run(cfg, data, 1, 1, Path(tmp) / "ep2", save=False, resume=True)


def _files(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, read whole from its files."""
    reader = ShardReader(step_dir)
    return {n: reader.read(n) for n, s in reader.specs.items() if s.kind != "rng"}


def _equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in got:
        assert torch.equal(got[name], want[name]), f"{what}: {name}"


@pytest.mark.slow
def test_ep2_checkpoint_is_the_unsplit_one_and_resumes_at_any_ep(tmp_path, capsys):
    cfg, data = _cfg(), _data()
    runs = run_ranks(_two_ranks, 2, cfg, data, str(tmp_path), timeout=300)
    one = run_ranks(_one_rank, 1, cfg, data, str(tmp_path), timeout=300)[0]
    r0 = runs[0]
    step = f"step_{SAVED:08d}"
    ep2, ep1 = _files(tmp_path / "ep2" / step), _files(tmp_path / "ep1" / step)

    # Saved at ep 2: every expert tensor whole (6 experts), exactly the ep 2 run's state
    # gathered over its ep ranks; the same names, shapes and index entries as at ep 1.
    experts = [n for n in ep2 if ".experts." in n]
    assert experts and all(ep2[n].shape[0] == 6 for n in experts)
    _equal(ep2, r0["ep2"]["saved"]["tensors"], "the ep 2 files against the ep 2 run")
    _equal(ep1, r0["ep1"]["saved"]["tensors"], "the ep 1 files against the ep 1 run")
    index = {
        k: json.loads((tmp_path / k / step / "index.json").read_text()) for k in ("ep1", "ep2")
    }
    no_rng = {
        k: {n: s for n, s in i["tensors"].items() if not n.startswith("rng/")}
        for k, i in index.items()
    }
    assert no_rng["ep2"] == no_rng["ep1"]
    assert index["ep2"]["optimizer"] == index["ep1"]["optimizer"]  # each parameter's step
    assert (index["ep2"]["layout"]["ep_size"], index["ep1"]["layout"]["ep_size"]) == (2, 1)
    # tools/checkpoint.py reads and verifies it as any checkpoint, naming the ep it was saved at.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import checkpoint as checkpoint_cli  # tools/checkpoint.py

    capsys.readouterr()
    assert checkpoint_cli.inspect(str(tmp_path / "ep2"), verify=True) == 0
    assert "dp=2 ep=2 (world 2; experts stored whole), dp_shard=" in capsys.readouterr().out
    # Each ep rank wrote its own experts' rows.
    files = index["ep2"]["files"]
    for name in experts:
        rows = [files[f"rank{r:05d}.safetensors"]["slices"][name][0] for r in (0, 1)]
        assert rows == [[0, 3], [3, 6]], name

    # The independent reference: the same steps at ep 1 (summation order only, docstring).
    assert ep2.keys() == ep1.keys()
    for name in ep2:
        torch.testing.assert_close(ep2[name], ep1[name], **TOL, msg=name)
    for s in range(1, SAVED + 1):
        torch.testing.assert_close(r0["ep2"]["losses"][s], r0["ep1"]["losses"][s], **TOL)

    # Every resume reads back exactly what was saved, on every rank, step counts included.
    resumes = ("ep2_at_ep1", "ep2_at_ep2", "ep1_at_ep2")
    _each_resume_reads_back(runs, {"ep2": ep2, "ep1": ep1}, resumes)
    _equal(one["resumed"]["tensors"], ep2, "ep2 resumed at dp 1")
    assert (
        one["resumed"]["steps"]
        == r0["ep2"]["saved"]["steps"]
        == {n: float(SAVED) for n in r0["ep2"]["saved"]["steps"]}
    )

    # The next steps: bit for bit at the saving layout, and to summation order elsewhere.
    after = list(range(SAVED + 1, STEPS + 1))
    assert r0["ep2_at_ep2"]["losses"] == {s: r0["ep2"]["losses"][s] for s in after}
    for name, want in (("ep2_at_ep1", "ep2"), ("ep1_at_ep2", "ep1")):
        assert sorted(r0[name]["losses"]) == after
        for s in after:
            torch.testing.assert_close(r0[name]["losses"][s], r0[want]["losses"][s], **TOL)
    assert sorted(one["losses"]) == after
    for s in after:
        torch.testing.assert_close(one["losses"][s], r0["ep2"]["losses"][s], **TOL)


EXPERT_SPEC = TensorSpec("model/fc1", (4, 3, 2), "float64", MODEL, experts=True)


def test_each_expert_block_is_written_once_at_any_ep():
    """4 experts over dp 4: at ep 4 each rank writes its own expert, at ep 2 each block of
    two is written once by one of its two holders (the ranks of its ``expert_grad`` group),
    at ep 1 one rank writes all four; a rank reads back its own experts' rows."""
    whole = [(0, 3), (0, 2)]
    for ep in (1, 2, 4):
        dims = ParallelDims(tp=1, dp=4, ep=ep)
        plan = assign_writers([EXPERT_SPEC], dims, padded_vocab=0)
        boxes = sorted(mine["model/fc1"] for mine in plan.values() if mine)
        per = 4 // ep
        assert boxes == [[(e * per, (e + 1) * per), *whole] for e in range(ep)], ep
        for rank, mine in plan.items():
            if mine:
                ep_rank = dims.ep_rank_of(rank)
                assert mine["model/fc1"] == local_box(EXPERT_SPEC, 0, 1, 0, ep_rank, ep)
    assert local_box(EXPERT_SPEC, 0, 1, 0, 1, 2) == [(2, 4), *whole]
    not_experts = TensorSpec("model/w", (4, 3, 2), "float64", MODEL)
    assert local_box(not_experts, 0, 1, 0, 1, 2) == [(0, 4), *whole]  # held whole
    with pytest.raises(ValueError, match="its 4 experts do not split over ep_size=3"):
        local_box(EXPERT_SPEC, 0, 1, 0, 0, 3)


@pytest.mark.slow
def test_ep4_checkpoint_resumes_at_ep2_and_ep1(tmp_path):
    """The same at dp 4 with 4 experts: saved at ep 4, each rank wrote its one expert; the
    files are the ep 1 run's (to summation order) and every resume reads them back exactly."""
    cfg, data = _cfg(moe_num_experts=4), _data(4)
    runs = run_ranks(_four_ranks, 4, cfg, data, str(tmp_path), timeout=400)
    r0, step = runs[0], f"step_{SAVED:08d}"
    ep4, ep1 = _files(tmp_path / "ep4" / step), _files(tmp_path / "ep1" / step)
    _equal(ep4, r0["ep4"]["saved"]["tensors"], "the ep 4 files against the ep 4 run")
    _equal(ep1, r0["ep1"]["saved"]["tensors"], "the ep 1 files against the ep 1 run")
    index = json.loads((tmp_path / "ep4" / step / "index.json").read_text())
    experts = [n for n in ep4 if ".experts." in n]
    assert experts and all(ep4[n].shape[0] == 4 for n in experts)
    for name in experts:
        rows = [index["files"][f"rank{r:05d}.safetensors"]["slices"][name][0] for r in range(4)]
        assert rows == [[e, e + 1] for e in range(4)], name
    assert ep4.keys() == ep1.keys()
    for name in ep4:
        torch.testing.assert_close(ep4[name], ep1[name], **TOL, msg=name)
    resumes = ("ep4_at_ep2", "ep4_at_ep1", "ep1_at_ep4")
    _each_resume_reads_back(runs, {"ep4": ep4, "ep1": ep1}, resumes)
    for name in resumes:
        saved = name.split("_at_")[0]
        for s in range(SAVED + 1, STEPS + 1):
            torch.testing.assert_close(r0[name]["losses"][s], r0[saved]["losses"][s], **TOL)
