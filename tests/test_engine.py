"""The pre-training engine: end-to-end runs, the mesh-wide gradient norm, config validation."""

from __future__ import annotations

import dataclasses
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import parallel_state
from engine.config import Config, register_configs
from engine.data_parallel import GradSync, global_grad_norm
from engine.models import build_model
from tests.corpus import build_test_corpus
from tests.launch_util import run_pretrain
from tests.multiproc import run_ranks
from tests.torch_reference import tiny_gpt

ROOT = Path(__file__).resolve().parents[1]
register_configs()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """The fixed test corpus (tests/corpus.py), tokenized by the real pipeline: the same
    on every Python version, unlike the product's default stdlib corpus."""
    return build_test_corpus(tmp_path_factory.mktemp("corpus"))


def compose_config(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


def tiny_run(corpus, tmp_path, *overrides: str) -> Config:
    prefix, tokenizer = corpus
    cfg = compose_config(
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=32",
        "model.vocab_size=512",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        "trainer.max_steps=30",
        "trainer.log_every=5",
        "trainer.eval_every=0",
        "trainer.global_batch=8",
        "trainer.micro_batch=2",
        "trainer.tensorboard=false",
        "trainer.progress=false",
        "trainer.sample_tokens=8",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        "data.split='85,15,0'",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"run_dir={tmp_path}",
        *overrides,
    )
    return dataclasses.replace(cfg, dp_size=int(cfg.dp_size))


def _train(cfg: Config) -> dict:
    from engine.worker import run_worker

    return run_worker(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt_tiny", "bert_tiny", "llama_tiny"])
def test_tiny_model_trains_at_tp2_dp2(corpus, tmp_path, model):
    observe = ["trainer.tensorboard=true", "trainer.profile_steps=[2,3]"]
    cfg = tiny_run(corpus, tmp_path, f"model={model}", "tp_size=2", "dp_size=2", *observe)
    summary = run_ranks(_train, 4, cfg, timeout=240)[0]
    losses = [loss for _, loss in summary["history"]]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    # Uniform guessing over 512 tokens costs ln 512 = 6.24 nats (plus ln 2 = 0.69 for
    # BERT's sentence-order head). A model that learns nothing stays there; after 30 steps
    # at lr 3e-3 GPT reaches about 5.4 and BERT (whose MLM sees only the 15% masked
    # tokens) about 6.3. Demand a fall of 0.5 nat between the first and last 5-step
    # windows, and 0.5 nat below uniform.
    uniform = math.log(512) + (math.log(2) if model == "bert_tiny" else 0.0)
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < uniform - 0.5, losses
    assert (tmp_path / "ckpt" / "final").is_dir()
    if model == "gpt_tiny":
        assert isinstance(summary["sample"], str) and summary["sample"]
    _check_observability(tmp_path, losses)


def _check_observability(run_dir: Path, losses: list[float]) -> None:
    """TensorBoard got the console's losses and the metrics; every rank wrote a trace."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "ckpt" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/dp_comm_share",
        "perf/peak_mem_gib",
        "valid/loss",
        "valid/ppl",
    } <= tags
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert "perf/mfu" not in tags  # no known peak on a CPU: no MFU rather than a wrong one
    for rank in range(4):
        assert (run_dir / f"trace_rank{rank}.json").stat().st_size > 0


def test_tensorboard_keeps_one_run_across_resumes(tmp_path):
    """A run that logged steps 1-10, died, and resumed from its step-6 checkpoint has one
    TensorBoard run directory whose curve is steps 1-6 of the first launch then 7-9 of the
    second: the lost steps 7-10 are dropped, not drawn as a second, overlapping line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from engine.observe import RunLogger

    board = tmp_path / "ckpt" / "tensorboard"

    def launch(first_after: int, steps: range, value: float) -> None:
        logger = RunLogger(
            enabled=True,
            run_dir=str(tmp_path / f"launch{value}"),
            max_steps=10,
            tensorboard=str(board),
            wandb_project=None,
            config={},
            progress=False,
        )
        if first_after:
            logger.resumed_at(first_after)
        for step in steps:
            logger.scalars(step, {"train/loss": value})
        logger.close()

    launch(0, range(1, 11), 1.0)
    launch(6, range(7, 10), 2.0)
    assert [p.name for p in board.parent.iterdir()] == ["tensorboard"]
    events = EventAccumulator(str(board))
    events.Reload()
    curve = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert curve == [(s, 1.0) for s in range(1, 7)] + [(s, 2.0) for s in range(7, 10)]


def _grad_norms(sequence_parallel: bool) -> tuple[float, float]:
    ps = parallel_state.initialize(2, 2)
    cfg = tiny_gpt(500, sequence_parallel=sequence_parallel)
    ps.seed(3)  # the sharded dropout stream must exist under sequence parallelism
    model = build_model(cfg, dtype=torch.float64)
    full = model.full_state_dict()
    batch = torch.randint(0, 500, (4, 17), generator=torch.Generator().manual_seed(5))
    mine = batch[2 * ps.dp_rank : 2 * ps.dp_rank + 2]
    sync = GradSync(model.parameters(), grad_group=ps.dp_group, tp_group=ps.tp_group)
    model(mine[:, :-1], mine[:, 1:]).mean().backward()
    sync.finish()
    got = global_grad_norm(list(model.parameters()), ps.tp_group).item()

    # Reference: the unsplit model on one rank, whole batch, norm over its full gradients.
    import torch.distributed as dist

    single = [dist.new_group([r]) for r in range(ps.world_size)][ps.rank]
    serial = build_model(
        dataclasses.replace(cfg, sequence_parallel=False), tp_group=single, dtype=torch.float64
    )
    serial.load_full_state_dict(full)
    serial(batch[:, :-1], batch[:, 1:]).mean().backward()
    want = torch.sqrt(sum(p.grad.pow(2).sum() for p in serial.parameters())).item()
    return got, want


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.slow
def test_global_grad_norm_matches_serial(sequence_parallel):
    """fp64: the sharded/replicated bookkeeping must reproduce the serial norm to 1e-12."""
    for got, want in run_ranks(_grad_norms, 4, sequence_parallel):
        assert abs(got - want) <= 1e-12 * want, (got, want)


INVALID = [
    (["model.num_heads=2"], "model.num_heads=2 is not divisible by tp_size=4"),
    (["model.hidden_size=130"], "model.hidden_size=130 is not divisible by model.num_heads=4"),
    (["model.ffn_hidden_size=510"], "model.ffn_hidden_size=510 is not divisible by tp_size=4"),
    (
        ["trainer.global_batch=10"],
        "trainer.global_batch=10 is not a multiple of trainer.micro_batch × dp_size = 4 × 1 = 4",
    ),
    (["data.seq_len=300"], "data.seq_len=300 must be in [2, model.max_positions=256]"),
    (
        ["data.prefixes=[/nonexistent/corpus]"],
        "data.prefixes: /nonexistent/corpus.bin and /nonexistent/corpus.idx not found",
    ),
    (
        ["data.tokenizer=/nonexistent/tok.json"],
        "data.tokenizer: /nonexistent/tok.json does not exist",
    ),
    (["trainer.precision=fp8"], "trainer.precision='fp8' is not one of auto, fp32, bf16, fp16"),
    (["optim.min_lr=1.0"], "optim.lr=0.0006 must be > 0 and optim.min_lr=1.0 in [0, lr]"),
    (["model.recompute=sometimes"], "model.recompute='sometimes' is not one of"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be in [1, 2**63-1]"),
    (["dp_size=many"], "dp_size='many' must be an integer or 'auto'"),
    (
        ["model.vocab_size=1000"],
        "model.vocab_size=1000 is smaller than the embedded corpus's data.default_vocab_size=8192",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID)
def test_invalid_config_gives_one_line(overrides, message, capsys, tmp_path, monkeypatch):
    from engine.pretrain import prepare

    monkeypatch.chdir(tmp_path)  # the default checkpoint.dir is relative: not in the repo

    cfg = compose_config("tp_size=4", "dp_size=1", *overrides)
    with pytest.raises(SystemExit) as exit_info:
        prepare(cfg)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and message in lines[0], lines


def test_data_checks_after_resolving_paths(corpus, tmp_path, capsys, monkeypatch):
    """A tokenizer larger than the model's vocabulary, or a missing one, is a config error."""
    from engine.pretrain import prepare

    monkeypatch.chdir(tmp_path)  # prepare() probes the default checkpoints/<name> there

    prefix, tokenizer = corpus
    for overrides, message in [
        (
            [f"data.tokenizer={tokenizer}", "model.vocab_size=300"],
            f"model.vocab_size=300 is smaller than the tokenizer's vocabulary (512, {tokenizer})",
        ),
        ([], f"data.tokenizer: {prefix}.tokenizer.json does not exist"),
    ]:
        cfg = compose_config(f"data.prefixes=[{prefix}]", "tp_size=1", "dp_size=1", *overrides)
        with pytest.raises(SystemExit) as exit_info:
            prepare(cfg)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_more_data_and_checkpoint_checks(corpus, tmp_path, capsys, monkeypatch):
    """Each problem found before workers start, one line each, naming what to change."""
    monkeypatch.chdir(tmp_path)  # prepare() probes the default checkpoints/<name> there
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from engine.checkpoint.storage import INDEX
    from engine.pretrain import prepare

    prefix, tokenizer = corpus
    plain = Tokenizer(models.BPE())  # a tokenizer without BERT's special tokens
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(["def f(x): return x"], trainers.BpeTrainer(vocab_size=300))
    plain.save(str(tmp_path / "plain.json"))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "a_file").write_text("")
    taken = tmp_path / "taken"
    (taken / "step_00000005").mkdir(parents=True)
    (taken / "step_00000005" / INDEX).write_text("{}")
    cases = [
        ([f"data.tokenizer={tmp_path / 'bad.json'}"], "is not a tokenizer.json"),
        (
            ["model=bert_tiny", f"data.tokenizer={tmp_path / 'plain.json'}"],
            "lacks BERT's special tokens ['[CLS]', '[SEP]', '[MASK]', '[PAD]']",
        ),
        (
            ["model.max_positions=200000", "data.seq_len=150000"],
            "fewer than data.seq_len + 1 = 150001; lower data.seq_len or add data",
        ),
        (["data.weights=[-1.0]"], "data.weights=[-1.0] must be >= 0 with a positive sum"),
        ([f"checkpoint.dir={tmp_path / 'a_file' / 'ck'}"], "is not writable"),
        (
            [f"checkpoint.dir={taken}", "checkpoint.resume=false"],
            "already holds checkpoints (steps 5) that a fresh run would replace",
        ),
    ]
    for overrides, message in cases:
        base = [f"data.prefixes=[{prefix}]", "model.vocab_size=512", "tp_size=1", "dp_size=1"]
        if not any(o.startswith("data.tokenizer=") for o in overrides):
            base.append(f"data.tokenizer={tokenizer}")
        with pytest.raises(SystemExit) as exit_info:
            prepare(compose_config(*base, *overrides))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (overrides, err)
    assert (taken / "step_00000005" / INDEX).exists()  # nothing was touched


@pytest.mark.slow
def test_cli_rejects_unknown_key_and_bad_layout_without_traceback(tmp_path, monkeypatch, capsys):
    """The unknown key (Hydra's parser) as a real process; the bad layout, refused by the
    same ``__main__`` before any worker, in this process (as ``python -m`` runs it): a
    second process would only pay a second ``import torch``. A refused layout as real
    processes: tests/test_bad_input.py (the several-ranks refusal)."""
    # cwd: a temporary directory, where Hydra makes outputs/
    unknown = run_pretrain(["trainer.bogus=1"], tmp_path, 120)
    assert unknown.returncode != 0
    assert "unknown key 'trainer.bogus'" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "tp_size=3"])
    with pytest.raises(SystemExit) as bad:
        runpy.run_module("engine.pretrain", run_name="__main__")  # as python -m does
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "Traceback" not in err
    assert err.strip() == "config error: model.num_heads=4 is not divisible by tp_size=3"


@pytest.mark.parametrize(
    "name", ["gpt_tiny", "gpt_125m", "gpt_350m", "gpt_1.3b", "bert_tiny", "bert_base", "bert_large"]
)
def test_model_yaml_matches_its_preset_and_validates(name):
    """``engine.models.preset(name)`` is the model Hydra composes for ``model=name`` (every
    field, gpt_tiny's 8192-word vocabulary included), with the published sizes, and valid at
    tp=1 and at the default tp=2 (bert_tiny's 2 heads allow no more)."""
    from engine.models import preset, preset_names

    model = compose_config(f"model={name}").model
    assert preset(name) == model
    assert name in preset_names()
    # Sizes from the papers (Radford et al. 2019; Devlin et al. 2019; Brown et al. 2020),
    # so a preset cannot drift in both places at once: (hidden, layers, heads, vocab).
    published = {
        "gpt_tiny": (128, 2, 4, 8192),
        "gpt_125m": (768, 12, 12, 50257),
        "gpt_350m": (1024, 24, 16, 50257),
        "gpt_1.3b": (2048, 24, 16, 50257),
        "bert_tiny": (128, 2, 2, 30522),
        "bert_base": (768, 12, 12, 30522),
        "bert_large": (1024, 24, 16, 30522),
    }[name]
    assert (model.hidden_size, model.num_layers, model.num_heads, model.vocab_size) == published
    for tp in (1, 2):
        model.validate(tp)


def test_the_last_console_line_gives_the_first_and_last_logged_loss():
    """engine.pretrain's closing line: 'loss A (step i) -> B (step j)' over the logged
    steps; a run (or resume) that logged one step names it once, not as 'A -> A'."""
    from engine.pretrain import loss_summary

    assert loss_summary([(10, 8.93114), (20, 7.5), (150, 6.10862)]) == (
        "loss 8.9311 (step 10) -> 6.1086 (step 150)"
    )
    assert loss_summary([(160, 6.03991)]) == "loss 6.0399 (step 160)"
