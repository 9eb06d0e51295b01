"""A fault planted in the sequence-parallel collectives of ``layers.mappings`` reaches the
sequence-parallel column linear too (it once called private copies), so fault injection
and fault-finding tools see every sequence-parallel path.

Two gloo ranks, float64. Without the fault the input gradient of the sequence-parallel
column linear matches the unsplit ``nn.Linear`` to 1e-12 relative (sums are only
reordered, as in test_tp_layers.py). With ``reduce_scatter_dim`` planted to split
without summing, each rank keeps only its own half of the contraction over the output
features, which is off from the full gradient by the other rank's half: relative error
well above 0.1 for random data (measured 0.72 and 0.75 on the two ranks), so the test
requires > 0.1.
"""

from __future__ import annotations

import torch
from torch import nn

import layers.mappings
import parallel_state
from layers import ColumnParallelLinear
from tests.multiproc import run_ranks

SEQ, BATCH, IN, OUT = 8, 2, 6, 10


def _input_grad_error(fault: bool) -> float:
    ps = parallel_state.initialize(2)
    torch.manual_seed(0)  # the same data on both ranks
    w, b = torch.randn(OUT, IN, dtype=torch.float64), torch.randn(OUT, dtype=torch.float64)
    x_full = torch.randn(SEQ, BATCH, IN, dtype=torch.float64)
    grad_y_full = torch.randn(SEQ, BATCH, OUT, dtype=torch.float64)
    ref = nn.Linear(IN, OUT, dtype=torch.float64)
    ref.weight.data.copy_(w), ref.bias.data.copy_(b)
    x_ref = x_full.clone().requires_grad_(True)
    ref(x_ref).backward(grad_y_full)

    if fault:  # split without summing the partial products
        layers.mappings.reduce_scatter_dim = lambda x, dim, group, timer=None: (
            layers.mappings._split(x, dim, group)
        )
    col = ColumnParallelLinear.from_full(w, b, dtype=torch.float64, sequence_parallel=True)
    rows = SEQ // 2
    x = x_full[ps.tp_rank * rows : (ps.tp_rank + 1) * rows].clone().requires_grad_(True)
    y = col(x)  # [SEQ, BATCH, OUT / 2]: the whole sequence, this rank's output features
    cols = OUT // 2
    y.backward(grad_y_full[..., ps.tp_rank * cols : (ps.tp_rank + 1) * cols])
    expected = x_ref.grad[ps.tp_rank * rows : (ps.tp_rank + 1) * rows]
    return ((x.grad - expected).abs().max() / expected.abs().max()).item()


def test_planted_reduce_scatter_fault_reaches_the_sequence_parallel_linear():
    assert max(run_ranks(_input_grad_error, 2, False)) <= 1e-12
    assert min(run_ranks(_input_grad_error, 2, True)) > 0.1
