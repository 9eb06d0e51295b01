"""Help texts say what the code does: the families from the table, the composed model,
whole section headings (issue 45)."""

from __future__ import annotations

import pytest

from engine.models.families import FAMILIES


def _help(parse_args, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    return " ".join(capsys.readouterr().out.split())


def test_generate_and_evaluate_help_name_the_families_of_the_table(capsys):
    from apps.generate_text import parse_args as generate_args
    from engine.evaluate import parse_args as evaluate_args

    generate, evaluate = _help(generate_args, capsys), _help(evaluate_args, capsys)
    assert "GPT-2" not in generate and "GPT-2 or BERT" not in evaluate
    causal = ", ".join(arch for arch, f in FAMILIES.items() if f.causal)
    assert causal in generate and "llama" in causal
    assert ", ".join(FAMILIES) in evaluate


def test_pretrain_help_headings_are_whole_and_the_model_says_its_values():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from engine.config import register_configs
    from engine.config_cli import CONFIGS, help_text

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = OmegaConf.to_object(compose("config"))
    lines = help_text(cfg).splitlines()
    pipeline = next(line for line in lines if line.startswith("pipeline:"))
    assert pipeline.endswith("global_batch ÷ (micro_batch × dp)).")  # not cut mid-sentence
    model = next(line for line in lines if line.startswith("model:"))
    m = cfg.model
    assert f"Values below: {m.arch} h={m.hidden_size} l={m.num_layers}" in model
    assert "(defaults: GPT-2 small)" not in model
