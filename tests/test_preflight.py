"""The memory estimate made before any worker starts (engine/preflight.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import engine.preflight as preflight
from engine.config import Config
from engine.models.config import preset


def _cfg(**trainer) -> Config:
    cfg = Config(model=preset("gpt_tiny", vocab_size=8192), tp_size=1, dp_size=1)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))


def test_estimate_matches_a_hand_count():
    """gpt_tiny (h=128, 2 layers, 4 heads, V=8192, 256 positions, tied), s=128, b=4, tp=1.

    Parameters by hand: per layer QKV 3h²+3h, output h²+h, MLP 8h²+5h, two LayerNorms 4h;
    embeddings (V + 256)·h; final LayerNorm 2h. Activations by hand (16-bit, no recompute,
    t=1): s·b·h·(34 + 5·a·s/h) bytes per layer, doubled for fp32, plus fp32 logits over the
    vocabulary padded to a multiple of 128 (8192 already is).
    """
    h, layers, a, v, s, b = 128, 2, 4, 8192, 128, 4
    params = layers * (12 * h * h + 13 * h) + (v + 256) * h + 2 * h
    per_layer = s * b * h * (34 + 5 * a * s / h)
    est = preflight.estimate_rank_bytes(_cfg(micro_batch=b), 1, fp32_activations=True)
    assert est.params == 4 * params and est.grads == 4 * params and est.optimizer == 8 * params
    assert est.activations == pytest.approx(2 * layers * per_layer + 4 * s * b * v, rel=1e-12)


def test_zero1_and_tp_divide_what_they_shard():
    cfg = _cfg()
    plain = preflight.estimate_rank_bytes(cfg, 4, fp32_activations=False)
    zero = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, distributed=True))
    sharded = preflight.estimate_rank_bytes(zero, 4, fp32_activations=False)
    assert sharded.optimizer == plain.optimizer / 4 and sharded.params == plain.params
    tp2 = preflight.estimate_rank_bytes(
        dataclasses.replace(cfg, tp_size=2), 1, fp32_activations=False
    )
    assert tp2.params == plain.params / 2


def test_zero1_in_bf16_counts_bf16_parameters_and_sharded_masters():
    """ZeRO-1 training in bf16, by hand per parameter: bf16 parameters 2, the fp32 gradient
    buffer 4, fp32 master + exp_avg + exp_avg_sq 12/d; in fp32 the parameters are their own
    masters: 4, 4, 8/d. The all-reduce path keeps fp32 parameters in either precision."""
    cfg = _cfg()
    n = preflight.params_count(cfg.model)
    zero = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, distributed=True))
    bf16 = preflight.estimate_rank_bytes(zero, 4, fp32_activations=False, bf16=True)
    assert (bf16.params, bf16.grads, bf16.optimizer) == (2 * n, 4 * n, 3 * n)
    fp32 = preflight.estimate_rank_bytes(zero, 4, fp32_activations=False)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * n, 4 * n, 2 * n)
    plain = preflight.estimate_rank_bytes(cfg, 4, fp32_activations=False, bf16=True)
    assert (plain.params, plain.grads, plain.optimizer) == (4 * n, 4 * n, 8 * n)


def test_fsdp_modes_count_their_shards_and_the_units_in_flight():
    """gpt_tiny at dp 4, fp32, by hand: ZeRO-3 holds 16/d per parameter plus, at its peak,
    the larger of the embedding-side unit and a layer, and one more layer, gathered as
    parameters and unsharded gradients (4 + 4 bytes); ZeRO-2 keeps the parameters whole (4)
    with sharded gradients and state (16/d), and the same units' unsharded gradients (4).
    The embedding side (V + 256 positions)·h + 2h is larger than a layer 12h² + 13h here."""
    h, v, d = 128, 8192, 4
    layer, root = 12 * h * h + 13 * h, (v + 256) * h + 2 * h
    n = 2 * layer + root
    for mode, params, grads, state, per_unit in (
        ("full", 0, 4 / d, 12 / d, 8),
        ("gradients", 4, 4 / d, 12 / d, 4),
    ):
        cfg = _cfg()
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard=mode))
        est = preflight.estimate_rank_bytes(cfg, d, fp32_activations=True)
        assert est.params == pytest.approx(params * n + per_unit * (root + layer), rel=1e-12)
        assert (est.grads, est.optimizer) == pytest.approx((grads * n, state * n), rel=1e-12)


def test_the_memory_cap_refuses_a_layout_over_it_and_names_the_sharded_fix(monkeypatch):
    """trainer.memory_cap_gib is a per-rank budget below the machine's: halfway between the
    full-replica and the ZeRO-3 estimates at dp 4, it refuses the first (one line naming the
    cap and parallel.dp_shard) and passes the second, whatever RAM the machine has free."""
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: 2**50)
    cfg = dataclasses.replace(_cfg(micro_batch=1), dp_size=4)

    def at(mode: str, cap: float) -> Config:
        trainer = dataclasses.replace(cfg.trainer, memory_cap_gib=cap)
        parallel = dataclasses.replace(cfg.parallel, dp_shard=mode)
        return dataclasses.replace(cfg, trainer=trainer, parallel=parallel)

    need = {
        mode: preflight.estimate_rank_bytes(at(mode, 0), 4, fp32_activations=True).total
        for mode in ("none", "full")
    }
    assert need["full"] < need["none"]
    cap = (need["none"] + need["full"]) / 2 / 2**30
    (line,) = preflight.check_memory(at("none", cap), local_ranks=4, on_gpu=False)
    assert f"cap (trainer.memory_cap_gib) is {cap:.2f} GiB per rank" in line
    assert "parallel.dp_shard=none" in line and "parallel.dp_shard=optimizer" in line
    assert preflight.check_memory(at("full", cap), local_ranks=4, on_gpu=False) == []


def test_memory_check_refuses_with_numbers_and_passes_what_fits(monkeypatch):
    cfg = _cfg()  # on_gpu=False: the CPU path, on any machine
    need = preflight.estimate_rank_bytes(cfg, 1, fp32_activations=True).total
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: int(4 * need))
    assert (
        preflight.check_memory(cfg, local_ranks=4, on_gpu=False) == []
    )  # 4 ranks × need fits exactly
    assert len(problems := preflight.check_memory(cfg, local_ranks=5, on_gpu=False)) == 1
    assert "× 5 ranks on this machine" in problems[0] and "model.hidden_size=128" in problems[0]
    assert f"free RAM is {4 * need / 2**30:.2f} GiB" in problems[0]


def test_a_folder_another_rank_makes_or_removes_meanwhile_is_no_refusal(tmp_path, monkeypatch):
    """Ranks under srun validate at the same moment ("File exists" ended a 4-task srun run).
    The two interleavings are replayed exactly: another rank makes the folder just before
    our mkdir, and removes it (its own probe done) just before our first write."""
    from engine.preflight import probe_writable

    real_mkdir, calls = Path.mkdir, []

    def racing_mkdir(self, *args, **kwargs):
        calls.append(self)
        if len(calls) > 1:
            return real_mkdir(self, *args, **kwargs)
        real_mkdir(self)  # the other rank got there first
        real_mkdir(self, *args, **kwargs)
        self.rmdir()  # and cleaned up after its own probe before our write

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    assert probe_writable(tmp_path / "ckpt", directory=True) is None
    assert len(calls) == 2  # made under us and removed, then made again
    assert list(tmp_path.iterdir()) == []
