"""The layout verifier catches planted parallelism bugs and names where they first show."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import layers.mappings
import parallel_state
from layers.param_roles import mark_sp_partial_grad
from studies.verification.layouts import Report, VerifySpec, compare, compare_layouts
from tests.multiproc import run_ranks


def _swap_q_and_k_across_ranks(model) -> None:
    """Rank 0's first q head and rank 1's first k head trade places (a bad QKV reshard)."""
    ps = parallel_state.get()
    weight, d = model.layers[0].attention.qkv.weight, model.cfg.head_dim
    shards = [torch.empty_like(weight) for _ in range(ps.tp_size)]
    dist.all_gather(shards, weight.detach().contiguous(), group=ps.tp_group)
    with torch.no_grad():  # rows per rank: [head0: q k v | head1: q k v | ...]
        if ps.tp_rank == 0:
            weight[:d] = shards[1][d : 2 * d]
        elif ps.tp_rank == 1:
            weight[d : 2 * d] = shards[0][:d]


def _forget_sequence_parallel_grad_sum(model) -> None:
    """One LayerNorm loses its mark, so GradSync never sums its partial gradients over TP."""
    for p in model.layers[1].mlp_norm.parameters():
        mark_sp_partial_grad(p, False)


def _no_reduce_in_reduce_scatter(ctx, x, group, dim, timer):
    ctx.group, ctx.dim, ctx.timer = group, dim, timer
    return layers.mappings._split(x, dim, group)  # split without summing the partial products


FAULTS = {
    # f's backward all-reduce becomes identity: the LM head's input gradient stays partial.
    "copy backward skips its all-reduce": ("gpt", False, "copy"),
    "q and k heads swapped between TP ranks": ("gpt", False, "swap"),
    "a sequence-parallel LayerNorm is not marked": ("gpt", True, "sp-mark"),
    "sequence reduce-scatter forgets to reduce": ("bert", True, "reduce-scatter"),
}


def _planted_all() -> dict[str, tuple | None]:
    found = {}
    mappings = layers.mappings
    originals = (mappings.start_input_grad_sum, mappings._ReduceScatterToSequence.forward)
    mutate = {"swap": _swap_q_and_k_across_ranks, "sp-mark": _forget_sequence_parallel_grad_sum}
    for name, (model, sequence_parallel, fault) in FAULTS.items():
        if fault == "copy":
            mappings.start_input_grad_sum = lambda grad, group: grad.clone()
        if fault == "reduce-scatter":
            mappings._ReduceScatterToSequence.forward = staticmethod(_no_reduce_in_reduce_scatter)
        parallel_state.initialize(2, 1)
        try:
            spec = VerifySpec(model=model, tp_size=2, sequence_parallel=sequence_parallel)
            report = compare_layouts(spec, mutate_target=mutate.get(fault))
        finally:
            parallel_state.destroy()
            mappings.start_input_grad_sum = originals[0]
            mappings._ReduceScatterToSequence.forward = staticmethod(originals[1])
        failure = report and report.first_failure
        found[name] = failure and (failure.kind, failure.name, failure.max_rel)
    return found


@pytest.mark.slow
def test_planted_bugs_are_named_where_they_first_show():
    expected = {
        "copy backward skips its all-reduce": ("grad", "final_norm.bias"),
        "q and k heads swapped between TP ranks": ("output", "layers.0.attention.qkv"),
        "a sequence-parallel LayerNorm is not marked": ("grad", "layers.1.mlp_norm.bias"),
        # The vocab-parallel embedding is the first to reduce-scatter (into the SP region).
        "sequence reduce-scatter forgets to reduce": ("output", "embedding.word"),
    }
    found = run_ranks(_planted_all, 2)[0]
    for name, first in found.items():
        print(f"{name:48s} -> {first}")
    for name, want in expected.items():
        assert found[name] is not None, f"{name}: not detected"
        assert found[name][:2] == want, (name, found[name])
        assert found[name][2] > 1e-3  # a real bug is far outside the 1e-10 tolerance


def test_compare_is_relative_to_the_reference_scale():
    want = torch.tensor([100.0, -200.0, 0.0], dtype=torch.float64)
    row = compare(
        "grad", "w", want + torch.tensor([0.0, 2e-9, 1e-9], dtype=torch.float64), want, 1e-10
    )
    assert row.max_abs == pytest.approx(2e-9) and row.max_rel == pytest.approx(1e-11) and row.ok
    assert not compare("grad", "w", want[:2], want, 1.0).ok  # shape mismatch always fails
    assert not compare("grad", "w", torch.ones(2), torch.zeros(2), 1e-3).ok
    assert compare("logits", "x", torch.ones(2), torch.zeros(2), 1.0, absolute=True).ok


def test_spec_rejects_empty_layouts_and_an_empty_report_fails():
    for bad in (dict(tp_size=0), dict(dp_size=0), dict(steps=0), dict(tp_size=5)):
        with pytest.raises(ValueError):
            VerifySpec(**bad).check()
    VerifySpec(tp_size=4, dp_size=2).check()
    assert not Report(VerifySpec(), 1e-10, []).ok  # having compared nothing is no pass
