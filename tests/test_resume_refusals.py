"""A resume that would load the checkpoint into another model is refused before any worker
starts (issue 39, item 9): the launching process reads the newest usable checkpoint's
index and names the key, the checkpoint's value, the new value and the fixes, in one line
with exit 2. Keys that may change on resume (layout, dropout, optimizer, loop, kernels)
still pass."""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

from engine.checkpoint.manager import save_checkpoint
from engine.config import OptimConfig, parallel_dims, resolve_compile
from engine.models import build_model
from engine.optim import build_optimizer
from engine.pretrain import prepare
from tests.corpus import build_test_corpus
from tests.test_engine import compose_config


def _base(corpus: tuple[str, str], root) -> list[str]:
    prefix, tokenizer = corpus
    return [
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        "model=gpt_tiny",
        "model.vocab_size=512",
        "model.hidden_size=32",
        "model.num_heads=4",
        "model.num_layers=1",
        "data.seq_len=32",
        "tp_size=1",
        "dp_size=1",
        "trainer.max_steps=2",
        f"checkpoint.dir={root}",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[str]:
    """The overrides of a run whose checkpoint directory holds its step-1 checkpoint."""
    d = tmp_path_factory.mktemp("resume")
    base = _base(build_test_corpus(d), d / "ck")
    model = build_model(compose_config(*base).model)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    save_checkpoint(d / "ck", 1, model=model, optimizer=optimizer, ps=None, state={})
    return base


def _refusal(overrides: list[str], capsys) -> str:
    """The one line ``prepare`` (the launching process's check) refuses ``overrides`` with."""
    with pytest.raises(SystemExit) as exit_info:
        prepare(compose_config(*overrides))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("model.norm=rmsnorm", "model.norm='layernorm', the model 'rmsnorm'"),
        ("model.position_embedding=rotary", "model.position_embedding='learned', the model"),
        ("model.linear_bias=false", "model.linear_bias=True, the model False"),
        ("model.qkv_bias=false", "model.qkv_bias=True, the model False"),
        ("model.activation=gelu", "model.activation='gelu_tanh', the model 'gelu'"),
        ("model.num_kv_heads=2", "model.num_kv_heads=4, the model 2"),
        ("model.hidden_size=64", "model.hidden_size=32, the model 64"),
        ("model.num_layers=2", "model.num_layers=1, the model 2"),
        ("model.vocab_size=1024", "model.vocab_size=512, the model 1024"),
        ("model.layernorm_eps=1e-6", "model.layernorm_eps=1e-05, the model 1e-06"),
    ],
)
def test_resume_with_another_structure_is_refused(run, change, named, capsys):
    line = _refusal([*run, change], capsys)
    assert "holds a run of another model (checkpoint has " + named in line, line
    key, _, old = named.split(",")[0].partition("=")
    back = old.strip("'").lower() if old in ("True", "False") else old.strip("'")
    assert f"set {key}={back} back to resume it" in line, line
    assert "name=NAME or checkpoint.dir=DIR" in line, line


def test_every_change_is_named_in_the_one_line(run, capsys):
    line = _refusal([*run, "model.norm=rmsnorm", "model.linear_bias=false"], capsys)
    assert "model.norm='layernorm', the model 'rmsnorm'; model.linear_bias=True" in line, line
    assert "set model.norm=layernorm model.linear_bias=true back" in line, line


@pytest.mark.parametrize(
    "change",
    [
        "model.hidden_dropout=0.0",
        "model.recompute=full",
        "model.kernels=torch",
        "model.init_std=0.01",
        "model.num_kv_heads=null",  # null means one per query head: the checkpoint's 4
        "model.ffn_hidden_size=128",  # the checkpoint's 4 × hidden_size, given explicitly
        "optim.lr=1e-4",
        "trainer.max_steps=5",
        "tp_size=2",
    ],
)
def test_resume_with_a_changeable_key_passes(run, change):
    assert prepare(compose_config(*run, change)).model is not None


def test_a_fresh_run_reads_no_checkpoint(run, tmp_path):
    """checkpoint.resume=false on an empty directory is a new run: nothing to compare."""
    fresh = [o for o in run if not o.startswith("checkpoint.dir=")]
    cfg = compose_config(*fresh, f"checkpoint.dir={tmp_path}", "model.norm=rmsnorm")
    assert prepare(cfg).model.norm == "rmsnorm"


@pytest.mark.filterwarnings("ignore:'engine.pretrain' found in sys.modules")
def test_the_refusal_comes_before_any_worker(run, tmp_path, monkeypatch, capsys):
    """Through the real entry point (as ``python -m``): exit 2, one line, and no rank run."""
    import engine.worker

    def no_rank(cfg):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(engine.worker, "run_rank", no_rank)
    monkeypatch.chdir(tmp_path)
    argv = [*run, "model.norm=rmsnorm", f"hydra.run.dir={tmp_path / 'hydra'}"]
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("config error: ") and "model.norm='layernorm'" in err, err


def test_a_finished_run_under_another_config_is_refused(tmp_path, capsys):
    """Issue 45: a run without name= after the quick start found the quick start's
    finished run and exited 0 having trained nothing. A finished run (its step at
    trainer.max_steps) started again under another config is refused in one line naming
    what differs; the very same command is still accepted (it says nothing is left)."""
    import dataclasses

    base = _base(build_test_corpus(tmp_path), tmp_path / "ck")
    cfg = prepare(compose_config(*base))
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    # What a rank records: its config with model.compile's "auto" (None) resolved, as
    # engine/worker.py does (to False on a CPU); the same command again was refused over
    # that alone ("model.compile=False (this run: None)") before it counted as unchanged.
    assert cfg.model.compile is None
    cfg.model.compile = resolve_compile(cfg, parallel_dims(cfg, 1), "cpu")
    state = {"config": dataclasses.asdict(cfg)}
    save_checkpoint(tmp_path / "ck", 2, model=model, optimizer=optimizer, ps=None, state=state)
    assert prepare(compose_config(*base)).trainer.max_steps == 2  # the same command again
    line = _refusal([*base, "model.compile=true"], capsys)  # a setting, not "auto": it differs
    assert "model.compile=False (this run: True)" in line, line
    line = _refusal([*base, "data.seq_len=16"], capsys)
    assert "holds a finished run (step 2, trainer.max_steps=2)" in line, line
    assert "data.seq_len=32 (this run: 16)" in line and "name=NAME" in line, line
    assert prepare(compose_config(*base, "data.seq_len=16", "trainer.max_steps=3"))  # continues


def test_a_checkpoint_of_another_preset_names_the_preset(run, tmp_path, capsys):
    """A checkpoint of plain ``model=llama_tiny`` resumed by a gpt_tiny run: the line says
    ``set model=llama_tiny``, where it listed a dozen model.* keys to set one by one (the
    keys still stand in "checkpoint has ..."): the fewest overrides, as init_from's line
    gives them. The preset is the one whose YAML composes to the checkpoint's model, read
    here from configs/model by OmegaConf itself."""
    from omegaconf import OmegaConf

    from engine.models.config import PRESET_DIR, ModelConfig, preset_of

    raw = OmegaConf.load(PRESET_DIR / "llama_tiny.yaml")
    raw.pop("defaults", None)
    llama = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    model = build_model(llama)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    save_checkpoint(tmp_path / "ck", 1, model=model, optimizer=optimizer, ps=None, state={})
    base = [o for o in run if not o.startswith(("checkpoint.dir=", "model."))]
    line = _refusal([*base, "model.vocab_size=8192", f"checkpoint.dir={tmp_path / 'ck'}"], capsys)
    assert "holds a run of another model (checkpoint has model.arch='llama', the model" in line
    assert "; set model=llama_tiny back to resume it, or give" in line
    # a model no preset composes to keeps the key-by-key fix (the other tests here)
    assert preset_of(llama) == "llama_tiny"
    assert preset_of(compose_config(*run).model) is None
