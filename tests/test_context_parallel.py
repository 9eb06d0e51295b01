"""Context parallelism (the ``cp`` mesh axis) through the model and a training step, on
real gloo ranks, against the unsplit model.

Each rank builds the model on the mesh (ring attention over its cp group) and, beside it,
an unsplit reference with the same full weights on a one-rank group. The cp model trains
one step the trainer's way: the local runner cuts each sequence to the rank's share
(``model.context_shard``), the DP strategy reduces gradients over the ``grad`` role
(dp × cp) and the loss is averaged over the ``loss`` role (dp × cp). The reference runs
the whole batch. Everything is fp64, so the comparison proves the math: the ring and the
gradient average only reorder sums of O(1) terms, and 1e-10 leaves orders of margin above
rounding (measured below) while a token at a wrong position or a loss normalised per rank
is off by O(1e-3) or more.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from engine.models.config import preset
from tests.multiproc import run_ranks
from tests.rank_bodies import in_turn
from tests.tiny_configs import tiny_kwargs

SEQ, BATCH, VOCAB = 16, 2, 96  # 2·cp = 4 chunks of 4 tokens at cp 2
TOL = 1e-10  # fp64; see the module docstring
SMALL = tiny_kwargs(vocab_size=VOCAB, max_positions=32)
MODELS = {  # GPT: learned positions, MHA; Llama: rotary, GQA (2 KV heads for 4 heads)
    "gpt": ("gpt_tiny", {}),
    "llama": ("llama_tiny", {"num_kv_heads": 2, "ffn_hidden_size": 64}),
    # Qwen3's QK norms (applied before the ring) and heads 12 wide (4 × 12 ≠ 32)
    "qwen3": (
        "llama_tiny",
        {"num_kv_heads": 2, "ffn_hidden_size": 64, "qk_norm": True, "attention_head_dim": 12},
    ),
    # Mistral: a sliding window of 5 over 16 tokens (the ring skips blocks outside it)
    "mistral": ("llama_tiny", {"num_kv_heads": 2, "ffn_hidden_size": 64, "sliding_window": 5}),
    # Gemma 2: window 6 on every other layer, scores scaled by 24^-1/2 and capped at 2
    # (small enough to bite on O(1) scores), final logits capped too
    "gemma2": (
        "gemma_tiny",
        {
            "ffn_hidden_size": 64,
            "sliding_window": 6,
            "query_pre_attn_scalar": 24.0,
            "attn_logit_softcapping": 2.0,
        },
    ),
}


def _step_against_unsplit(name: str, tp: int, sequence_parallel: bool, layers: int = 2) -> dict:
    """This rank's loss, full gradients and weights after one AdamW step, and the unsplit
    reference's, for a cp × tp mesh over every rank (dp 1)."""
    import torch.distributed as dist

    import parallel_state
    from engine import comm
    from engine.config import OptimConfig
    from engine.data_parallel import build_data_parallel
    from engine.models import build_model
    from engine.runner import LocalRunner
    from engine.runner.local import model_inputs

    world = dist.get_world_size()
    dims = parallel_state.ParallelDims(tp, 1, cp=world // tp, sequence_parallel=sequence_parallel)
    ps = parallel_state.initialize(dims)
    solo = [dist.new_group([r]) for r in range(world)][ps.rank]  # the reference's "mesh"
    preset_name, extra = MODELS[name]
    extra = {**extra, "num_layers": layers}
    small = {k: v for k, v in SMALL.items() if k != "num_layers"}
    cfg = preset(preset_name, **small, **extra, sequence_parallel=sequence_parallel)
    ps.seed(7)
    model = build_model(cfg, ps, dtype=torch.float64)
    reference = build_model(
        preset(preset_name, **small, **extra), tp_group=solo, rng=ps.rng, dtype=torch.float64
    )
    reference.load_full_state_dict(model.full_state_dict())
    windows = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))

    optim = OptimConfig(lr=1e-3, weight_decay=0.1)
    dp = build_data_parallel(
        model, optim, grad_group=ps.group("grad"), tp_group=ps.group("tp"), device=ps.device
    )
    logged = LocalRunner(model, ps, contextlib.nullcontext).forward_backward([windows], dp)
    dp.finish_grads()
    logged = comm.mean(logged.item(), ps.group("loss"), ps.device)  # as the trainer logs it
    with torch.no_grad():  # the same loss in fp64 (the runner sums it in fp32 for the log)
        loss = model.loss(model_inputs(model, ps)(windows)).item()
    loss = comm.mean(loss, ps.group("loss"), ps.device)
    grads = model.full_grad_dict()
    dp.step(lr=1e-3, max_norm=1.0, norm=dp.grad_norm())

    ref_dp = build_data_parallel(reference, optim, grad_group=None, tp_group=solo, device=ps.device)
    ref_loss = reference.loss(windows)
    ref_loss.backward()
    ref_dp.finish_grads()
    want_grads = reference.full_grad_dict()
    ref_dp.step(lr=1e-3, max_norm=1.0, norm=ref_dp.grad_norm())
    return {
        "logged": logged,
        "loss": loss,
        "want_loss": ref_loss.item(),
        "grads": grads,
        "want_grads": want_grads,
        "weights": model.full_state_dict(),
        "want_weights": reference.full_state_dict(),
    }


def _assert_equal_to_unsplit(per_rank: list[dict]) -> float:
    """Every rank's loss, gradients and stepped weights within TOL of the reference's;
    the largest error seen."""
    worst = 0.0
    for rank, out in enumerate(per_rank):
        # The logged loss is summed in float32 by the runner: 2e-7 relative (two roundings).
        torch.testing.assert_close(
            out["logged"], out["want_loss"], rtol=2e-7, atol=0, msg=lambda m, r=rank: f"{r}: {m}"
        )
        torch.testing.assert_close(
            out["loss"], out["want_loss"], rtol=0, atol=TOL, msg=lambda m, r=rank: f"{r}: {m}"
        )
        worst = max(worst, abs(out["loss"] - out["want_loss"]))
        for kind in ("grads", "weights"):
            got, want = out[kind], out[f"want_{kind}"]
            assert got.keys() == want.keys()
            for key, value in got.items():
                torch.testing.assert_close(
                    value, want[key], rtol=0, atol=TOL, msg=lambda m, k=f"{kind} {key}": f"{k}: {m}"
                )
                worst = max(worst, (value - want[key]).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def at_cp2() -> dict[tuple[str, str], list]:
    """The slow 2-rank bodies of this module, run in turn on one launch of 2 ranks (one
    rank start and one import of the engine serve them all, which is most of what one
    model's check costs): {(check, model): its per-rank results}, where check is "step"
    (one cp 2 step), "dropout" (two passes with attention dropout 0.3) or "verifier"."""
    keys = [("step", name) for name in MODELS] + [("dropout", name) for name in MODELS]
    calls = [(_step_against_unsplit, (name, 1, False)) for name in MODELS]
    calls += [(_dropout_against_unsplit, (name, 0.3)) for name in MODELS]
    keys, calls = [*keys, ("verifier", "")], [*calls, (_verifier_at_cp2, ())]
    per_rank = run_ranks(in_turn, 2, calls, timeout=900)
    return {key: [rank[i] for rank in per_rank] for i, key in enumerate(keys)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_cp2_equals_the_unsplit_model(name, at_cp2):
    """cp 2 (2 ranks): causal GPT (learned positions) and Llama (rotary, GQA): loss, every
    gradient and the weights after one AdamW step within 1e-10 (measured: ~1e-16 to
    ~1e-15, rounding)."""
    per_rank = at_cp2[("step", name)]
    print(f"{name} cp2: max |error| {_assert_equal_to_unsplit(per_rank):.1e}")


def test_seq_len_not_divisible_by_2cp_is_refused_in_one_line():
    """Before any worker starts: the layout's own rule, one line naming the fix."""
    from engine.config import Config, parallel_dims, validate

    cfg = Config(cp_size=2, tp_size=1, dp_size=1)
    cfg.data.seq_len = 30
    problems = validate(cfg, parallel_dims(cfg, None))
    lines = [p for p in problems if p.startswith("data.seq_len=30")]
    assert lines == [
        "data.seq_len=30 is not divisible by 2 × cp_size = 4 (context parallelism cuts each "
        "sequence into 2·cp equal chunks); choose a multiple of 4 or another cp_size"
    ], problems


def test_the_cp_axis_takes_its_share_of_the_world_in_one_line_errors():
    """dp=auto divides the world by tp × cp (× pp); a world that does not fit, and a
    sequence that sequence parallelism cannot split again over tp, are one line each."""
    from parallel_state.dims import LayoutError, ParallelDims

    dims = ParallelDims.resolve(2, "auto", 8, cp=2)
    assert (dims.tp, dims.cp, dims.dp, dims.world) == (2, 2, 2, 8)
    with pytest.raises(
        LayoutError, match=r"^world size 6 is not divisible by tp_size × cp_size = 4;"
    ):
        ParallelDims.resolve(2, "auto", 6, cp=2)
    with pytest.raises(
        LayoutError,
        match=r"^dp_size × cp_size × tp_size = 2 × 2 × 1 = 4 does not equal the world size 2;",
    ):
        ParallelDims.resolve(1, 2, 2, cp=2)
    with pytest.raises(
        LayoutError, match=r"^data.seq_len=20 is not divisible by cp_size × tp_size = 8"
    ):
        ParallelDims(4, 1, cp=2, sequence_parallel=True).check_seq_len(20)
    with pytest.raises(LayoutError, match=r"^cp_size must be an integer >= 1, got 0; set cp_size"):
        ParallelDims(1, 1, cp=0)
    ParallelDims(2, 1, cp=2, sequence_parallel=True).check_seq_len(12)  # 4 chunks of 3, 6 ÷ 2


def _dropout_against_unsplit(name: str, p: float) -> dict:
    """At cp = world (dp 1, tp 1), with attention dropout ``p``: two forward/backward
    passes in a row of the cp model and of the unsplit reference, each started from the
    same RNG streams; per pass the losses, the full gradients (averaged over the grad
    role), whether the streams ended alike, and the loss in eval mode (no dropout)."""
    import torch.distributed as dist

    import parallel_state
    from engine import comm
    from engine.config import OptimConfig
    from engine.data_parallel import build_data_parallel
    from engine.models import build_model

    world = dist.get_world_size()
    ps = parallel_state.initialize(parallel_state.ParallelDims(1, 1, cp=world))
    solo = [dist.new_group([r]) for r in range(world)][ps.rank]
    preset_name, extra = MODELS[name]
    small = {**SMALL, **extra, "attention_dropout": p}
    ps.seed(7)
    model = build_model(preset(preset_name, **small), ps, dtype=torch.float64)
    reference = build_model(
        preset(preset_name, **small), tp_group=solo, rng=ps.rng, dtype=torch.float64
    )
    reference.load_full_state_dict(model.full_state_dict())
    windows = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    share = model.context_shard(windows, world, ps.rank_in("cp"))
    dp = build_data_parallel(
        model, OptimConfig(), grad_group=ps.group("grad"), tp_group=ps.group("tp"), device=ps.device
    )
    passes = []
    for _ in range(2):  # the second pass draws after the first: the streams advance alike
        start = ps.rng.get_states()
        loss = model.loss(share)
        loss.backward()
        dp.finish_grads()
        end = ps.rng.get_states()
        ps.rng.set_states(start)
        want = reference.loss(windows)
        want.backward()
        same_streams = all(torch.equal(end[k], v) for k, v in ps.rng.get_states().items())
        passes.append(
            {
                "loss": comm.mean(loss.item(), ps.group("loss"), ps.device),
                "want_loss": want.item(),
                "grads": model.full_grad_dict(),
                "want_grads": reference.full_grad_dict(),
                "same_streams": same_streams,
            }
        )
        dp.zero_grad()
        reference.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        undropped = comm.mean(model.loss(share).item(), ps.group("loss"), ps.device)
    return {"passes": passes, "undropped": undropped}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_attention_dropout_under_the_ring_draws_what_the_unsplit_model_draws(name, at_cp2):
    """cp 2, attention dropout 0.3 (hidden dropout 0): the ring reads each (query, key)
    pair's draw at its global positions from the mask the unsplit attention draws, so the
    loss and every gradient equal the unsplit model's in fp64 (within 1e-10; measured
    ~1e-16 to 1e-15), over two passes in a row (the streams end where the unsplit model's
    do). GPT (multi-head) and Llama (GQA: a KV head's query heads each keep their own
    rows). The dropout is on: without it the loss moves by more than 1e-5 (measured ~2e-4
    at this fresh initialisation, where attention is nearly uniform), 1e5 × the tolerance,
    while a mask read at local instead of global key positions is off by 6e-4 (planted by
    hand)."""
    per_rank = at_cp2[("dropout", name)]
    worst = 0.0
    for rank, out in enumerate(per_rank):
        for i, one in enumerate(out["passes"]):
            assert one["same_streams"], (rank, i)
            assert abs(one["loss"] - one["want_loss"]) < TOL, (rank, i, one["loss"])
            assert abs(out["undropped"] - one["want_loss"]) > 1e-5, (rank, out["undropped"])
            worst = max(worst, abs(one["loss"] - one["want_loss"]))
            for key, value in one["grads"].items():
                torch.testing.assert_close(
                    value,
                    one["want_grads"][key],
                    rtol=0,
                    atol=TOL,
                    msg=lambda m, k=key: f"{k}: {m}",
                )
                worst = max(worst, (value - one["want_grads"][key]).abs().max().item())
    print(f"{name} cp2 attention dropout 0.3: max |error| {worst:.1e}")


def planted_report(spec, module=None, attribute: str = "", replacement=None) -> tuple | None:
    """The layout verifier on ``spec`` with ``module.attribute`` replaced for the run (a
    planted bug; none without ``module``): (rows compared, first failing row as (kind,
    name, max_rel) or None) on rank 0, None elsewhere."""
    import parallel_state
    from studies.verification.layouts import compare_layouts

    original = module and getattr(module, attribute)
    if module:
        setattr(module, attribute, replacement)
    try:
        with parallel_state.initialize(spec.dims):
            report = compare_layouts(spec)
    finally:
        if module:
            setattr(module, attribute, original)
    if report is None:
        return None
    failure = report.first_failure
    return len(report.rows), failure and (failure.kind, failure.name, failure.max_rel)


def _verifier_at_cp2() -> dict[str, tuple | None]:
    """The layout verifier at cp 2: Llama and BERT clean, then GPT and Llama with positions
    not offset (each cp rank's tokens numbered from 0) and BERT with its padding mask
    dropped on the ring: the first failing row of each."""
    import engine.models.bert.model as bert_model
    import engine.models.gpt.model as gpt_model
    from studies.verification.layouts import VerifySpec

    def unshifted(seq_len, cp_size, cp_rank, *, device=None):
        return torch.arange(seq_len // cp_size, device=device)

    found = {}
    for name, model, planted in (
        ("clean", "llama", False),
        ("gpt", "gpt", True),
        ("llama", "llama", True),
    ):
        spec = VerifySpec(model=model, tp_size=1, cp_size=2, num_heads=4)
        plant = (gpt_model, "cp_positions", unshifted) if planted else ()
        found[name] = planted_report(spec, *plant)
    bert = VerifySpec(model="bert", tp_size=1, cp_size=2, num_heads=4)
    found["bert clean"] = planted_report(bert)
    dense = bert_model.padding_mask

    def dropped_on_the_ring(attention_mask, *, ring):
        return None if ring else dense(attention_mask, ring=False)

    found["bert unpadded"] = planted_report(bert, bert_model, "padding_mask", dropped_on_the_ring)
    return found


@pytest.mark.slow
def test_the_verifier_runs_at_cp2_and_names_unshifted_positions_where_they_show(at_cp2):
    """Every module's output, the loss and every gradient within 1e-10 at cp 2; positions
    not offset show first at the learned position table (GPT: the embedding's output) and
    at the first attention core that rotates q and k (Llama)."""
    found = at_cp2[("verifier", "")][0]
    print(found)
    rows, failure = found["clean"]
    assert rows > 30 and failure is None, found
    assert found["gpt"][1][:2] == ("output", "embedding"), found
    assert found["llama"][1][:2] == ("output", "layers.0.attention.core"), found
    assert min(found["gpt"][1][2], found["llama"][1][2]) > 1e-3, found


@pytest.mark.slow
def test_bert_runs_bidirectional_on_the_ring_and_a_dropped_padding_mask_shows(at_cp2):
    """BERT at cp 2 (bidirectional ring over padded rows; the MLM mean over the whole
    rows' labelled tokens, the SOP loss on the rank holding [CLS]): every module's output,
    the loss and every gradient within 1e-10 of the unsplit model in fp64. With the
    padding mask dropped on the ring, the first attention core's output is the first to
    fail, by far more than rounding."""
    found = at_cp2[("verifier", "")][0]
    rows, failure = found["bert clean"]
    assert rows > 40 and failure is None, found
    assert found["bert unpadded"][1][:2] == ("output", "layers.0.attention.core"), found
    assert found["bert unpadded"][1][2] > 1e-3, found


def _verifier_at_cp2_pp2(models: tuple[str, ...]) -> dict[str, tuple] | None:
    """The layout verifier at cp 2 × pp 2 (1F1B, 2 micro-batches, 2 steps), per model: the
    number of rows, the first failing row and the largest relative error (rank 0; None
    elsewhere). One launch of 4 ranks serves every model."""
    import parallel_state
    from studies.verification.layouts import VerifySpec, compare_layouts

    found = {}
    for model in models:
        spec = VerifySpec(
            model=model, tp_size=1, cp_size=2, pp_size=2, num_heads=4, microbatches=2, steps=2
        )
        with parallel_state.initialize(spec.dims):
            report = compare_layouts(spec)
        if report is not None:
            found[model] = len(report.rows), report.first_failure
            found[model] += (max(r.max_rel for r in report.rows),)
    return found or None


@pytest.mark.slow
def test_cp2_through_two_pipeline_stages_equals_the_unsplit_model():
    """cp 2 × pp 2 (4 ranks), Llama (rotary: every stage rotates at the global positions
    the schedule hands it) and BERT (every stage rings over the whole rows' padding; the
    last stage weighs its losses by the weights each micro-batch's target rows carry):
    every module's output and each stage's hand-off per micro-batch, the cp shares joined
    back in sequence order, both steps' losses and every gradient within 1e-10 of the
    unsplit model in fp64 (measured ≤ 1e-15: rounding)."""
    found = run_ranks(_verifier_at_cp2_pp2, 4, ("llama", "bert"))[0]
    for model, (rows, failure, worst) in found.items():
        print(f"{model} cp2 pp2: {rows} rows, max rel {worst:.1e}")
        assert rows > 30 and failure is None, (model, failure)
        assert worst < 1e-12, model
    assert sorted(found) == ["bert", "llama"]


def test_cp_with_pp_attention_dropout_and_compile_is_no_longer_refused():
    """cp > 1 composes with pp > 1, with attention dropout and (at pp 1) with
    model.compile: validation says nothing about cp (tests/test_compile_layouts.py runs
    the compiled ring against the eager one)."""
    from engine.config import Config, parallel_dims, validate

    cfg = Config(cp_size=2, pp_size=2, tp_size=1, dp_size=1)
    cfg.model.num_layers, cfg.model.attention_dropout = 4, 0.1
    assert validate(cfg, parallel_dims(cfg, None)) == []
    cfg = Config(cp_size=2, tp_size=1, dp_size=1)
    cfg.model.compile = True
    assert validate(cfg, parallel_dims(cfg, None)) == []


def _cp_run(cfg) -> dict | None:
    """Train ``cfg`` on ``world`` ranks (its layout): the step it starts at, its full
    weights and Adam moments then (after any resume) and at the end, and its loss history
    (rank 0; None elsewhere)."""
    import torch.distributed as dist

    import parallel_state
    from engine.checkpoint import full_optimizer_state
    from engine.config import parallel_dims
    from engine.trainer import Trainer

    t = Trainer(cfg, parallel_state.initialize(parallel_dims(cfg, dist.get_world_size())))
    start = (t.step, t.model.full_state_dict(), full_optimizer_state(t.model, t.dp))
    history = t.fit()["history"]
    end = (t.model.full_state_dict(), full_optimizer_state(t.model, t.dp))
    if t.ps.rank != 0:
        return None
    return {"start": start, "end": end, "history": history}


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.slow
def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_back(tmp_path):
    """The cp ranks of a replica hold the same weights and Adam moments (the ``replica``
    role): a checkpoint saved at cp 2 (dp 1) resumes at cp 1 with every weight and moment
    bitwise equal to the saved run's (they only move between files), and one saved at cp 1
    resumes at cp 2 alike. The cp ranks read the same samples as a cp 1 rank (the data is
    split over dp alone), so the resumed steps see the uninterrupted run's batches; their
    losses equal the uninterrupted run's (at cp 1 and at cp 2) within 1e-5 relative: fp32
    throughout, and cp only reorders sums (the ring's log-sum-exp merge of two key blocks,
    the loss and gradient means over two halves instead of one), ~1e-7 per op, which a few
    Adam steps amplify little (measured: ≤ 1.6e-7, float32 rounding of the loss, since the
    ring cut its causal blocks into chunk squares; 3.9e-8 before). The loss moves by more than 100 × that
    tolerance each step (checked), so a resume that lost the moments or the step shows."""
    from tests.corpus import build_test_corpus
    from tests.test_checkpoint import run_config

    (tmp_path / "corpus").mkdir()
    corpus = build_test_corpus(tmp_path / "corpus")
    base = ("model.hidden_dropout=0.0", "model.attention_dropout=0.0", "tp_size=1", "dp_size=1")

    def cfg(root: str, cp: int, steps: int, every: int):
        return run_config(
            corpus,
            tmp_path / root / "ckpt",
            *base,
            f"cp_size={cp}",
            f"trainer.max_steps={steps}",
            f"checkpoint.every={every}",
        )

    # Three launches where each run would take one (a rank start and the engine's imports
    # cost more than these tiny runs): cp 2 runs whole and saves "from2"; cp 1 runs whole,
    # resumes "from2" and saves "from1"; cp 2 resumes "from1". Each run reads and writes
    # only its own root, so running them in one process changes none of them.
    def runs(cp: int, *cfgs) -> list[dict | None]:  # rank 0's result of each, one launch
        return run_ranks(in_turn, cp, [(_cp_run, (c,)) for c in cfgs], timeout=600)[0]

    whole2, saver2 = runs(2, cfg("whole2", 2, 6, 0), cfg("from2", 2, 3, 3))
    whole1, resumed1, saver1 = runs(
        1, cfg("whole1", 1, 6, 0), cfg("from2", 1, 6, 0), cfg("from1", 1, 3, 3)
    )
    (resumed2,) = runs(2, cfg("from1", 2, 6, 0))
    whole = {1: whole1, 2: whole2}
    runs = {(2, 1): (saver2, resumed1), (1, 2): (saver1, resumed2)}
    found = {}
    for (saved_at, resumed_at), (saver, resumed) in runs.items():
        step, weights, moments = resumed["start"]
        assert step == 3, step
        assert _same(weights, saver["end"][0]), f"weights after cp {saved_at} -> {resumed_at}"
        assert _same(moments, saver["end"][1]), f"moments after cp {saved_at} -> {resumed_at}"
        assert moments and len(moments) == 2 * len(weights)  # exp_avg, exp_avg_sq of each
        got = resumed["history"]
        for cp in (1, 2):
            want = whole[cp]["history"][3:]
            assert [s for s, _ in got] == [s for s, _ in want] == [4, 5, 6], (got, want)
            errors = [abs(g - w) / abs(w) for (_, g), (_, w) in zip(got, want, strict=True)]
            found[(saved_at, resumed_at, cp)] = max(errors)
            assert max(errors) < 1e-5, (saved_at, resumed_at, cp, got, want)
    # The resume line names the axis that changed (the index records cp_size since
    # 2026-11-27; before, a cp 2 → 1 resume read as an unchanged layout).
    for root, was in (("from2", 2), ("from1", 1)):
        log = (tmp_path / root / "pretrain.log").read_text()
        assert f"resuming from step 3 ({tmp_path / root / 'ckpt'}" in log, log[-2000:]
        assert f"step_00000003, resharded from cp={was}, " in log, log[-2000:]
    print({f"cp{a}->cp{b} vs whole cp{c}": f"{e:.1e}" for (a, b, c), e in found.items()})
    losses = [x for _, x in whole[1]["history"][2:]]  # steps 3 .. 6
    moves = [abs(b - a) / abs(a) for a, b in itertools.pairwise(losses)]
    print(f"relative loss change per step: {min(moves):.1e} .. {max(moves):.1e}")
    assert min(moves) > 1e-3, moves


def test_bert_under_cp_is_accepted_with_and_without_pipeline_stages():
    """BERT joins cp at pp 1 and pp 2 (each rank's loss weights travel in the schedule's
    target): validation says nothing about cp for it."""
    from engine.config import Config, parallel_dims, validate
    from engine.models.config import preset as model_preset

    def cp_problems(pp: int) -> list[str]:
        cfg = Config(cp_size=2, pp_size=pp, tp_size=1, dp_size=1)
        cfg.model = model_preset("bert_tiny")
        return [p for p in validate(cfg, parallel_dims(cfg, None)) if "cp_size" in p]

    assert cp_problems(1) == []
    assert cp_problems(2) == []
