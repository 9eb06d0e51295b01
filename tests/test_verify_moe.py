"""The layout verifier at ep 2 (``tools/verify_equivalence.py --ep-size N``): a
mixture-of-experts Llama at dp 2 × ep 2 equals the unsplit model in fp64 (the routing,
drops under a capacity factor, every output, the losses and every gradient), and four
planted expert-parallel bugs are each named where they first show.

One pair of ranks runs the clean comparison and then each planted bug in turn (the way
tests/test_verify.py plants its TP bugs: a patched function or a mutated target, undone
after each run), so the ranks start once; the parametrized tests read its results."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import layers.moe
import parallel_state
from engine.data_parallel.grad_sync import GradSync, _Bucket
from layers.router import TopKRouter
from studies.verification.layouts import VerifySpec, compare_layouts
from tests.multiproc import run_ranks

# dp 2 × ep 2, 4 experts (2 per rank), top-2, each expert taking at most
# ⌈1.0 · T · k / E⌉ of a rank's token-slots (some are dropped).
SPEC = VerifySpec(
    model="llama", tp_size=1, dp_size=2, ep_size=2, num_heads=4, experts=4, capacity_factor=1.0
)


def _off_by_one_inverse(rows, plan):
    """combine's inverse permutation shifted by one row: each row lands one slot off."""
    if plan.regroup is not None:
        plan = dataclasses.replace(plan, regroup=plan.regroup.roll(1))
    return _COMBINE(rows, plan)


def _not_renormalised(model) -> None:
    """The target's routers keep the top-k probabilities as they are (sum < 1)."""
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.renormalize = False


def _aux_over_the_expert_group(model) -> None:
    """The load-balancing loss's expert loads f averaged over the ``expert`` group (the
    all-to-all's ranks) instead of taken over this rank's own tokens, which the runner's
    objective and the DP average define (the unsplit model run per DP slice)."""
    group = parallel_state.get().group("expert")
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m._losses = _pooled_losses(m, m._losses, group)


def _pooled_losses(router, losses, group):
    def pooled(logits, balance, experts, keep):
        out = losses(logits, balance, experts, keep)
        slots = out.slots_per_expert.to(out.prob_sum.dtype)
        dist.all_reduce(slots, group=group)
        slots /= dist.get_world_size(group)
        out.aux = router.num_experts * (slots / out.tokens * out.prob_sum / out.tokens).sum()
        out.loss = router.aux_coeff * out.aux + router.z_coeff * out.z
        return out

    return pooled


def _expert_bucket_on_the_dense_group(self, params):
    """Every bucket, the experts' too, reduced over the dense gradient group."""
    return _Bucket(params, self._reduce_dtype, self.dp_group)


_COMBINE = layers.moe.combine
FAULTS = {
    "inverse permutation off by one": ("combine", None),
    "top-k probabilities not renormalised": (None, _not_renormalised),
    "auxiliary loss averaged over the expert group": (None, _aux_over_the_expert_group),
    "expert gradients reduced over the dense group": ("bucket", None),
}
EXPECTED = {
    # The experts computed the right rows; putting them back went wrong.
    "inverse permutation off by one": ("output", "layers.0.mlp"),
    "top-k probabilities not renormalised": ("weights", "layers.0.mlp.router"),
    "auxiliary loss averaged over the expert group": ("aux loss", "layers.0.mlp.router"),
    # The forward is right; the first expert gradient in backward order is wrong.
    "expert gradients reduced over the dense group": ("grad", "layers.1.mlp.experts.fc2"),
}


def _run(mutate=None):
    parallel_state.initialize(SPEC.dims)
    try:
        return compare_layouts(SPEC, mutate_target=mutate)
    finally:
        parallel_state.destroy()


def _all_runs() -> dict:
    """Rank 0: {"clean": (ok, rows, notes), fault: (kind, name, max_rel) of the first
    failure or None}."""
    report = _run()
    found = {"clean": report and (report.ok, report.rows, report.notes)}
    bucket = GradSync._bucket
    for name, (patch, mutate) in FAULTS.items():
        if patch == "combine":
            layers.moe.combine = _off_by_one_inverse
        if patch == "bucket":
            GradSync._bucket = _expert_bucket_on_the_dense_group
        try:
            report = _run(mutate)
        finally:
            layers.moe.combine, GradSync._bucket = _COMBINE, bucket
        failure = report and report.first_failure
        found[name] = failure and (failure.kind, failure.name, failure.max_rel)
    return found


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_ranks(_all_runs, 2)[0]


@pytest.mark.slow
def test_dp2_ep2_equals_the_unsplit_model_in_fp64(runs):
    ok, rows, notes = runs["clean"]
    worst = max(r.max_rel for r in rows)
    print(f"{len(rows)} rows, max rel {worst:.3e}")
    assert ok and worst <= 1e-14, [r for r in rows if r.max_rel > 1e-14]
    kinds = {r.kind for r in rows}
    assert {"routes", "dropped", "weights", "aux loss", "z loss", "output", "grad"} <= kinds
    names = {r.name for r in rows}
    # The experts' rows, both layers' outputs, and the split experts' gathered gradients.
    assert {"layers.0.mlp.experts", "layers.1.mlp", "layers.0.mlp.experts.fc1"} <= names
    assert {"loss (step 0)", "router loss (step 0)"} <= names
    # The capacity factor dropped token-slots, the same ones on both sides.
    dropped = [int(n.split(", ")[1].split()[0]) for n in notes]
    assert len(notes) == 2 and all(d > 0 for d in dropped), notes
    # What the README says this layout prints.
    assert len(rows) == 51 and notes[0].startswith(
        "layers.0.mlp.router: 88 token-slots routed, 8 dropped"
    )


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_ep_bug_is_named_where_it_first_shows(runs, fault):
    first = runs[fault]
    print(f"{fault:48s} -> {first}")
    assert first is not None, f"{fault}: not detected"
    assert first[:2] == EXPECTED[fault], (fault, first)
    assert first[2] > 1e-6  # far outside the 1e-10 tolerance


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(dp_size=4, ep_size=3), "ep_size=3 must divide dp_size=4 and experts=4"),
        (dict(dp_size=4, ep_size=4, experts=6), "ep_size=4 must divide dp_size=4 and experts=6"),
        (dict(dp_size=2, ep_size=2, experts=0), "ep_size=2 splits the experts of an MoE model"),
        (
            dict(dp_size=2, ep_size=2, model="gpt"),
            "runs in --model llama or gemma .experts carry no biases; the gpt tiny",
        ),
        (dict(cp_size=2), "at cp_size=2 runs dropless .a capacity would cover each cp rank"),
        (dict(ep_size=1, experts=0), "capacity_factor set the MoE layers of experts > 0"),
        (dict(ep_size=1, experts=-1), "experts=-1 must be >= 0"),
    ],
)
def test_bad_ep_layouts_are_refused_before_a_rank_starts(sizes, message):
    spec = dataclasses.replace(SPEC, **sizes)
    with pytest.raises(ValueError, match=message) as err:
        spec.check()
    assert "\n" not in str(err.value)


def test_the_cli_refuses_a_bad_ep_size_in_one_line(capsys):
    path = Path(__file__).resolve().parents[1] / "tools" / "verify_equivalence.py"
    spec = importlib.util.spec_from_file_location("verify_equivalence", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["--model", "llama", "--tp-size", "1", "--dp-size", "4", "--ep-size", "3"]
    assert tool.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "verify_equivalence: --ep-size 3 must divide --dp-size 4 and --experts 4 (expert "
        "parallelism is carved from the dp ranks, and each ep rank holds whole experts); "
        "choose --ep-size in [1, 2, 4]"
    ]
    assert torch.distributed.is_initialized() is False
