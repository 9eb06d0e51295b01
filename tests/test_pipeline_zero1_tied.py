"""ZeRO-1 under a pipeline with tied embeddings: the word embedding's first- and
last-stage copies sum their DP-reduced gradients shard by shard.

ZeRO-1 reduce-scatters gradients into buckets, so after the reduction a rank holds only
its shard of each bucket; the tied embedding takes a bucket of its own on both stages
(``param_roles.mark_tied_across``), whose shards then cover the same elements and are
summed over the embedding group. The verifier (fp64, relative tolerance 1e-10: the layout
only reorders sums) compares 3 steps' losses with the unsplit model's; ZeRO-1 keeps its
gradients in its buckets, so a wrong embedding update shows in the losses after the first
step. Planted: the tied sum left out (each copy steps on its own stage's gradient alone).
"""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.test_context_parallel import planted_report

SPEC = dict(model="gpt", pp_size=2, dp_size=2, dp_shard="optimizer", microbatches=2, steps=3)


def _runs() -> dict[str, tuple | None]:
    from engine.pipeline.stages import PipelineModel
    from studies.verification.layouts import VerifySpec

    spec = VerifySpec(**SPEC)
    return {
        "clean": planted_report(spec),
        "no tied sum": planted_report(spec, PipelineModel, "sum_tied_grads", lambda *a: None),
    }


@pytest.mark.slow
def test_zero1_pipeline_with_tied_embeddings_equals_the_unsplit_model():
    """pp 2 × dp 2 under ZeRO-1, GPT with its head tied to the word embedding: every loss
    of 3 steps within 1e-10 of the unsplit model's. Without the tied sum the second step's
    loss is the first out of tolerance."""
    found = run_ranks(_runs, 4)[0]
    print(found)
    rows, failure = found["clean"]
    assert rows >= 3 and failure is None, failure
    _, failure = found["no tied sum"]
    assert failure is not None and failure[:2] == ("loss", "loss (step 1)"), failure
