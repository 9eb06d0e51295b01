"""Training checkpoints: bitwise resume, resharding, crash safety, damage, safe loading, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallel_state
from engine import comm
from engine.checkpoint import (
    CheckpointError,
    ShardReader,
    full_optimizer_state,
    load_checkpoint,
    save_checkpoint,
)
from engine.checkpoint.convert import convert
from engine.checkpoint.format import read_checkpoint
from engine.checkpoint.layout import MODEL, TensorSpec, assign_writers, local_box
from engine.checkpoint.state import as_held_by, param_states, read_local
from engine.checkpoint.storage import write_index
from engine.config import Config, OptimConfig, parallel_dims
from engine.models import build_model
from engine.models.config import preset
from engine.optim import build_optimizer
from layers.param_roles import mark_tp_blocks, mark_tp_dim, replicas
from parallel_state.dims import ParallelDims
from tests.corpus import build_test_corpus
from tests.launch_util import TINY_RUN, run_pretrain
from tests.multiproc import run_ranks
from tests.rank_bodies import in_turn
from tests.test_engine import ROOT, compose_config
from tests.torch_reference import tiny_gpt

sys.path.insert(0, str(ROOT / "tools"))
import checkpoint as checkpoint_cli  # noqa: E402 - tools/checkpoint.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """The fixed test corpus of tests/test_engine.py (tests/corpus.py)."""
    return build_test_corpus(tmp_path_factory.mktemp("corpus"))


def _same_tensors(got: dict, want: dict) -> bool:
    """The same names, each tensor bitwise equal."""
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def run_overrides(corpus, ckpt_dir) -> list[str]:
    """A tiny run whose LR schedule does not depend on max_steps (decay_steps fixed), so a
    run stopped early and re-run longer follows the same schedule as one long run. The
    corpus is small: a 20% validation split holds enough sequences to evaluate."""
    prefix, tokenizer = corpus
    return [
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        *TINY_RUN,
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.eval_batches=2",
        "trainer.global_batch=4",
        "trainer.micro_batch=2",
        "trainer.tensorboard=false",
        "trainer.progress=false",
        "trainer.sample_tokens=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=1",
        "optim.decay_steps=10",
        "trainer.device=cpu",
        f"checkpoint.dir={ckpt_dir}",
        "checkpoint.save_final=false",
    ]


def run_config(corpus, ckpt_dir, *overrides: str) -> Config:
    """:func:`run_overrides` as a Config, logs beside the checkpoint directory."""
    run_dir = f"run_dir={Path(ckpt_dir).parent}"
    cfg = compose_config(*run_overrides(corpus, ckpt_dir), run_dir, *overrides)
    return dataclasses.replace(cfg, dp_size=int(cfg.dp_size))


def _run_all(cfgs: list[Config]) -> list[list[tuple[int, float]]]:
    from engine.worker import run_worker

    return [run_worker(cfg).get("history") for cfg in cfgs]


def _all_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    reader = ShardReader(step_dir)
    return {name: reader.read(name) for name in reader.specs}


RESUME_CASES = {
    # GPT: tp=2 × dp=2 with dropout, so both RNG streams (replicated and TP-sharded) matter.
    "gpt_tp2_dp2": ("model=gpt_tiny", "tp_size=2", "dp_size=2"),
    # BERT: ZeRO-1 over dp=2 (its sharded Adam state must come back too), fp16 whose first
    # two steps overflow at this initial loss scale: resumed with a fresh scale, step 3
    # would be skipped again.
    "bert_tp1_dp2_zero1_fp16": (
        "model=bert_tiny",
        "model.vocab_size=512",
        "model.hidden_size=32",
        "model.num_heads=4",
        "tp_size=1",
        "dp_size=2",
        "optim.distributed=true",
        "trainer.precision=fp16",
        "trainer.loss_scale_init=2e5",
    ),
    # Llama with 2 KV heads at tp=4: each KV head's projection is held by two TP ranks and
    # written by one; both must read it back.
    "llama_tp4_kv2": (
        "model=llama_tiny",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "tp_size=4",
        "dp_size=1",
    ),
}


# The killed-worker test's layout and length, shared by its run and its reference.
KILLED_RUN = ("tp_size=1", "dp_size=2", "trainer.max_steps=4", "checkpoint.every=2")


@pytest.fixture(scope="module")
def launched(corpus, tmp_path_factory) -> dict:
    """Every multi-rank body of this module's round trips, from one launch per world size
    (the ranks start, join gloo and import the engine and torch's optimizer machinery once
    per world size rather than once per fixture or test): at world 4 the resume cases of
    that size, then the layout, Llama and pipeline reshards; at world 2 the resume cases of
    that size, then the killed-worker test's uninterrupted reference and the interrupted
    saves of test_interrupted_save_is_never_loaded. Each body builds and tears down its
    own mesh (run_worker and the Trainers here), and the resume cases run first, as they
    did in launches of their own.

    {"resume": {case: (its folder, the three histories)}, "reshard": {round trip: (its
    folder, rank 0's result)}, "killed_reference": the reference's checkpoint folder,
    "interrupted": rank 0's result of _interrupted_saves}."""
    resume, by_world = {}, {4: [], 2: []}
    for case, layout in RESUME_CASES.items():
        root = tmp_path_factory.mktemp(case)
        overrides = (*layout, "checkpoint.every=2")
        whole = run_config(corpus, root / "whole", "trainer.max_steps=4", *overrides)
        first = run_config(corpus, root / "split", "trainer.max_steps=2", *overrides)
        again = dataclasses.replace(first, trainer=whole.trainer)  # the same command, longer
        resume[case] = (root, [whole, first, again])
        by_world[whole.tp_size * whole.dp_size].append(case)
    roots = {name: tmp_path_factory.mktemp(name) for name in ("layouts", "llama", "pp")}
    reference = tmp_path_factory.mktemp("killed_reference") / "reference"
    interrupted = tmp_path_factory.mktemp("interrupted") / "ckpt"
    converted = str(roots["layouts"] / "converted")  # _layouts_cfgs resumes from there
    extra = {
        4: [
            (_reshard, (_layouts_cfgs(corpus, roots["layouts"]), converted)),
            (_reshard_llama, (_llama_cfgs(corpus, roots["llama"]), str(roots["llama"] / "b"))),
            (_reshard_pp, (_pp_cfgs(corpus, roots["pp"]),)),
        ],
        2: [
            (_run_all, ([run_config(corpus, reference, *KILLED_RUN)],)),
            (_interrupted_saves, (str(interrupted),)),
        ],
    }
    out = {"resume": {}, "killed_reference": reference}
    for world, cases in by_world.items():
        cfgs = [cfg for case in cases for cfg in resume[case][1]]
        calls = [(_run_all, (cfgs,)), *extra[world]]
        # The timeouts of the launches this one replaces, summed.
        histories, *more = run_ranks(in_turn, world, calls, timeout=1500)[0]
        for i, case in enumerate(cases):
            out["resume"][case] = (resume[case][0], histories[3 * i : 3 * i + 3])
        if world == 4:
            out["reshard"] = {name: (roots[name], r) for name, r in zip(roots, more, strict=True)}
        else:
            out["interrupted"] = more[1]
    return out


@pytest.fixture(scope="module")
def resume_runs(launched) -> dict[str, tuple[Path, list]]:
    """Each case of RESUME_CASES run whole (4 steps), stopped after 2 and run again to 4:
    {case: (its folder, the three histories)}."""
    return launched["resume"]


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUME_CASES)
def test_stopped_and_rerun_is_bitwise_identical_to_uninterrupted(resume_runs, case):
    """Exact: the same ops on the same values in the same order, if every state came back."""
    tmp_path, (h_whole, h_first, h_again) = resume_runs[case]
    assert [s for s, _ in h_again] == [3, 4]  # it resumed from step 2
    assert h_first + h_again == h_whole  # losses bit for bit
    a = _all_tensors(tmp_path / "whole" / "step_00000004")
    b = _all_tensors(tmp_path / "split" / "step_00000004")
    assert a.keys() == b.keys() and any(k.startswith("rng/") for k in a)
    for name in a:  # weights, Adam moments and every rank's RNG streams
        assert torch.equal(a[name], b[name]), name


def _reshard(cfgs: dict[str, Config], converted: str) -> dict:
    """Train and save at tp=2 × dp=2, then resume at other layouts (see the test)."""
    from engine.trainer import Trainer

    def trainer(cfg: Config) -> Trainer:
        parallel_state.destroy()
        return Trainer(cfg, parallel_state.initialize(cfg.tp_size, cfg.dp_size))

    saver = trainer(cfgs["save"])
    out = {"saved": saver.fit()["eval"]["valid/loss"]}
    saved_moments = full_optimizer_state(saver.model, saver.dp)
    if dist.get_rank() == 0:
        convert(cfgs["save"].checkpoint.dir, converted, tp_size=4, dp_size=1)
    dist.barrier()
    params = {}
    for name in ("tp4_dp1", "tp4_dp1_converted", "tp1_dp4_zero1", "tp2_dp2"):
        t = trainer(cfgs[name])
        moments = full_optimizer_state(t.model, t.dp)
        params[name] = t.model.full_state_dict()
        out[name] = {
            "step": t.step,
            "valid": t.evaluate()["valid/loss"],
            "moments_equal": moments.keys() == saved_moments.keys()
            and all(torch.equal(moments[k], saved_moments[k]) for k in moments),
            "history": t.fit()["history"] if name != "tp4_dp1_converted" else None,
        }
    a, b = params["tp4_dp1"], params["tp4_dp1_converted"]
    out["converted_params_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    return out


@pytest.fixture(scope="module")
def reshards(launched) -> dict[str, tuple[Path, dict]]:
    """{round trip: (its folder, rank 0's result)} for the layouts, Llama past its KV heads
    and pipeline stages round trips, each in a folder of its own."""
    return launched["reshard"]


def _layouts_cfgs(corpus, tmp_path: Path) -> dict[str, Config]:
    """The runs of test_reshard_model_and_optimizer_across_layouts under ``tmp_path``."""
    ckpt = tmp_path / "ckpt"
    # One sequence per micro-batch at every layout; validation is 8 fixed micro-batches.
    base = (
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        "trainer.micro_batch=1",
        "trainer.eval_batches=8",
    )
    resume = (*base, "trainer.max_steps=5", "checkpoint.every=0")  # read-only resumes

    def layout(tp: int, dp: int) -> tuple[str, ...]:
        return f"tp_size={tp}", f"dp_size={dp}"

    return {
        "save": run_config(
            corpus, ckpt, *base, "trainer.max_steps=3", "checkpoint.every=3", *layout(2, 2)
        ),
        "tp4_dp1": run_config(corpus, ckpt, *resume, *layout(4, 1)),
        "tp4_dp1_converted": run_config(corpus, tmp_path / "converted", *resume, *layout(4, 1)),
        "tp1_dp4_zero1": run_config(corpus, ckpt, *resume, *layout(1, 4), "optim.distributed=true"),
        "tp2_dp2": run_config(corpus, ckpt, *resume, *layout(2, 2)),
    }


@pytest.mark.slow
def test_reshard_model_and_optimizer_across_layouts(reshards):
    """Save at tp=2 × dp=2; resume at tp=4 × dp=1 (online, and from an offline-converted
    copy) and at tp=1 × dp=4 under ZeRO-1.

    Adam moments and parameters only move between files and ranks: exact. Validation loss
    at another TP size sums the same products in another order: fp32, 1e-6 relative. Two
    further steps follow the reference (resumed at the saving layout) to 1e-5: Adam turns
    last-bit gradient differences into slightly larger parameter differences.
    """
    _, out = reshards["layouts"]
    print(out)
    reference = [loss for _, loss in out["tp2_dp2"]["history"]]
    assert out["converted_params_equal"]
    for name in ("tp4_dp1", "tp4_dp1_converted", "tp1_dp4_zero1", "tp2_dp2"):
        r = out[name]
        assert r["step"] == 3 and r["moments_equal"], (name, r)
        assert abs(r["valid"] - out["saved"]) <= 1e-6 * out["saved"], (name, r, out["saved"])
        if r["history"] is not None:
            assert [s for s, _ in r["history"]] == [4, 5]
            losses = [loss for _, loss in r["history"]]
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


KV = TensorSpec("model/kv", (32, 8), "float32", MODEL, tp_dim=0, tp_blocks=2)


def test_a_block_past_the_kv_heads_is_written_once_and_read_by_every_holder():
    """2 KV-head blocks at tp=4 × dp=2: TP ranks 0, 1 hold rows 0:16, TP ranks 2, 3 rows
    16:32 (and their DP replicas the same); one of each block's four holders writes it."""
    top, bottom = [(0, 16), (0, 8)], [(16, 32), (0, 8)]
    assert [local_box(KV, t, 4, 128) for t in range(4)] == [top, top, bottom, bottom]
    assert [local_box(KV, t, 2, 128) for t in range(2)] == [top, bottom]  # an ordinary split
    plan = assign_writers([KV], ParallelDims(4, 2), padded_vocab=128)
    writers = {r: mine["model/kv"] for r, mine in plan.items() if mine}
    assert sorted(writers.values()) == [top, bottom]
    dp_groups = ParallelDims(4, 2).group_ranks("dp")  # the DP replicas of each TP rank
    for rank, box in writers.items():
        holders = [r for t in range(4) if local_box(KV, t, 4, 128) == box for r in dp_groups[t]]
        assert rank in holders and len(holders) == 4
    with pytest.raises(ValueError, match="2 blocks .* and tp_size=3"):
        local_box(KV, 0, 3, 128)


def test_an_index_without_block_counts_is_cut_as_the_model_says():
    """An index written before block counts were recorded (at a tp up to the KV heads) is
    read past the KV heads with the count the model's parameter declares."""
    param = torch.nn.Parameter(torch.zeros(16, 8))
    mark_tp_dim(param, 0)
    mark_tp_blocks(param, 2)
    spec = as_held_by(dataclasses.replace(KV, tp_blocks=None), param)
    assert spec == KV and local_box(spec, 1, 4, 128) == [(0, 16), (0, 8)]


def test_a_stored_tensor_smaller_than_the_models_is_refused():
    """Only vocabulary padding may be missing from a stored slice: a tensor cut wrong (or
    another model's) is an error, not a partly filled parameter."""

    class Reader:
        def read(self, name, box):
            return torch.ones([hi - lo for lo, hi in box])

    model = build_model(dataclasses.replace(CFG, num_layers=1))
    small = dataclasses.replace(KV, tp_blocks=None, shape=(16, 8))
    with pytest.raises(ValueError, match=r"model/kv: stored shape \[16, 8\] does not fit"):
        read_local(Reader(), small, torch.Size([32, 8]), model)
    padded = dataclasses.replace(small, vocab_padded=True)  # vocabulary rows: zero-padded
    assert read_local(Reader(), padded, torch.Size([32, 8]), model).sum() == 16 * 8


def _holders_agree(t) -> bool:
    """Every TP rank holding a KV head's block (GQA past the KV heads) holds the same values
    as the block's first holder: weights, and the Adam moments beside them."""
    size, states = t.ps.tp_size, param_states(t.dp)
    for p in t.model.parameters():
        copies = replicas(p)
        moments = [v for _, v in sorted(states.get(p, {}).items()) if torch.is_tensor(v)]
        for local in (p.detach(), *moments) if copies > 1 else ():
            held = torch.stack(comm.all_gather_object(local, t.ps.tp_group))
            if not torch.equal(held, held[torch.arange(size) // copies * copies]):
                return False
    return True


def _reshard_llama(cfgs: dict[str, Config], spare: str) -> dict:
    """Save a Llama with 2 KV heads at tp=4 (each head held by two TP ranks), resume at
    other layouts, and the reverse (see the test)."""
    from engine.trainer import Trainer

    def trainer(cfg: Config) -> Trainer:
        parallel_state.destroy()
        return Trainer(cfg, parallel_state.initialize(parallel_dims(cfg, 4)))

    def state_of(t: Trainer) -> tuple[dict, dict]:
        return t.model.full_state_dict(), full_optimizer_state(t.model, t.dp)

    saver = trainer(cfgs["save"])
    saver.fit()
    saved = {("a", 3): state_of(saver), ("b", 3): state_of(saver)}
    if dist.get_rank() == 0:  # a second root, for a second resume that saves
        shutil.copytree(cfgs["save"].checkpoint.dir, spare)
    dist.barrier()
    out = {}
    for name in ("tp4", "tp2_dp2", "tp1_dp4_zero1", "tp4_from_tp2", "tp4_from_tp1"):
        cfg = cfgs[name]
        root = "b" if cfg.checkpoint.dir == spare else "a"
        t = trainer(cfg)
        (params, moments), (want_params, want_moments) = state_of(t), saved[(root, t.step)]
        out[name] = {
            "step": t.step,
            "params_equal": _same_tensors(params, want_params),
            "moments_equal": _same_tensors(moments, want_moments),
            "holders_agree": _holders_agree(t),
            "history": t.fit()["history"],
        }
        if cfg.checkpoint.every:  # it saved its last step: a reverse resume reads that
            saved[(root, t.step)] = state_of(t)
        out[name]["holders_agree_after"] = _holders_agree(t)
    if dist.get_rank() == 0:
        out["saved"] = {k: v for k, v in saved.items() if k[0] == "a" and k[1] == 3}
    return out


def _llama_cfgs(corpus, tmp_path: Path) -> dict[str, Config]:
    """The runs of test_reshard_llama_past_the_kv_heads: saved under ``tmp_path``/a, the
    ZeRO-1 resume's own copy under ``tmp_path``/b."""
    a, b = tmp_path / "a", tmp_path / "b"
    base = (
        "model=llama_tiny",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "trainer.micro_batch=1",
    )

    def layout(tp: int, dp: int) -> tuple[str, ...]:
        return f"tp_size={tp}", f"dp_size={dp}"

    def resume(root: Path, steps: int, save: bool, *more: str) -> Config:
        every = f"checkpoint.every={steps if save else 0}"
        return run_config(corpus, root, *base, f"trainer.max_steps={steps}", every, *more)

    return {
        "save": resume(a, 3, True, *layout(4, 1)),
        "tp4": resume(a, 5, False, *layout(4, 1)),
        "tp2_dp2": resume(a, 5, True, *layout(2, 2)),
        "tp1_dp4_zero1": resume(b, 5, True, *layout(1, 4), "parallel.dp_shard=optimizer"),
        "tp4_from_tp2": resume(a, 6, False, *layout(4, 1)),
        "tp4_from_tp1": resume(b, 6, False, *layout(4, 1)),
    }


@pytest.mark.slow
def test_reshard_llama_past_the_kv_heads(reshards, capsys):
    """Llama with 2 KV heads saved at tp=4, where each KV head's projection is replicated
    on two TP ranks: resumed at tp 4, tp 2 × dp 2 and tp 1 × dp 4 under ZeRO-1; the last
    two save again and are resumed at tp 4 (the reverse). Then the checkpoint tools read
    the tp=4 checkpoint.

    Weights and Adam moments only move between files and ranks: exact (torch.equal), on
    every rank holding a replicated block. The two steps after a resume at another layout
    sum the same fp32 products in another order: 1e-5 relative to the resume at tp 4, as
    in test_reshard_model_and_optimizer_across_layouts.
    """
    tmp_path, out = reshards["llama"]
    out, a = dict(out), tmp_path / "a"  # (a copy: the saved state is taken out below)
    saved_params, saved_moments = out.pop("saved")[("a", 3)]
    for name, r in out.items():
        assert r["params_equal"] and r["moments_equal"], (name, r)
        assert r["holders_agree"] and r["holders_agree_after"], (name, r)
    assert [r["step"] for r in out.values()] == [3, 3, 3, 5, 5]
    reference = [loss for _, loss in out["tp4"]["history"]]
    for name in ("tp2_dp2", "tp1_dp4_zero1"):
        assert [s for s, _ in out[name]["history"]] == [4, 5]
        losses = [loss for _, loss in out[name]["history"]]
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)

    # The tools on the tp=4 checkpoint: one file piece per KV head (one writer per block).
    step3 = a / "step_00000003"
    capsys.readouterr()
    assert checkpoint_cli.main(["inspect", str(step3)]) == 0
    kv = "layers.0.attention.key_value.weight"
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"model/{kv} "))
    assert line.split()[1:6] == ["[32,", "32]", "float32", "0", "2"], line
    stored = _all_tensors(step3)
    for name, value in saved_params.items():
        assert torch.equal(stored[f"model/{name}"], value), name
    for name, value in saved_moments.items():
        assert torch.equal(stored[name], value), name
    for tp, dp in ((1, 1), (4, 2)):
        root = tmp_path / f"tp{tp}dp{dp}"
        args = ["convert", str(step3), "--tp-size", str(tp), "--dp-size", str(dp)]
        out = ["--out", str(root)] if tp == 1 else [str(root)]  # OUT last, as export-dcp's
        assert checkpoint_cli.main([*args, *out]) == 0
        converted = _all_tensors(root / "step_00000003")
        assert converted.keys() == {k for k in stored if not k.startswith("rng/")}
        assert all(torch.equal(converted[k], stored[k]) for k in converted)
        pieces = ShardReader(root / "step_00000003").index["files"].values()
        assert sum(f"model/{kv}" in f["slices"] for f in pieces) == min(tp, 2)
    assert checkpoint_cli.main(["export-model", str(step3), "--out", str(tmp_path / "m")]) == 0
    exported = read_checkpoint(tmp_path / "m").state
    assert exported.keys() == saved_params.keys()
    assert all(torch.equal(exported[k], saved_params[k]) for k in exported)


# ----------------------------------------------------------------- crash-safety of saving

CFG = tiny_gpt(500)
POINTS = ("after_shard", "before_index", "before_rename", "before_latest")


class SimulatedCrash(RuntimeError):
    """Raised by the fault hook where a real job would have died."""


def _model_and_optimizer(tp_group=None, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(CFG, tp_group=tp_group)
    return model, build_optimizer(model, OptimConfig(lr=1e-2), torch.device("cpu"))


def _train_step(model, optimizer, seed: int) -> None:
    x = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(seed))
    model(x[:, :-1], x[:, 1:]).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _interrupted_saves(root: str) -> dict:
    ps = parallel_state.initialize(2, 1)
    model, optimizer = _model_and_optimizer(ps.tp_group)
    _train_step(model, optimizer, 1)
    save_checkpoint(root, 1, model=model, optimizer=optimizer, ps=ps, state={})
    good = model.full_state_dict()
    out = {}
    for i, point in enumerate(POINTS):
        _train_step(model, optimizer, 2 + i)  # the state an interrupted save would hold

        def fault(at: str, point=point) -> None:
            # Shards are written by every rank: crash only rank 1 there, so the ranks must
            # agree on the failure; the later points run on rank 0 alone.
            if at == point and (at != "after_shard" or ps.rank == 1):
                raise SimulatedCrash(at)

        with pytest.raises(CheckpointError) as err:
            save_checkpoint(root, 2, model=model, optimizer=optimizer, ps=ps, state={}, fault=fault)
        fresh, fresh_opt = _model_and_optimizer(ps.tp_group, seed=7)
        loaded = load_checkpoint(root, model=fresh, optimizer=fresh_opt, ps=ps, log=print)
        params = fresh.full_state_dict()
        out[point] = {
            "error": str(err.value),
            "loaded_step": loaded.step,
            "loaded_good": all(torch.equal(params[k], good[k]) for k in good),
        }
    save_checkpoint(root, 2, model=model, optimizer=optimizer, ps=ps, state={})
    out["after_clean_save"] = sorted(os.listdir(root))
    return out


@pytest.mark.slow
def test_interrupted_save_is_never_loaded(launched):
    """A save that dies between shards, before the index, before the rename or before
    ``latest`` moves leaves the previous checkpoint the one that loads; the next good save
    clears the debris. (Run on the world-2 ranks of fixture ``launched``.)"""
    out = launched["interrupted"]
    for point in POINTS:
        r = out[point]
        assert "SimulatedCrash" in r["error"] and point in r["error"], r
        assert r["loaded_step"] == 1 and r["loaded_good"], (point, r)
    assert out["after_clean_save"] == ["latest", "step_00000001", "step_00000002"]


# ------------------------------------------------------------------ damage and fallback


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Steps 1 and 2 of a tiny model at tp=2 (two files each), written offline.

    Saved in this process at tp=1 and re-sharded by ``convert``; returns the root and the
    step-1 weights. Loading here (tp=1) needs both files of a step.
    """
    model, optimizer = _model_and_optimizer()
    single = tmp_path / "single"
    weights = {}
    for step in (1, 2):
        _train_step(model, optimizer, step)
        weights[step] = model.full_state_dict()
        save_checkpoint(single, step, model=model, optimizer=optimizer, ps=None, state={})
        convert(single / f"step_{step:08d}", tmp_path / "ckpt", tp_size=2, dp_size=1)
    return tmp_path / "ckpt", weights[1]


def _load(root: Path) -> tuple[object, list[str]]:
    messages: list[str] = []
    model, optimizer = _model_and_optimizer(seed=9)
    loaded = load_checkpoint(root, model=model, optimizer=optimizer, ps=None, log=messages.append)
    return (loaded, model), messages


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x10  # inside the tensor data, past the header
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": ("step_00000002/rank00001.safetensors", _truncate, "truncated"),
    "bit_flip": ("step_00000002/rank00000.safetensors", _flip_bit, "hash does not match the index"),
    "index_edited": (
        "step_00000002/index.json",
        lambda p: p.write_text(p.read_text().replace('"step": 2', '"step": 3')),
        "does not match its checksum",
    ),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_file_is_named_and_previous_checkpoint_loads(two_checkpoints, case, capsys):
    root, step1 = two_checkpoints
    fname, damage, why = DAMAGE[case]
    damage(root / fname)
    (loaded, model), messages = _load(root)
    assert loaded.step == 1
    params = model.full_state_dict()
    assert all(torch.equal(params[k], step1[k]) for k in step1)
    assert len(messages) == 1, messages
    assert str(root / fname) in messages[0] and why in messages[0], messages
    assert "falling back to step_00000001" in messages[0], messages
    # Reading the damaged checkpoint itself fails naming the file, and inspect flags it.
    with pytest.raises(CheckpointError, match=fname.split("/")[1]):
        _all_tensors(root / "step_00000002")
    capsys.readouterr()
    assert checkpoint_cli.main(["inspect", str(root / "step_00000002")]) in (1, 2)
    captured = capsys.readouterr()
    assert fname.split("/")[1] in captured.out + captured.err


def test_broken_latest_falls_back_and_nothing_usable_is_an_error(two_checkpoints):
    root, _ = two_checkpoints
    (root / "latest").write_text("garbage\n")
    (loaded, _), messages = _load(root)
    assert loaded.step == 2 and "latest is damaged" in messages[0], messages
    for step in (1, 2):
        _truncate(root / f"step_{step:08d}" / "rank00000.safetensors")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        _load(root)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    """A shape mismatch is no damage to fall back from: it stops the run, saying what."""
    model, optimizer = _model_and_optimizer()
    save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=optimizer, ps=None, state={})
    wider = build_model(dataclasses.replace(CFG, hidden_size=64))
    with pytest.raises(ValueError, match="hidden_size=32, the model 64"):
        load_checkpoint(tmp_path / "ckpt", model=wider, optimizer=None, ps=None)


# ------------------------------------------------------------------------- safe loading


class _Payload:
    """Unpickling this creates ``path``: the stand-in for arbitrary code execution."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _resign(step_dir: Path, fname: str) -> None:
    """Update the index for a replaced file, as an attacker who can write the index would."""
    from engine.checkpoint.storage import sha256_file

    index = json.loads((step_dir / "index.json").read_text())
    record = index["files"].setdefault(fname, {"slices": {}})
    record.update(bytes=(step_dir / fname).stat().st_size, sha256=sha256_file(step_dir / fname))
    write_index(step_dir, {k: v for k, v in index.items() if k != "index_sha256"})


def _plant_pickle_shard(step_dir: Path, payload: bytes) -> None:
    (step_dir / "rank00000.safetensors").write_bytes(payload)
    _resign(step_dir, "rank00000.safetensors")


def _plant_pt_file(step_dir: Path, payload: bytes) -> None:
    (step_dir / "evil.pt").write_bytes(payload)
    _resign(step_dir, "evil.pt")


def _plant_pickle_index(step_dir: Path, payload: bytes) -> None:
    (step_dir / "index.json").write_bytes(payload)


@pytest.mark.parametrize("plant", [_plant_pickle_shard, _plant_pt_file, _plant_pickle_index])
def test_pickle_payload_is_never_executed(tmp_path, plant):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(control)))
    assert control.exists()  # the payload is live: unpickling it does run code
    sentinel = tmp_path / "pwned"
    model, optimizer = _model_and_optimizer()
    save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=optimizer, ps=None, state={})
    plant(tmp_path / "ckpt" / "step_00000001", pickle.dumps(_Payload(sentinel)))
    with pytest.raises(CheckpointError) as err:
        _load(tmp_path / "ckpt")
    assert "step_00000001" in str(err.value)
    assert checkpoint_cli.main(["inspect", str(tmp_path / "ckpt")]) != 0
    assert not sentinel.exists()


# ------------------------------------------------------------------------------ the CLI


@pytest.mark.slow
def test_convert_names_the_preset_a_resume_needs(tmp_path, capsys):
    """A checkpoint of ``model=llama_tiny`` converted: the printed resume command carries
    ``model=llama_tiny``, which the run needs (without it, it refuses another model)."""
    model = build_model(preset("llama_tiny"))
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    save_checkpoint(tmp_path / "ck", 3, model=model, optimizer=optimizer, ps=None, state={})
    out = tmp_path / "tp2"
    args = ["convert", str(tmp_path / "ck"), "--tp-size", "2", "--dp-size", "1", "--out", str(out)]
    assert checkpoint_cli.main(args) == 0
    assert capsys.readouterr().out == (
        f"wrote {out / 'step_00000003'} for tp=2 dp=1; resume with checkpoint.dir={out} "
        "model=llama_tiny tp_size=2 dp_size=1\n"
    )


def test_inspect_convert_and_export_cli(tmp_path, capsys):
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, 1)
    root = tmp_path / "ckpt"
    save_checkpoint(
        root,
        1,
        model=model,
        optimizer=optimizer,
        ps=None,
        state={"data": {"consumed_samples": 8}, "loss_scaler": None},
    )
    assert checkpoint_cli.main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step 1" in out and "layout: tp=1 dp=1 (world 1), dp_shard=none" in out
    assert "8 samples consumed" in out
    word = next(line for line in out.splitlines() if line.startswith("model/embedding.word"))
    assert word.split()[1:5] == ["[500,", "32]", "float32", "0"], word
    assert "optim/layers.0.mlp.fc1.weight/exp_avg_sq" in out and out.rstrip().endswith("OK")

    out_root = tmp_path / "tp2dp2"
    args = ["convert", str(root), "--tp-size", "2", "--dp-size", "2", "--out", str(out_root)]
    assert checkpoint_cli.main(args) == 0
    # the model is no preset's (vocab 500): the resume command needs no model=NAME
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith(f"resume with checkpoint.dir={out_root} tp_size=2 dp_size=2")
    )
    assert checkpoint_cli.main(["inspect", str(out_root)]) == 0
    out = capsys.readouterr().out
    assert "layout: tp=2 dp=2 (world 4), dp_shard=none, converted from tp=1 dp=1" in out
    assert (
        sum(line.startswith("rank0000") and line.endswith("OK") for line in out.splitlines()) == 4
    )
    before, after = _all_tensors(root / "step_00000001"), _all_tensors(out_root / "step_00000001")
    assert after.keys() == {k for k in before if not k.startswith("rng/")}
    for name in after:
        assert torch.equal(after[name], before[name]), name

    assert checkpoint_cli.main(["export-model", str(out_root), "--out", str(tmp_path / "m")]) == 0
    exported, full = read_checkpoint(tmp_path / "m"), model.full_state_dict()
    assert exported.state.keys() == full.keys()
    assert all(torch.equal(exported.state[k], full[k]) for k in full)

    assert (
        checkpoint_cli.main(
            [
                "convert",
                str(root),
                "--tp-size",
                "3",
                "--dp-size",
                "1",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "model.num_heads=4 is not divisible by tp_size=3" in capsys.readouterr().err

    script = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "checkpoint.py"),
            "inspect",
            str(out_root),
            "--no-verify",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert script.returncode == 0 and "not checked" in script.stdout, script.stderr


# ------------------------------------------------------------------ a real worker death


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_bitwise(corpus, tmp_path, launched):
    """engine.pretrain with trainer.max_restarts=1: rank 1 dies (os._exit) after step 3,
    before that step's checkpoint; the elastic agent restarts both workers, which resume
    from step 2 with no user action and end bit-identical to an uninterrupted run.

    The console says what happened in one line of ours, with no traceback (torch's
    records go to the run log), and the run log holds the console's lines, uncoloured.
    """

    overrides = [
        *run_overrides(corpus, tmp_path / "elastic"),
        *KILLED_RUN,
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "trainer.max_restarts=1",
        "trainer.fail_at_step=3",
    ]
    # OMP_NUM_THREADS as run_ranks sets it: one intra-op thread, the same sums.
    proc = run_pretrain(overrides, tmp_path, 300, OMP_NUM_THREADS="1")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert (tmp_path / "elastic" / ".failed_at_step_3").exists()  # the kill did happen
    assert "resuming from step 2" in log, log[-3000:]
    assert "rank 1 died (exit code 17); restart 1/1 from step 2" in proc.stderr, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    run_log = (tmp_path / "hydra" / "pretrain.log").read_text()
    assert "resuming from step 2" in run_log and "saved checkpoint" in run_log, run_log[-2000:]
    assert "failed (exitcode: 17)" in run_log  # torch's own record, kept out of the console
    assert "\x1b[" not in run_log  # plain text, no colour codes
    # The uninterrupted reference: the same run by run_ranks' ranks (fixture ``launched``).
    a = _all_tensors(tmp_path / "elastic" / "step_00000004")
    b = _all_tensors(launched["killed_reference"] / "step_00000004")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_rng_state_of_another_device_kind_is_not_restored(tmp_path, monkeypatch):
    """A checkpoint saved on CPU and resumed where the generators are CUDA ones (or the
    reverse) must load the weights and reseed, not crash on a foreign RNG state."""
    import engine.checkpoint.manager as manager

    cfg = preset("gpt_tiny", vocab_size=100, hidden_size=16, num_heads=2, num_layers=1)
    model = build_model(cfg)
    save_checkpoint(tmp_path, 3, model=model, optimizer=None, ps=None, state={})
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.nn.init.zeros_(model.embedding.word.weight)
    real_of = manager._Mesh.of
    monkeypatch.setattr(
        manager._Mesh,
        "of",
        classmethod(lambda cls, ps: dataclasses.replace(real_of(ps), device_type="cuda")),
    )
    loaded = load_checkpoint(tmp_path, model=model, optimizer=None, ps=None, log=lambda _: None)
    assert loaded.step == 3 and not loaded.rng_restored
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name


class _GroupStepOptimizer(torch.optim.Optimizer):
    """Counts steps in each parameter group, as apex's FusedAdam does (apex is not installed
    here); keeps one moment per parameter so the per-parameter path is exercised too."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
        for group in self.param_groups:
            group["step"] = 0

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] += 1
            for p in group["params"]:
                self.state[p].setdefault("exp_avg", torch.zeros_like(p)).add_(p.grad)


def test_group_step_count_survives_resume(tmp_path):
    cfg = preset("gpt_tiny", vocab_size=100, hidden_size=16, num_heads=2, num_layers=1)
    model = build_model(cfg)
    opt = _GroupStepOptimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for _ in range(3):
        opt.step()
    save_checkpoint(tmp_path, 3, model=model, optimizer=opt, ps=None, state={})
    fresh = build_model(cfg)
    fresh_opt = _GroupStepOptimizer(fresh.parameters())
    load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, ps=None, log=lambda _: None)
    assert fresh_opt.param_groups[0]["step"] == 3  # not restarted at 0: no bias-correction spike
    moment = next(iter(fresh_opt.state.values()))["exp_avg"]
    assert torch.equal(moment, torch.full_like(moment, 3.0))


def _one_rank_cannot_read(root: str) -> str:
    import engine.checkpoint.manager as manager

    ps = parallel_state.initialize(1, 2)
    ps.seed(0)
    cfg = preset("gpt_tiny", vocab_size=100, hidden_size=16, num_heads=2, num_layers=1)
    model = build_model(cfg)
    save_checkpoint(root, 1, model=model, optimizer=None, ps=ps, state={})
    if ps.rank == 1:  # e.g. a file system error on one node only

        def broken(*args, **kwargs):
            raise OSError("disk went away")

        manager._read_rank = broken
    try:
        load_checkpoint(root, model=model, optimizer=None, ps=ps, log=lambda _: None)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return f"{type(err).__name__}: {err}"
    return "loaded"


@pytest.mark.slow
def test_an_error_on_one_rank_reaches_every_rank_without_a_hang(tmp_path):
    # 60 s is far more than a load of this model takes; a rank left waiting in the
    # agreement all-gather would instead sit there until the 600 s collective timeout.
    rank0, rank1 = run_ranks(_one_rank_cannot_read, 2, str(tmp_path / "ckpt"), timeout=60)
    assert rank1 == "OSError: disk went away"
    assert rank0.startswith("CheckpointError: loading") and "failed on rank 1" in rank0


def test_weight_files_get_ordinary_umask_permissions(tmp_path):
    """safetensors alone writes 0600 files; teammates on a shared cluster must read them."""
    from engine.checkpoint.format import save_model

    old = os.umask(0o022)
    try:
        cfg = preset("gpt_tiny", vocab_size=100, hidden_size=16, num_heads=2, num_layers=1)
        model = build_model(cfg)
        save_checkpoint(tmp_path / "run", 1, model=model, optimizer=None, ps=None, state={})
        save_model(model, tmp_path / "final")
    finally:
        os.umask(old)
    files = list((tmp_path / "run").glob("step_*/*.safetensors")) + [
        tmp_path / "final" / "model.safetensors"
    ]
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files), files


def test_inspect_explains_a_model_only_directory(tmp_path):
    from engine.checkpoint.convert import resolve
    from engine.checkpoint.format import save_model

    cfg = preset("gpt_tiny", vocab_size=100, hidden_size=16, num_heads=2, num_layers=1)
    save_model(build_model(cfg), tmp_path / "final")
    with pytest.raises(CheckpointError, match="is a model-only export"):
        resolve(tmp_path / "final")


def test_inspect_lists_a_model_export(tmp_path, capsys):
    """``checkpoint.py inspect ROOT/final`` was refused ("not a training checkpoint"); a
    model export now gets its model, its origin, its tensors as safetensors' own header
    gives them (the reference: safe_open), and its files; a cut weights file exits 1."""
    from safetensors import safe_open

    from engine.checkpoint.format import save_model

    model, optimizer = _model_and_optimizer()
    save_checkpoint(tmp_path / "run", 3, model=model, optimizer=optimizer, ps=None, state={})
    save_model(model, tmp_path / "run" / "final")
    final = tmp_path / "run" / "final"
    assert checkpoint_cli.main(["inspect", str(final)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"model export {final}: ") and out[0].endswith("in 2 files")
    assert (
        out[2] == f"from: the end of the run in {tmp_path / 'run'} (its latest checkpoint: step 3)"
    )
    with safe_open(final / "model.safetensors", "pt") as f:
        names = list(f.keys())  # a safe_open handle is no dict
        expected = {
            k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in names
        }
    rows = {
        line.split()[0]: line for line in out if line.split()[:1] and line.split()[0] in expected
    }
    assert rows.keys() == expected.keys()
    for name, (shape, dtype) in expected.items():
        assert rows[name].split(None, 1)[1].split() == [*f"{shape}".split(), dtype], rows[name]
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # cut short
    assert checkpoint_cli.main(["inspect", str(final)]) == 1
    assert "DAMAGED: " in capsys.readouterr().out


def _gathered_moments(t) -> dict[str, torch.Tensor]:
    """Every parameter's full Adam moments, over TP, DP and the pipeline stages."""
    merged: dict[str, torch.Tensor] = {}
    for part in comm.all_gather_object(full_optimizer_state(t.model, t.dp), t.ps.pp_group):
        for name, value in part.items():
            merged.setdefault(name, value)  # a tied copy: the first stage's
    return merged


def _reshard_pp(cfgs: dict[str, Config]) -> dict:
    """Save at pp=2 × tp=2, resume at pp 4, pp 1 (ZeRO-1 over dp 4) and pp 1 × tp 2 × dp 2,
    which saves again and is resumed at pp 2 × tp 2 (the reverse)."""
    from engine.trainer import Trainer

    def trainer(cfg: Config) -> Trainer:
        parallel_state.destroy()
        return Trainer(cfg, parallel_state.initialize(parallel_dims(cfg, 4)))

    saver = trainer(cfgs["save"])
    saver.fit()
    out, saved = {}, {3: (saver.model.full_state_dict(), _gathered_moments(saver))}
    for name in ("pp4", "pp1_dp4_zero1", "pp1_tp2_dp2", "pp2_back"):
        t = trainer(cfgs[name])
        params, moments = t.model.full_state_dict(), _gathered_moments(t)
        want_params, want_moments = saved[t.step]
        out[name] = {
            "step": t.step,
            "params_equal": _same_tensors(params, want_params),
            "moments_equal": _same_tensors(moments, want_moments),
            "history": t.fit()["history"],
        }
        if name == "pp1_tp2_dp2":  # it saved step 5: the reverse resume reads that
            saved[5] = (t.model.full_state_dict(), _gathered_moments(t))
    return out


def _pp_cfgs(corpus, tmp_path: Path) -> dict[str, Config]:
    """The runs of test_reshard_across_pipeline_stages under ``tmp_path``."""
    ckpt = tmp_path / "ckpt"
    base = (
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        "model.num_layers=4",
        "trainer.micro_batch=1",
        "trainer.global_batch=8",
    )

    def layout(pp: int, tp: int, dp: int) -> tuple[str, ...]:
        return f"pp_size={pp}", f"tp_size={tp}", f"dp_size={dp}"

    resume = (*base, "trainer.max_steps=4", "checkpoint.every=0")  # read-only resumes
    return {
        "save": run_config(
            corpus, ckpt, *base, "trainer.max_steps=3", "checkpoint.every=3", *layout(2, 2, 1)
        ),
        "pp4": run_config(corpus, ckpt, *resume, *layout(4, 1, 1)),
        "pp1_dp4_zero1": run_config(
            corpus, ckpt, *resume, *layout(1, 1, 4), "optim.distributed=true"
        ),
        "pp1_tp2_dp2": run_config(
            corpus, ckpt, *base, "trainer.max_steps=5", "checkpoint.every=5", *layout(1, 2, 2)
        ),
        "pp2_back": run_config(corpus, ckpt, *base, "trainer.max_steps=6", *layout(2, 2, 1)),
    }


@pytest.mark.slow
def test_reshard_across_pipeline_stages(reshards):
    """Parameters and Adam moments only move between files and ranks: exact (torch.equal),
    whatever pp, tp, dp and ZeRO-1 the checkpoint is written and read at."""
    _, out = reshards["pp"]
    print(out)
    for name, r in out.items():
        assert r["params_equal"] and r["moments_equal"], (name, r)
    assert [out[n]["step"] for n in out] == [3, 3, 3, 5]
    # The step after the resume: the same fp32 sums in another order at each layout (the
    # micro-batch accumulation, TP and DP reductions), so 1e-5 relative, as above.
    step4 = [out[n]["history"][0] for n in ("pp4", "pp1_dp4_zero1", "pp1_tp2_dp2")]
    assert all(s == 4 for s, _ in step4)
    torch.testing.assert_close([x for _, x in step4], [step4[2][1]] * 3, rtol=1e-5, atol=0)


# ------------------------------------------------ convert --out never damages another run


def _saved_run(root: Path, steps, cfg=CFG) -> Path:
    """A run's checkpoint root holding ``steps`` of a tiny model, saved at tp=1."""
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2), torch.device("cpu"))
    for step in steps:
        save_checkpoint(root, step, model=model, optimizer=optimizer, ps=None, state={}, keep=9)
    return root


def _tree_hashes(root: Path) -> dict[str, str]:
    """{relative path: SHA-256} of every file under ``root`` (and '' per directory)."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


LLAMA = preset("llama_tiny", vocab_size=500, hidden_size=32, ffn_hidden_size=64)
OTHER_SOURCES = {  # a source another run's root must refuse, whatever it is
    "same_model_older_step": ([2], CFG),  # would move latest back from 5 to 2
    "same_model_newer_step": ([7], CFG),  # would put a foreign step 7 after the run's 5
    "same_step": ([5], CFG),  # would replace the run's own step 5
    "another_family": ([3], LLAMA),
}


@pytest.mark.parametrize("case", OTHER_SOURCES)
def test_convert_refuses_a_root_holding_another_runs_steps(tmp_path, case, capsys):
    """A run root with steps 1..5 is refused as --out (one line, exit 2) and is left
    byte-identical: no step replaced or added, ``latest`` not moved, no lock file made."""
    run = _saved_run(tmp_path / "run", range(1, 6))
    steps, cfg = OTHER_SOURCES[case]
    src = _saved_run(tmp_path / "src", steps, cfg)
    assert sorted(p.name for p in run.glob("step_*")) == [f"step_{s:08d}" for s in range(1, 6)]
    before = _tree_hashes(run)
    args = ["convert", str(src), "--tp-size", "2", "--dp-size", "1", "--out", str(run)]
    assert checkpoint_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {run} holds step_00000001" in err, err
    assert "another run's steps or latest" in err
    assert _tree_hashes(run) == before
    with pytest.raises(ValueError, match="holds step_00000001, not converted from"):
        convert(src, run, tp_size=1, dp_size=1)
    assert _tree_hashes(run) == before


@pytest.mark.parametrize("where", ["root/sub", "root/step_00000003/x", "root/step_00000003"])
def test_convert_refuses_out_inside_the_source(tmp_path, where, capsys):
    src = _saved_run(tmp_path / "root", [3])
    before = _tree_hashes(src)
    out = tmp_path / where
    for given in (src, src / "step_00000003"):
        args = ["convert", str(given), "--tp-size", "2", "--dp-size", "1", "--out", str(out)]
        assert checkpoint_cli.main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is inside the source run's checkpoint root" in err
        assert _tree_hashes(src) == before  # nothing made under the source either


def test_convert_into_new_empty_or_own_root(tmp_path):
    """A new root and an empty one take the converted step as before; a root of this
    source's earlier converts at the same layout takes newer steps only, and refuses
    another source's or another layout's step."""
    src = _saved_run(tmp_path / "src", [1, 2, 3])
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "nested", tmp_path / "empty"):
        assert convert(src / "step_00000002", out, tp_size=2, dp_size=1).name == "step_00000002"
        assert (out / "latest").read_text().strip() == "step_00000002"
        assert _same_tensors(
            _all_tensors(out / "step_00000002"),
            {k: v for k, v in _all_tensors(src / "step_00000002").items() if "rng/" not in k},
        )
    own = tmp_path / "empty"
    before = _tree_hashes(own)
    for step in (1, 2):  # an older or the same step: never backwards, never replaced
        with pytest.raises(ValueError, match=f"holds step 2 .*not older than step {step}"):
            convert(src / f"step_{step:08d}", own, tp_size=2, dp_size=1)
    with pytest.raises(ValueError, match="not converted from .* at this tp/dp"):
        convert(src, own, tp_size=1, dp_size=2)
    other = _saved_run(tmp_path / "other", [4])
    with pytest.raises(ValueError, match=f"not converted from {other.resolve()}"):
        convert(other, own, tp_size=2, dp_size=1)
    assert _tree_hashes(own) == before
    convert(src, own, tp_size=2, dp_size=1)  # step 3: newer, added
    assert (own / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in own.glob("step_*")) == [f"step_{s:08d}" for s in (2, 3)]


def test_convert_refuses_a_root_a_run_holds_or_left_files_in(tmp_path, capsys):
    """A root whose lock names a run (alive, or dead before its first save) or holding
    anything but convert's own steps is refused, untouched (no lock takeover)."""
    src = _saved_run(tmp_path / "src", [2])
    cases = {
        "locked": (".lock", '{"user": "u", "host": "h", "pid": 1, "started": "s", "run_dir": "r"}'),
        "latest_only": ("latest", "step_00000009\n"),
        "other_file": ("notes.txt", "mine\n"),
        "debris": (".tmp-step_00000001-abc/rank00000.safetensors", "x"),
    }
    for name, (rel, text) in cases.items():
        root = tmp_path / name
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text(text)
        before = _tree_hashes(root)
        args = ["convert", str(src), "--tp-size", "1", "--dp-size", "1", "--out", str(root)]
        assert checkpoint_cli.main(args) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {root} is " in err, (name, err)
        assert _tree_hashes(root) == before, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_and_optimizer_on_a_gpu_save_and_load_exactly(tmp_path):
    """A checkpoint of GPU tensors loads back into GPU tensors, every value exact (the
    reads go through host memory; found by tools/gpu_check.py on an H200, 2026-11-26)."""
    torch.manual_seed(0)
    model = build_model(preset("gpt_tiny", hidden_dropout=0.0), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, ps=None, state={})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            optimizer.state[p]["exp_avg"].zero_()
    load_checkpoint(tmp_path, model=model, optimizer=optimizer, ps=None, log=lambda m: None)
    for n, p in model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p, saved[n]), n
        assert torch.equal(optimizer.state[p]["exp_avg"], moments[n]), n
