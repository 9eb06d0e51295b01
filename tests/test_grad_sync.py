"""Data-parallel gradient sync: dp ranks on half batches equal one rank on the whole batch.

Reference: the same model, unsplit, on one process over the whole global batch, in
float64. Tolerance 1e-12 relative: the averaged gradient differs from the serial one only
by the order of summation (per-rank partial sums, then the all-reduce).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parallel_state
from engine.data_parallel import GradSync
from layers import ColumnParallelLinear, RowParallelLinear, shard
from layers.param_roles import mark_sp_partial_grad
from tests.bucket_probe import LaunchProbe
from tests.multiproc import run_ranks

GLOBAL_BATCH, H, FFN = 8, 12, 24
TOL = 1e-12


class TinyNet(nn.Module):
    """Column → GeLU → Row MLP, then a replicated head, plus a parameter that gets no grad."""

    def __init__(self, w1, b1, w2, b2, w3, tp_group=None):
        super().__init__()
        kw = {"dtype": torch.float64, "tp_group": tp_group}
        self.fc1 = ColumnParallelLinear.from_full(w1, b1, **kw)
        self.fc2 = RowParallelLinear.from_full(w2, b2, **kw)
        self.head = nn.Linear(H, 1, bias=False, dtype=torch.float64)
        self.head.weight.data.copy_(w3)
        self.unused = nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def forward(self, x, probe=None):
        h = self.fc2(F.gelu(self.fc1(x)))
        if probe is not None:
            h = probe(h)
        return self.head(h).squeeze(-1)


def _dp_equivalence(
    tp: int, dp: int, bucket_mb: float, micro_batches: int, overlap: bool = True
) -> list[int]:
    ps = parallel_state.initialize(tp, dp)
    torch.manual_seed(0)  # same weights and data on every rank
    weights = [
        torch.randn(FFN, H),
        torch.randn(FFN),
        torch.randn(H, FFN),
        torch.randn(H),
        torch.randn(1, H),
    ]
    weights = [w.double() for w in weights]
    x, y = (
        torch.randn(GLOBAL_BATCH, H, dtype=torch.float64),
        torch.randn(GLOBAL_BATCH, dtype=torch.float64),
    )

    serial = TinyNet(*weights, tp_group=None if tp == 1 else _single_group(ps))
    F.mse_loss(serial(x), y).backward()

    model = TinyNet(*weights)
    sync = GradSync(
        model.parameters(), grad_group=ps.dp_group, bucket_size_mb=bucket_mb, overlap=overlap
    )
    per_rank = GLOBAL_BATCH // dp
    for _ in range(2):  # the first step also teaches GradSync the real gradient order
        launched_mid_backward = _one_step(model, sync, x, y, ps.dp_rank, per_rank, micro_batches)

    rank = ps.tp_rank
    pairs = [
        (model.fc1.weight.grad, shard(serial.fc1.weight.grad, 0, rank, tp)),
        (model.fc1.bias.grad, shard(serial.fc1.bias.grad, 0, rank, tp)),
        (model.fc2.weight.grad, shard(serial.fc2.weight.grad, 1, rank, tp)),
        (model.fc2.bias.grad, serial.fc2.bias.grad),
        (model.head.weight.grad, serial.head.weight.grad),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=TOL, atol=0)
    assert model.unused.grad is None or torch.all(model.unused.grad == 0)
    return [launched_mid_backward[0], len(sync.buckets)] if launched_mid_backward else []


def _one_step(model, sync, x, y, dp_rank, per_rank, micro_batches) -> list[int]:
    model.zero_grad(set_to_none=True)
    xs = x[dp_rank * per_rank : (dp_rank + 1) * per_rank].chunk(micro_batches)
    ys = y[dp_rank * per_rank : (dp_rank + 1) * per_rank].chunk(micro_batches)
    launched_mid_backward = []
    for i, (xb, yb) in enumerate(zip(xs, ys, strict=True)):
        last = i == micro_batches - 1
        with contextlib.nullcontext() if last else sync.no_sync():
            probe = (lambda h: LaunchProbe.apply(h, sync, launched_mid_backward)) if last else None
            # Each micro-batch's mean, scaled so the DP average is the global-batch mean.
            (F.mse_loss(model(xb, probe), yb, reduction="sum") / per_rank).backward()
    sync.finish()
    return launched_mid_backward


def _single_group(ps):
    """A TP group of one rank, for building the serial reference on every rank."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(ps.world_size)]
    return groups[ps.rank]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "dp", "bucket_mb", "micro"),
    [(1, 2, 1e-5, 1), (1, 2, 100.0, 1), (1, 2, 1e-5, 2), (2, 2, 1e-5, 2), (2, 2, 100.0, 1)],
)
def test_dp_gradients_equal_whole_batch(tp, dp, bucket_mb, micro):
    results = run_ranks(_dp_equivalence, tp * dp, tp, dp, bucket_mb, micro)
    launched, total = results[0]
    if bucket_mb < 1:
        # One parameter per bucket: the head's and fc2's buckets are already in flight
        # when backward reaches the probe, before fc1's gradients exist.
        assert total >= 5 and 1 <= launched < total
    else:
        assert total == 1 and launched == 0  # one bucket: it can only go once it is full


def _sp_grads(reduce_dtype) -> list[torch.Tensor]:
    ps = parallel_state.initialize(2, 1)
    norm_w = nn.Parameter(torch.zeros(4))
    mark_sp_partial_grad(norm_w)
    plain = nn.Parameter(torch.zeros(4))
    sync = GradSync(
        [norm_w, plain], grad_group=ps.dp_group, tp_group=ps.tp_group, reduce_dtype=reduce_dtype
    )
    (norm_w * (ps.tp_rank + 1.0)).sum().backward(retain_graph=True)
    (plain * (ps.tp_rank + 1.0)).sum().backward()
    sync.finish()
    return [norm_w.grad, plain.grad]


def test_without_overlap_every_bucket_waits_for_finish():
    # trainer.overlap_grad_reduce=false: the same averages, but no bucket in flight while
    # backward still runs (one parameter per bucket, so with overlap some would be).
    launched, total = run_ranks(_dp_equivalence, 2, 1, 2, 1e-5, 1, False)[0]
    assert total >= 5 and launched == 0


def test_sequence_parallel_grads_summed_across_tp():
    for r, (norm_grad, plain_grad) in enumerate(run_ranks(_sp_grads, 2, None)):
        assert torch.equal(norm_grad, torch.full((4,), 3.0))  # 1 + 2, summed over TP
        assert torch.equal(plain_grad, torch.full((4,), r + 1.0))  # untouched


def _bf16_fp32_reduce() -> tuple[torch.Tensor, torch.Tensor]:
    ps = parallel_state.initialize(1, 2)
    p = nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    sync = GradSync([p], grad_group=ps.dp_group, reduce_dtype=torch.float32)
    assert sync.buckets[0].dtype == torch.float32
    torch.manual_seed(ps.dp_rank)
    g = torch.randn(64)
    (p * g.bfloat16()).sum().backward()
    sync.finish()
    return p.grad, g.bfloat16()


def test_low_precision_grads_reduced_in_fp32():
    (got, g0), (_, g1) = run_ranks(_bf16_fp32_reduce, 2)
    # fp32 reduction of the two bf16 grads, rounded once to bf16 at the end: exactly the
    # correctly-rounded average (the sum of two bf16 values is exact in fp32).
    expected = ((g0.float() + g1.float()) / 2).bfloat16()
    assert torch.equal(got, expected)


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0, got 0"):
        GradSync([nn.Parameter(torch.zeros(1))], grad_group=None, bucket_size_mb=0)
