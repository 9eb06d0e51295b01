"""The transformer layer's dropout streams, recomputation and activation memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import layers.attention
import layers.transformer
import parallel_state
from engine.data_parallel import GradSync
from engine.models import ModelConfig, build_model
from engine.models.activation_memory import activation_memory_table
from layers.attention import heads_per_rank
from tests.multiproc import run_ranks
from tests.tiny_configs import tiny_config

DROPOUT_CFG = tiny_config(
    vocab_size=301, max_positions=8, hidden_dropout=0.2, attention_dropout=0.2
)


def _grads_and_streams(cfg: ModelConfig, seed: int = 5):
    ps = parallel_state.get()
    ps.seed(seed)
    model = build_model(cfg, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(ids, ids).mean()
    loss.backward()
    GradSync(model.parameters(), grad_group=ps.dp_group, tp_group=ps.tp_group).finish()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, ps.rng.get_states()


def _recompute_reproduces_dropout() -> dict[str, bool]:
    parallel_state.initialize(2, 1)
    checks = {}
    for sp in (False, True):
        base = replace(DROPOUT_CFG, sequence_parallel=sp)
        loss0, grads0, streams0 = _grads_and_streams(base)
        for mode in ("selective", "full"):
            loss, grads, streams = _grads_and_streams(replace(base, recompute=mode))
            key = f"sp={sp} {mode}"
            # Recomputation replays the same ops on the same values: bitwise equal.
            checks[f"{key}: loss"] = torch.equal(loss, loss0)
            checks[f"{key}: grads"] = all(torch.equal(grads[n], grads0[n]) for n in grads0)
            # Afterwards every stream is where it would be without recomputation.
            checks[f"{key}: streams"] = all(torch.equal(streams[k], streams0[k]) for k in streams0)
    # Control: plain torch checkpointing does not replay the sharded stream, so the
    # recomputed attention dropout draws another mask and the gradients change.
    plain = lambda fn, *args, rng: checkpoint(fn, *args, use_reentrant=False)
    original, layers.attention.checkpointed = layers.attention.checkpointed, plain
    try:
        _, grads, _ = _grads_and_streams(replace(DROPOUT_CFG, recompute="selective"))
    finally:
        layers.attention.checkpointed = original
    _, grads0, _ = _grads_and_streams(DROPOUT_CFG)
    checks["control: plain checkpoint changes grads"] = not all(
        torch.equal(grads[n], grads0[n]) for n in grads0
    )
    return checks


@pytest.mark.slow
def test_recompute_with_dropout_gives_the_same_gradients():
    results = run_ranks(_recompute_reproduces_dropout, 2)
    for rank, checks in enumerate(results):
        assert len(checks) == 13
        assert all(checks.values()), (rank, [k for k, ok in checks.items() if not ok])


def _gather_tp(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _dropout_streams() -> dict[str, bool]:
    ps = parallel_state.initialize(2, 1)
    ps.seed(3)
    layer = layers.transformer.ParallelTransformerLayer(DROPOUT_CFG, dtype=torch.float64)
    # Give both TP ranks the same heads: only the dropout masks can then tell them apart.
    for p in (layer.attention.qkv.weight, layer.attention.qkv.bias):
        dist.broadcast(p.data, src=0, group=ps.tp_group)
    core = []
    layer.attention.core.register_forward_hook(lambda m, a, o: core.append(o.detach()))
    x = torch.randn(8, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    layer.eval()
    layer(x)
    outs, train_heads, eval_heads = (_gather_tp(t, ps.tp_group) for t in (out, *core))
    return {
        # The residual stream is replicated: its dropout mask must agree across TP.
        "replicated output identical across TP": torch.equal(outs[0].detach(), outs[1].detach()),
        # Attention probabilities are sharded by head: each rank draws its own mask.
        "attention dropout differs across TP": not torch.equal(*train_heads),
        "control: equal heads without dropout": torch.equal(*eval_heads),
    }


def test_dropout_streams_replicated_vs_sharded():
    for checks in run_ranks(_dropout_streams, 2):
        assert all(checks.values()), checks


def test_heads_must_divide_by_tp_size():
    with pytest.raises(
        ValueError, match=r"num_heads \(6\) is not divisible by the tensor-parallel size \(4\)"
    ):
        heads_per_rank(6, 4)
    assert heads_per_rank(12, 4) == 3


def _memory(cfg: ModelConfig):
    parallel_state.initialize(2, 1).seed(0)
    return activation_memory_table(cfg, seq_len=128, batch_size=2)


@pytest.mark.slow
def test_activation_memory_against_reference_formula():
    """Bytes kept for backward by one bf16 layer at t=2, in units of s·b·h.

    Measured = formula exactly, up to the differences explained here (and the tiny fp32
    LayerNorm statistics and attention log-sum-exp, < 0.1 s·b·h):
    * attention dropout 0 runs SDPA's fused CPU kernel, which stores no s×s matrices: the
      5·a·s/(h·t) term vanishes (a fused attention kernel keeps no s×s scores);
    * under sequence parallelism ColumnParallelLinear keeps only the input's sequence
      shard and re-gathers it in backward (as the formula assumes), so the SP rows match
      the formula apart from the scores term above; before that change the gathered QKV
      and fc1 inputs cost 4·(1 − 1/t) s·b·h more, and this test would fail.
    """
    s, b, h, a, t = 128, 2, 256, 8, 2
    cfg = ModelConfig(hidden_size=h, num_heads=a, num_layers=1, attention_dropout=0.0)
    rows = run_ranks(_memory, 2, cfg)[0]
    unit = s * b * h
    scores = 5 * a * s / (h * t)
    expected = [scores, scores, 0.0, 0.0]  # formula − measured, in s·b·h units
    for row, gap in zip(rows, expected, strict=True):
        measured, formula = row.measured / unit, row.formula / unit
        print(f"{row.label:38s} measured {measured:6.2f}  formula {formula:6.2f}  (x s·b·h bytes)")
        assert formula - measured == pytest.approx(gap, abs=0.1), row.label
