"""model.loss(batch): each model's own training loss, against F.cross_entropy on its logits.

The reference takes the model's full-vocabulary logits (gathered over TP, padding columns
dropped) and applies torch's F.cross_entropy, which shares no code with the vocab-parallel
cross-entropy inside the models. Everything runs in float64 on the CPU: the two sides
differ only in summation order (~1e-16 relative), so 1e-12 proves the formula while a
wrong shift, mask or mean shows up as O(1e-2) or more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import parallel_state
from engine.models import ModelConfig, build_model
from layers.mappings import gather_along
from studies.verification.layouts import VerifySpec, make_batch
from tests.multiproc import run_ranks
from tests.tiny_configs import tiny_config

RTOL, ATOL = 1e-12, 0.0  # float64, see above
CPU = torch.device("cpu")


def _config(arch: str) -> ModelConfig:
    activation = "gelu_tanh" if arch == "gpt" else "gelu"
    return tiny_config(arch=arch, vocab_size=101, max_positions=16, activation=activation)


def _full_logits(logits: torch.Tensor, vocab: int, tp_group) -> torch.Tensor:
    return gather_along(logits.detach(), -1, tp_group)[..., :vocab]


def _gpt_loss_vs_reference(tp_group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _config("gpt")
    torch.manual_seed(0)
    model = build_model(cfg, tp_group=tp_group, dtype=torch.float64, device=CPU)
    tokens = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    got = model.loss(tokens)  # windows [b, s+1]: position i predicts i+1
    got_dict = model.loss({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    logits = _full_logits(
        model.logits({"input_ids": tokens[:, :-1]})["logits"], cfg.vocab_size, model.tp_group
    )
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    return got.detach(), got_dict.detach(), want


def test_gpt_loss_is_mean_next_token_cross_entropy():
    got, got_dict, want = _gpt_loss_vs_reference()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_dict, got, rtol=0, atol=0)  # the same tokens either way


def _gpt_on_tp2() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ps = parallel_state.initialize(2, 1, backend="gloo")
    ps.seed(0)  # both TP ranks draw the same full weights and keep their slices
    try:
        return _gpt_loss_vs_reference(ps.tp_group)
    finally:
        parallel_state.destroy()


def test_gpt_loss_with_vocab_split_over_two_tp_ranks():
    for got, got_dict, want in run_ranks(_gpt_on_tp2, 2, timeout=120):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got_dict, got, rtol=0, atol=0)


def test_bert_loss_is_masked_lm_mean_plus_sentence_order():
    cfg = _config("bert")
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64, device=CPU)
    spec = VerifySpec(model="bert", vocab_size=cfg.vocab_size, seq_len=12, batch_size=4)
    batch = make_batch(spec)  # padded rows, two segments, 3 masked positions per row
    got = model.loss(batch).detach()
    out = model.logits(batch)
    mlm = _full_logits(out["mlm_logits"], cfg.vocab_size, None)
    # Mean over the labelled positions only (-100 elsewhere), plus the 2-way SOP loss.
    want = F.cross_entropy(
        mlm.reshape(-1, cfg.vocab_size), batch["mlm_labels"].reshape(-1), ignore_index=-100
    ) + F.cross_entropy(out["sop_logits"].detach(), batch["sop_label"])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    labelled = (batch["mlm_labels"] != -100).sum().item()
    assert labelled == 3 * spec.batch_size  # the reference really averaged a subset
