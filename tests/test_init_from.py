"""``checkpoint.init_from``: a new run starts from a Hugging Face directory's (or an
export's, or a checkpoint's) weights at any layout, with a fresh optimizer, step and data."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.config import Config
from tests.corpus import build_test_corpus
from tests.multiproc import run_ranks
from tests.test_engine import _train, tiny_run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    return build_test_corpus(tmp_path_factory.mktemp("corpus"))


def _gpt2_like(cfg: Config, directory) -> torch.nn.Module:
    """A random GPT-2 of ``cfg.model``'s sizes, saved by transformers to ``directory``."""
    m = cfg.model
    torch.manual_seed(5)
    hf_cfg = transformers.GPT2Config(
        n_layer=m.num_layers,
        n_embd=m.hidden_size,
        n_head=m.num_heads,
        n_inner=m.ffn_hidden_size,
        n_positions=m.max_positions,
        vocab_size=m.vocab_size,
        layer_norm_epsilon=m.layernorm_eps,
        initializer_range=0.2,  # far from meshtron's own init: a run that ignored it shows
    )
    model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    model.save_pretrained(directory)
    return model


@pytest.mark.slow
def test_a_run_started_from_a_gpt2_directory_begins_at_transformers_own_loss(corpus, tmp_path):
    """tp 2 × dp 2 under FSDP (parallel.dp_shard=full, 4 ranks): the first step's loss,
    taken before any update, is the mean cross-entropy of GPT2LMHeadModel's own logits over
    that step's 8 sequences (read from the run's training set, samples 0..7). float32 in
    both, other kernels and a TP split of the sums: rtol 1e-5 (reassociation is ~1e-7; the
    run's own random init gives a loss ~1 nat away). Its log says where it started from."""
    from engine.data.run_data import build_run_data

    layout = ("tp_size=2", "dp_size=2", "parallel.dp_shard=full", "trainer.max_steps=1")
    layout += ("trainer.device=cpu",)  # 4 ranks over gloo on any machine, GPUs or not
    cfg = tiny_run(corpus, tmp_path, *layout, "trainer.log_every=1", "trainer.sample_tokens=0")
    hf_dir = tmp_path / "gpt2"
    hf_model = _gpt2_like(cfg, hf_dir)
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(hf_dir))
    )
    summary = run_ranks(_train, 4, cfg, timeout=240)[0]
    (step, loss), *_ = summary["history"]

    train = build_run_data(cfg, 0, 1).train.dataset
    windows = torch.stack([train[i] for i in range(cfg.trainer.global_batch)])
    with torch.no_grad():
        logits = hf_model(windows[:, :-1]).logits
    reference = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert step == 1
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    log = (tmp_path / "pretrain.log").read_text()
    assert f"initialized the weights from {hf_dir} (a Hugging Face directory" in log, log
    # Run on, it resumes its own checkpoint (step 1) and says the directory is not read.
    on = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=2))
    summary = run_ranks(_train, 4, on, timeout=240)[0]
    assert [s for s, _ in summary["history"]] == [2]
    log = (tmp_path / "pretrain.log").read_text()
    assert f"checkpoint.init_from={hf_dir} is not read: the run resumes its own checkpoint" in log


def test_another_family_is_refused_with_the_preset_that_fits(tmp_path):
    """A Llama directory given to the default (GPT) run: one line naming what differs, and
    the shortest fix, here a preset plus one key (llama_tiny's sizes, transformers'
    default RMSNorm epsilon 1e-6 against the preset's 1e-5), not ten model.* overrides."""
    from engine.inference import init_from_problems
    from tests.test_engine import compose_config

    hf_cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "llama")
    cfg = compose_config(f"checkpoint.init_from={tmp_path / 'llama'}")
    (line,) = init_from_problems(cfg)
    assert line.startswith(
        f"checkpoint.init_from={tmp_path / 'llama'} holds another model (it has "
        "model.arch='llama', the run 'gpt'; "
    ), line
    assert line.endswith("; set model=llama_tiny model.layernorm_eps=1e-06 to start from it")
    given = f"checkpoint.init_from={tmp_path / 'llama'}"
    fixed = compose_config("model=llama_tiny", "model.layernorm_eps=1e-06", given)
    assert init_from_problems(fixed) == []  # the suggested overrides are accepted
