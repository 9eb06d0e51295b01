"""Sampling from a GPT whose logits are sharded over the vocabulary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import parallel_state
from engine.generate import generate
from engine.models import build_model
from engine.models.config import preset
from tests.multiproc import run_ranks

CFG = preset("gpt_tiny", vocab_size=300, hidden_size=32, num_heads=4, max_positions=32,
             hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


def _samples(sequence_parallel: bool) -> tuple[list[int], list[int], list[int]]:
    ps = parallel_state.initialize(2)
    ps.seed(9)
    model = build_model(dataclasses.replace(CFG, sequence_parallel=sequence_parallel))
    full = model.full_state_dict()
    single = [dist.new_group([r]) for r in range(ps.world_size)][ps.rank]
    serial = build_model(CFG, tp_group=single)
    serial.load_full_state_dict(full)
    prompt = [5, 17, 42]
    kwargs = dict(temperature=0.7, top_k=20, seed=3)
    # 40 new tokens from a 3-token prompt overflow max_positions=32: the window slides.
    return (generate(model, prompt, 40, **kwargs), generate(serial, prompt, 40, **kwargs),
            generate(serial, prompt, 40, temperature=0.7, top_k=20, seed=4))  # fmt: skip


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_samples_the_same_tokens_as_tp1(sequence_parallel):
    for split, serial, other_seed in run_ranks(_samples, 2, sequence_parallel):
        assert split == serial  # same weights, same seed: the same 43 ids on every TP rank
        assert len(split) == 43 and all(0 <= t < 300 for t in split)  # never a padding id
        assert other_seed != serial  # the seed really drives the sampling


def test_greedy_top1_follows_the_argmax():
    torch.manual_seed(0)
    model = build_model(CFG)
    ids = generate(model, [1, 2, 3], 5, top_k=1)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0, -1, :300]
    assert ids[-1] == int(logits.argmax())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate(model, [1], 1, temperature=0.0)
