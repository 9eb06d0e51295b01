"""Mixture of experts through a pipeline (``verify_equivalence --experts 4 --pp-size 2``):
a dropless MoE Llama cut into 2 stages equals the unsplit model in fp64 (the step's loss
and every gradient), and a stage whose router losses never reach backward is named.

Each stage adds its own layers' router losses to backward (``engine.pipeline.stages.
attach_router_loss``). The reference runs the runtime's objective: each micro-batch its
own forward plus its routers' losses (a balance loss is a product of means over one
forward's tokens). Until 2026-11-28 the verifier refused experts at pp > 1; its reference
was the whole batch's model loss alone, 4.6× off in a router's gradient."""

from __future__ import annotations

import pytest

import engine.pipeline.stages
import parallel_state
from studies.verification.layouts import VerifySpec, compare_layouts
from tests.multiproc import run_ranks

SPEC = VerifySpec(model="llama", pp_size=2, microbatches=2, num_heads=4, experts=4)
_ATTACH = engine.pipeline.stages.attach_router_loss


def _both_runs() -> dict:
    found = {}
    for name in ("clean", "router losses dropped"):
        if name != "clean":  # every stage passes its hidden on without its routers' losses
            engine.pipeline.stages.attach_router_loss = lambda hidden, loss, scale: hidden
        parallel_state.initialize(SPEC.dims)
        try:
            report = compare_layouts(SPEC)
        finally:
            parallel_state.destroy()
            engine.pipeline.stages.attach_router_loss = _ATTACH
        if report is not None:  # rank 0
            failure = report.first_failure
            found[name] = (
                report.ok,
                [(r.kind, r.name, r.max_rel) for r in report.rows],
                failure and (failure.kind, failure.name),
            )
    return found


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_ranks(_both_runs, 2)[0]


@pytest.mark.slow
def test_pp2_moe_equals_the_unsplit_model_in_fp64(runs):
    """fp64, relative 1e-10 (the verifier's fp64 tolerance)."""
    ok, rows, _ = runs["clean"]
    assert ok, [r for r in rows if r[2] >= 1e-10]
    # every parameter: 2 layers × (2 norms, query, key_value, dense, router, fc1, fc2)
    # + the word embedding, the final norm and the untied LM head
    assert sum(kind == "grad" for kind, _, _ in rows) == 2 * 8 + 3
    assert [kind for kind, _, _ in rows].count("loss") == 1
    assert max(rel for _, _, rel in rows) < 1e-10


@pytest.mark.slow
def test_router_losses_left_out_of_backward_are_named_at_a_router(runs):
    ok, rows, first = runs["router losses dropped"]
    assert not ok and first is not None and first[0] == "grad", first
    assert first[1].endswith("mlp.router.weight"), first
    # the model loss itself is right: only the router losses went missing
    assert all(rel < 1e-10 for kind, _, rel in rows if kind == "loss")
