"""Mixture of experts under context parallelism and through a pipeline
(``verify_equivalence --experts 4 --cp-size 2`` / ``--pp-size 2``): a dropless MoE Llama
equals the unsplit model in fp64 (the step's loss, both router losses at cp, every
gradient), and a planted bug of each layout is named where it first shows. One pair of
ranks runs all four comparisons.

cp: the routers' balance statistics are summed over the cp group
(``layers.router.load_balancing_loss``): the load-balancing loss E·Σ f_i·P_i is a product
of two means, so the mean of the cp ranks' own losses is not the whole sequences' (until
2026-11-28 it was each rank's own: up to 0.3 % in the loss, 15 % in a router's gradient).
The z-loss is a per-token mean and needs no sum.

pp: each stage adds its own layers' router losses to backward
(``engine.pipeline.stages.attach_router_loss``); the reference runs the runtime's
objective, each micro-batch its own forward plus its routers' losses. Until 2026-11-28 the
verifier refused experts at pp > 1 (its reference, the whole batch's model loss alone,
was 4.6× off in a router's gradient)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import engine.pipeline.stages
import parallel_state
from layers.router import TopKRouter
from studies.verification.layouts import VerifySpec, compare_layouts
from tests.multiproc import run_ranks

CP = VerifySpec(model="llama", cp_size=2, num_heads=4, experts=4)
PP = dataclasses.replace(CP, cp_size=1, pp_size=2, microbatches=2)
# every parameter: 2 layers × (2 norms, query, key_value, dense, router, fc1, fc2) + the
# word embedding, the final norm and the untied LM head
GRADS = 2 * 8 + 3


def _each_rank_its_own_part(model) -> None:
    """The routers forget the cp group: each balances its own tokens (the old behaviour)."""
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.cp_group = None


@contextlib.contextmanager
def _router_losses_dropped():
    """Every stage passes its hidden on without its routers' losses."""
    attach = engine.pipeline.stages.attach_router_loss
    engine.pipeline.stages.attach_router_loss = lambda hidden, loss, scale: hidden
    try:
        yield
    finally:
        engine.pipeline.stages.attach_router_loss = attach


RUNS = {
    "cp clean": (CP, None, contextlib.nullcontext),
    "cp own part": (CP, _each_rank_its_own_part, contextlib.nullcontext),
    "pp clean": (PP, None, contextlib.nullcontext),
    "pp router losses dropped": (PP, None, _router_losses_dropped),
}


def _all_runs() -> dict:
    """Rank 0: name -> (ok, [(kind, name, max_rel)], (kind, name) of the first failure)."""
    found = {}
    for name, (spec, mutate, planted) in RUNS.items():
        parallel_state.initialize(spec.dims)
        try:
            with planted():
                report = compare_layouts(spec, mutate_target=mutate)
        finally:
            parallel_state.destroy()
        if report is not None:
            failure = report.first_failure
            rows = [(r.kind, r.name, r.max_rel) for r in report.rows]
            found[name] = (report.ok, rows, failure and (failure.kind, failure.name))
    return found


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_ranks(_all_runs, 2)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "kinds"), [("cp clean", {"aux loss", "z loss"}), ("pp clean", set())]
)
def test_moe_equals_the_unsplit_model_in_fp64(runs, run, kinds):
    """fp64, relative 1e-10 (the verifier's fp64 tolerance: the same terms summed in other
    orders, ~1e-15 apart here)."""
    ok, rows, _ = runs[run]
    assert ok and {"loss", "grad"} | kinds <= {kind for kind, _, _ in rows}, rows
    assert sum(kind == "grad" for kind, _, _ in rows) == GRADS
    assert max(rel for _, _, rel in rows) < 1e-10


@pytest.mark.slow
def test_a_balance_over_each_cp_ranks_own_part_is_named_at_the_first_router(runs):
    ok, rows, first = runs["cp own part"]
    assert not ok and first == ("aux loss", "layers.0.mlp.router"), first
    router_grad = next(rel for kind, name, rel in rows if name == "layers.1.mlp.router.weight")
    assert router_grad > 1e-3  # far outside the tolerance, not a rounding difference


@pytest.mark.slow
def test_router_losses_left_out_of_a_stages_backward_are_named_at_a_router(runs):
    ok, rows, first = runs["pp router losses dropped"]
    assert not ok and first is not None and first[0] == "grad", first
    assert first[1].endswith("mlp.router.weight"), first
    # the model loss itself is right: only the router losses went missing
    assert all(rel < 1e-10 for kind, _, rel in rows if kind == "loss")


def _balance_over_two_ranks() -> dict:
    """Each of 2 ranks holds half of 8 tokens; two routers' weights replicated. Returns the
    per-layer and pooled balance losses this rank computes over the group, and the weights'
    gradients averaged over the group (what the gradient group does), in float64."""
    import torch
    import torch.distributed as dist

    from layers.router import RouterLosses, load_balancing_loss, pooled_load_balancing_loss

    rank, group = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    weights = [torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(2)]
    mine = tokens[rank * 4 : rank * 4 + 4]
    out = {}
    for pooled in (False, True):
        ws = [w.clone().requires_grad_() for w in weights]
        layers = []
        for w in ws:
            probs = (mine @ w.T).softmax(-1)
            slots = torch.bincount(probs.topk(2).indices.reshape(-1), minlength=4)
            layers.append((slots, probs.sum(0)))
        if pooled:
            stats = [
                RouterLosses(*(torch.zeros(()),) * 3, s, p, 4, torch.zeros(()), 1.0, 0.0, group)
                for s, p in layers
            ]
            loss = pooled_load_balancing_loss(stats)
        else:
            loss = sum(load_balancing_loss(s, p, 4, group) for s, p in layers)
        loss.backward()
        grads = []
        for w in ws:
            dist.all_reduce(w.grad, group=group)
            grads.append(w.grad / dist.get_world_size(group))
        out[pooled] = (loss.detach(), grads)
    return out


def _balance_unsplit(pooled: bool):
    """The same losses over all 8 tokens in one process, written out by hand."""
    import torch

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    weights = [
        torch.randn(4, 5, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2)
    ]
    f, p = [], []
    for w in weights:
        probs = (tokens @ w.T).softmax(-1)
        f.append(torch.bincount(probs.topk(2).indices.reshape(-1), minlength=4).double())
        p.append(probs.sum(0))
    if pooled:  # f and P over both layers' 16 token rows first
        loss = 4 * ((f[0] + f[1]) / 16 * (p[0] + p[1]) / 16).sum()
    else:
        loss = sum(4 * (fi / 8 * pi / 8).sum() for fi, pi in zip(f, p, strict=True))
    loss.backward()
    return loss.detach(), [w.grad for w in weights]


@pytest.mark.slow
@pytest.mark.parametrize("pooled", [False, True], ids=["per layer", "pooled over layers"])
def test_the_balance_loss_over_a_cp_group_is_the_whole_tokens(pooled):
    """``load_balancing_loss`` and ``pooled_load_balancing_loss`` (model.moe_aux_loss_pooling
    =model, which the verifier has no flag for) over a 2-rank group, each rank half the
    tokens: every rank's loss and the group-averaged gradients equal the unsplit loss and
    gradients written out by hand (fp64, the same sums in another order: 1e-12)."""
    import torch

    want_loss, want_grads = _balance_unsplit(pooled)
    for rank in run_ranks(_balance_over_two_ranks, 2):
        loss, grads = rank[pooled]
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
