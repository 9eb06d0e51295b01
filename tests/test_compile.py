"""``model.compile=true`` (the whole forward and loss) against eager: the same loss and
gradients, at TP=1 and TP=2, with and without sequence parallelism, recomputation and
dropout.

fp32. With dropout the compiled step draws eager's masks from the same RNG streams
(``layers.dropout``), so the same tolerance holds, and afterwards every stream of the
tracker is where eager left it (compared bitwise). Tolerance 2e-5 relative
(max |Δ| / max |ref| per tensor), as in test_kernels_model.py: a compiled graph fuses the
element-wise ops and may reorder the LayerNorm and bias-gradient reductions, each off by a
few fp32 ulps, compounding through the layer, the LM head and the cross-entropy.

TP=1 uses the real backend (inductor, which generates and compiles C++ on CPU); TP=2 uses
``aot_eager``, which traces forward and backward through Dynamo and AOTAutograd exactly as
inductor sees them (collectives, sequence parallelism, recomputation) but skips code
generation, so the multi-rank cases stay within seconds. Each test also checks that
Dynamo captured graphs, so a silent fallback to eager cannot pass.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import parallel_state
from engine.models import build_model
from engine.models.config import preset
from layers.compile import selective_recompute_compiles
from tests.multiproc import run_ranks
from tests.torch_reference import tiny_gpt

TOL = 2e-5
INTERPRETER = {"TRITON_INTERPRET": "1"}
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}


# The tests' model: tiny_gpt (dropout off unless a case sets it) at vocabulary 128, cut to
# one layer and 16 positions.
VOCAB = 128
SMALL = dict(num_layers=1, max_positions=16)


def _loss_and_grads(compile_backend: str | None, **overrides):
    ps = parallel_state.get() if parallel_state.is_initialized() else None
    settings = dict(
        SMALL,
        compile=compile_backend is not None,
        compile_backend=compile_backend or "inductor",
    )
    if compile_backend is None:
        overrides.pop("cuda_graphs", None)  # the eager reference has no graphs to replay
    cfg = tiny_gpt(VOCAB, **{**settings, **overrides})
    ps.seed(5) if ps is not None else torch.manual_seed(5)
    model = build_model(cfg, ps) if ps is not None else build_model(cfg)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    streams = ps.rng.get_states() if ps is not None else {"default": torch.get_rng_state()}
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, streams


def _worst_error(reference, compiled) -> tuple[str, float]:
    (ref_loss, ref_grads, ref_streams), (loss, grads, streams) = reference, compiled
    errors = {"loss": ((loss - ref_loss).abs() / ref_loss.abs()).item()}
    for name, ref in ref_grads.items():
        errors[name] = ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    for name, ref in ref_streams.items():  # the RNG streams: bitwise, or an infinite error
        errors[f"RNG stream {name}"] = 0.0 if torch.equal(streams[name], ref) else math.inf
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def _compare(backend: str, **overrides) -> tuple[str, float, int, int]:
    """(worst tensor, its relative error, graphs Dynamo captured, graph breaks) of compiled
    vs eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    reference = _loss_and_grads(None, **overrides)
    torch._dynamo.reset()  # a fresh cache: no recompilation for an earlier case's model
    counters.clear()
    compiled = _loss_and_grads(backend, **overrides)
    breaks = sum(counters["graph_break"].values())
    return (*_worst_error(reference, compiled), counters["stats"]["unique_graphs"], breaks)


def _on_tp(tp_size: int, backend: str, cases: list[dict], *, initialized: bool = False):
    """``_compare`` of each case on a ParallelState of ``tp_size`` (its RNG tracker: the
    attention's dropout draws from the sharded stream at TP=1 too); ``initialized``: the
    caller has made that state."""
    if not initialized:
        parallel_state.initialize(tp_size)
    return [_compare(backend, **overrides) for overrides in cases]


DROPOUT_TP1_CASES = [{"recompute": mode, **DROPOUT} for mode in ("none", "full", "selective")]


def _tp1_results() -> dict[str, list]:
    """The TP=1 cases of the tests below, run by the two ranks of ``tp2_results`` after
    their TP=2 part (a TP=1 mesh in a world of two: each rank's TP group is itself, so the
    model is the TP=1 model a world of one builds, and seeds and streams are those of TP
    rank 0). The ranks share the work, rank 0 the inductor step with dropout and rank 1
    the aot_eager dropout cases: no third process pays Dynamo's one-time start again."""
    parallel_state.initialize(1)
    if torch.distributed.get_rank() == 0:
        return {"inductor": _on_tp(1, "inductor", [DROPOUT], initialized=True)}
    return {"aot_eager": _on_tp(1, "aot_eager", DROPOUT_TP1_CASES, initialized=True)}


@pytest.fixture(scope="module")
def tp1_results(tp2_results) -> dict[str, list]:
    """``_tp1_results`` of both ranks, in one dict."""
    return {**tp2_results[0]["tp1"], **tp2_results[1]["tp1"]}


@pytest.mark.slow
def test_whole_step_compiles_to_one_graph_tp1(tp1_results):
    """Embedding, layer, head and cross-entropy: one graph, no break, eager's numbers (with
    dropout: eager's masks, drawn by the op inductor calls between its kernels)."""
    worst, err, graphs, breaks = _compare("inductor")
    assert (graphs, breaks) == (1, 0)
    assert err <= TOL, f"{worst}: {err:.2e}"
    ((worst, err, graphs, breaks),) = tp1_results["inductor"]
    assert (graphs, breaks) == (1, 0)
    assert err <= TOL, f"dropout: {worst}: {err:.2e}"


@pytest.mark.slow
def test_full_recompute_is_traced_whole_without_dropout_tp1():
    """Without dropout there is no RNG to replay: the checkpoint is traced into the graph."""
    worst, err, graphs, breaks = _compare("aot_eager", recompute="full")
    assert (graphs, breaks) == (1, 0)
    assert err <= TOL, f"{worst}: {err:.2e}"


@pytest.mark.slow
def test_dropout_is_traced_and_draws_eagers_masks_tp1(tp1_results):
    """Dropout 0.1 (embedding, attention on the sharded stream, residuals), with and without
    recomputation: one graph, and eager's masks (a mask from another stream, or redrawn in
    the recomputation, moves the loss or the gradients by 1e-3 to 1, and the streams)."""
    results = tp1_results["aot_eager"]
    for overrides, (worst, err, graphs, breaks) in zip(DROPOUT_TP1_CASES, results, strict=True):
        assert (graphs, breaks) == (1, 0), overrides
        assert err <= TOL, f"{overrides}: {worst}: {err:.2e}"


# (overrides, graphs and breaks expected, or None for "at least one graph").
# Left out for the suite's time (2026-11-27): three cases that are a dropout case below
# without its masks (SP alone; SP with full recomputation; the Triton kernels with full
# recomputation). Their graphs are the dropout case's minus the mask draws; each passed
# here with the expected (1, 0) / at least one graph before it was removed.
TP2_CASES = [
    ({"sequence_parallel": False}, (1, 0)),
    ({"sequence_parallel": False, "recompute": "selective"}, (1, 0)),
    # Dropout: replicated masks (no SP) and sequence-sharded ones (SP), attention's sharded.
    ({"sequence_parallel": False, **DROPOUT}, (1, 0)),
    ({"sequence_parallel": True, "recompute": "full", **DROPOUT}, (1, 0)),
    ({"sequence_parallel": True, "recompute": "selective", **DROPOUT}, (1, 0)),
    # The Triton kernels (interpreted on CPU) run eagerly between graphs; with them the
    # checkpoint stays eager, with its replay (layers/compile.py).
    ({"sequence_parallel": True, "recompute": "full", "kernels": "triton", **DROPOUT}, None),
]


def _tp2_cases() -> list[tuple[dict, tuple[int, int] | None]]:
    """TP2_CASES this torch compiles (selective recomputation only where it is right)."""
    if selective_recompute_compiles():
        return TP2_CASES
    return [c for c in TP2_CASES if c[0].get("recompute") != "selective"]


def _tp2_results() -> dict[str, object]:
    """Every multi-rank check of this file on one pair of ranks (Dynamo's one-time start,
    some seconds a rank, is paid once): the compiled step against eager for each of
    ``_tp2_cases``, the graphs with the step timer attached, the compiled draws, and then
    the TP=1 cases (``_tp1_results``)."""
    cases = _on_tp(2, "aot_eager", [c[0] for c in _tp2_cases()])
    parallel_state.destroy()
    timer = _graphs_with_step_timer(2)
    parallel_state.destroy()
    draws = _compiled_draws()
    parallel_state.destroy()
    return {"cases": cases, "step timer": timer, "draws": draws, "tp1": _tp1_results()}


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, object]]:
    """``_tp2_results`` of each of the two ranks, in rank order. The ranks report once, at
    the end of all four parts (about 2 minutes on a loaded 2-core machine): hence the
    longer limit than run_ranks' 180 s without a report."""
    return run_ranks(_tp2_results, 2, env=INTERPRETER, timeout=600.0)


@pytest.mark.slow
def test_whole_step_matches_eager_tp2(tp2_results):
    """TP=2 with and without sequence parallelism and recomputation, collectives in the
    graph: without SP or recomputation the whole step is one graph."""
    cases = _tp2_cases()
    if not selective_recompute_compiles():
        # This torch traced it into gradients 100 % off (layers/compile.py): refused.
        with pytest.raises(ValueError, match="recompute=selective at tp_size=2 gives wrong"):
            preset("gpt_tiny", compile=True, recompute="selective").validate(2)
    for rank_results in (rank["cases"] for rank in tp2_results):
        for (overrides, expected), (worst, err, graphs, breaks) in zip(
            cases, rank_results, strict=True
        ):
            assert graphs >= 1, f"{overrides}: Dynamo captured {graphs} graphs"
            if expected is not None:
                assert (graphs, breaks) == expected, overrides
            assert err <= TOL, f"{overrides}: {worst}: {err:.2e}"


def _compiled_draws() -> dict[str, bool]:
    from layers import dropout

    ps = parallel_state.initialize(2)
    x = torch.ones(64, 64)
    qkv = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(0))  # same on both

    def draws(x, qkv):
        return (
            dropout.dropout(x, 0.5, True, rng=ps.rng, sharded=False),
            dropout.native_dropout(x, 0.5, rng=ps.rng, sharded=False),
            dropout.dropout(x, 0.5, True, rng=ps.rng, sharded=True),
            dropout.attention(qkv, qkv, qkv, None, 0.5, causal=True, rng=ps.rng),
        )

    ps.seed(3)
    eager = draws(x, qkv)
    ps.seed(3)
    compiled = torch.compile(draws, backend="aot_eager", fullgraph=True)(x, qkv)
    across_tp = []
    for t in compiled:
        parts = [torch.empty_like(t) for _ in range(2)]
        torch.distributed.all_gather(parts, t, group=ps.tp_group)
        across_tp.append(torch.equal(*parts))
    return {
        # Scaling by 1 / (1 - 0.5) = 2 is exact: the masked ones are bitwise eager's.
        "compiled dropout = eager's": all(
            torch.equal(a, b) for a, b in zip(compiled[:3], eager[:3], strict=True)
        ),
        # The compiled attention is torch's math written out: a few fp32 ulps off.
        "compiled attention ~ eager's": torch.allclose(compiled[3], eager[3], rtol=1e-6, atol=0),
        "replicated masks equal across TP": across_tp[0] and across_tp[1],
        "sharded masks differ across TP": not (across_tp[2] or across_tp[3]),
    }


@pytest.mark.slow
def test_compiled_dropout_keeps_the_tp_streams(tp2_results):
    """At TP=2, in one compiled graph (no break): replicated dropout draws the same mask on
    both TP ranks, sharded dropout and attention dropout a mask of each rank's own (the
    inputs are equal on both ranks, so only the masks can differ), each the mask eager
    draws from the same seed. P[two independent 4096-element masks equal] = 2^-4096."""
    for checks in (rank["draws"] for rank in tp2_results):
        assert all(checks.values()), checks


def test_unknown_compile_backend_is_rejected():
    with pytest.raises(ValueError, match="model.compile_backend='tvm' is not one of"):
        preset("gpt_tiny", compile=True, compile_backend="tvm").validate(1)


def test_cuda_graphs_are_refused_where_they_cannot_replay(monkeypatch):
    """model.cuda_graphs: one-line errors for an eager or non-inductor model, dropout (its
    masks switch RNG streams on the host) and a run or model off CUDA (here: the CPU; the
    trainer's CLI cases are in test_bad_input.py)."""
    from engine.config import _cuda_graphs_device_problem
    from layers.compile import compile_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _cuda_graphs_device_problem("auto") == [
        "model.cuda_graphs=true replays CUDA graphs, but no CUDA device is visible"
    ]

    graphs = {"cuda_graphs": True, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    with pytest.raises(ValueError, match="set model.compile=true and model.compile_backend=in"):
        preset("gpt_tiny", **graphs).validate(1)
    with pytest.raises(ValueError, match="compile_backend='aot_eager'"):
        preset("gpt_tiny", compile=True, compile_backend="aot_eager", **graphs).validate(1)
    with pytest.raises(ValueError, match="needs model.hidden_dropout=0 and model.attention_"):
        preset("gpt_tiny", compile=True, cuda_graphs=True).validate(1)
    preset("gpt_tiny", compile=True, **graphs).validate(2)  # the settings themselves are fine
    with pytest.raises(ValueError, match="on a CUDA device; its parameters are on cpu$"):
        compile_model(torch.nn.Linear(2, 2, device="cpu"), cuda_graphs=True)


@pytest.mark.slow
def test_cuda_graphs_mode_compiles_the_step_on_cpu(monkeypatch):
    """The reduce-overhead compile of the whole step, run on CPU with the device check
    lifted: inductor's CUDA-graph wrapper skips CPU graphs, so this checks the mode's
    compile path (one graph, no break) and eager's numbers, not a replay (no GPU here)."""
    from torch._dynamo.utils import counters

    import layers.compile

    monkeypatch.setattr(layers.compile, "check_cuda_graphs", lambda model, backend: None)
    worst, err, graphs, breaks = _compare("inductor", cuda_graphs=True)
    assert (graphs, breaks) == (1, 0)
    assert err <= TOL, f"{worst}: {err:.2e}"
    # The mode reached inductor: its CUDA-graph wrapper saw the graphs (and skipped them).
    assert counters["inductor"]["cudagraph_skips"] >= 1


@pytest.mark.slow  # 18 s on 2 idle cores (2 layers): it compiles and counts every graph
def test_graph_break_tool_counts_what_dynamo_reports(capsys):
    """tools/count_graph_breaks.py: the step is one graph, with dropout and full
    recomputation too; a Triton kernel (run eagerly) breaks it. The optimizer update is
    two graphs, the clipping's and AdamW's, split by the two breaks torch puts around
    every ``Optimizer.step`` (``torch._dynamo.graph_break()`` in torch/optim).

    One layer: Dynamo inlines each layer's code again (compile time grows with the
    layers), and one layer already holds every construct counted here (the traced
    checkpoint with its dropout masks, the kernels' breaks, every parameter kind of the
    update), as the one-layer TP=2 cases above show."""
    from studies.bench.graph_breaks import main

    small = ["--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "128", "--seq", "8"]
    assert main([*small, "--json", "--dropout", "0.1", "--recompute", "full"]) == 0
    result = json.loads(capsys.readouterr().out)
    update = result.pop("update")
    assert result == {"graphs": 1, "graph_breaks": 0, "reasons": {}}
    assert update["compiled"] and (update["graphs"], update["graph_breaks"]) == (2, 2), update
    assert all("graph_break()" in reason for reason in update["reasons"]), update
    # The update is counted above; here the step alone (the update's compile is ~2/3 of a run).
    assert main([*small, "--json", "--kernels", "triton", "--no-update"]) == 0  # interpreted
    result = json.loads(capsys.readouterr().out)
    assert result["graph_breaks"] >= 2 and result["graphs"] >= 3, result
    # An MoE under bf16 autocast (--precision bf16): one graph, the routing and the
    # grouped GEMM inside it; in fp32 the experts' per-expert loop needs the counts on
    # the host and runs eagerly between graphs (torch.compiler.disable), one break per
    # call (2 a layer: fc1 and fc2).
    moe = [*small, "--preset", "moe_tiny", "--json", "--no-update"]
    assert main([*moe, "--precision", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out) == {"graphs": 1, "graph_breaks": 0, "reasons": {}}
    assert main(moe) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["graph_breaks"] >= 2, result
    assert all("torch.compiler.disable" in reason for reason in result["reasons"]), result


def _graphs_with_step_timer(tp: int) -> tuple[int, int]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from engine.step_timer import _Clock
    from layers.utils import attach_comm_timer

    ps = parallel_state.initialize(tp)
    cfg = tiny_gpt(VOCAB, **SMALL, compile=True, compile_backend="aot_eager")
    model = build_model(cfg, ps)
    attach_comm_timer(model, _Clock(torch.device("cpu")))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    counters.clear()
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.slow
def test_step_timer_does_not_break_the_compiled_graph(tp2_results):
    """The trainer hands the layers its TP clock (engine.step_timer); its host clock reads
    would break a compiled graph at every collective, so a compiled step leaves them out:
    still one graph, no break, at TP=2."""
    for graphs, breaks in (rank["step timer"] for rank in tp2_results):
        assert (graphs, breaks) == (1, 0)


def test_compile_defaults_to_auto_compiled_on_cuda_where_the_layout_runs_compiled():
    """``model.compile`` unset: compiled only on CUDA with one stage, no FSDP2 and no
    selective recomputation at tp > 1 on a torch that compiles it wrongly; an explicit
    true or false always wins (the rule as docs/BENCHMARKS.md's GPU check derives it)."""
    from engine.config import resolve_compile
    from parallel_state.dims import ParallelDims
    from tests.test_engine import compose_config

    cfg = compose_config()
    assert cfg.model.compile is None  # the default is "auto"
    plain = ParallelDims(tp=1, dp=1, pp=1)
    assert resolve_compile(cfg, plain, "cuda") is True
    assert resolve_compile(cfg, plain, "cpu") is False
    assert resolve_compile(cfg, ParallelDims(tp=1, dp=1, pp=2), "cuda") is False
    for shard, compiled in (("none", True), ("optimizer", True), ("full", False)):
        dims = ParallelDims(tp=1, dp=2, pp=1, dp_shard=shard)
        assert resolve_compile(cfg, dims, "cuda") is compiled, shard
    cfg.model.recompute = "selective"
    tp2 = ParallelDims(tp=2, dp=1, pp=1)
    assert resolve_compile(cfg, tp2, "cuda") is selective_recompute_compiles()
    for explicit in (True, False):
        cfg.model.compile = explicit
        assert resolve_compile(cfg, plain, "cpu") is explicit
        assert resolve_compile(cfg, tp2, "cuda") is explicit
