"""Packed documents (``data.document_mask``) through a pipeline and through MoE layers,
against the unsplit model, by the layout verifier.

The verifier packs every row of its batch with 1 to 4 documents (``packed_documents``)
and compares, in fp64 at relative tolerance 1e-10 (the layouts only reorder sums; see
studies/verification/layouts.py), every module output, the losses and every gradient.
The pipeline's stages get the document ids as a keyword input of each stage, beside the
activations. The planted bugs show both of their uses are checked, on GPT: a stage that
drops the mask first differs at the first attention core (the embedding and the norm
before it see no mask); one that embeds at the row's positions instead of restarting
them at each document differs at the embedding (GPT's learned position table). Both by
O(1e-1) relative. On Llama the restart is invisible by design: rotary attention depends
on positions only through their differences, which a shift within a document keeps
(measured 6e-10 relative there, rounding of the larger angles).
"""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.test_context_parallel import planted_report

FIRST_FAILURE = {  # planted bug: the first row out of tolerance
    "pp 2, stages without the mask": ("output", "layers.0.attention.core"),
    "pp 2, positions not restarted": ("output", "embedding"),
}


def _unreset(document_ids):
    """Positions 0 … s−1 along the row: not restarted at each document."""
    import torch

    b, s = document_ids.shape
    return torch.arange(s, device=document_ids.device).expand(b, -1)


def _runs() -> dict[str, tuple | None]:
    """Per run: (rows compared, first failing row as (kind, name, max_rel) or None)."""
    import engine.pipeline.stages as stages
    from studies.verification.layouts import VerifySpec

    piped = VerifySpec(model="gpt", tp_size=1, pp_size=2, microbatches=2, document_mask=True)
    experts = VerifySpec(
        model="llama", tp_size=1, dp_size=2, ep_size=2, experts=4, num_heads=4, document_mask=True
    )
    return {
        "pp 2": planted_report(piped),
        "pp 2, stages without the mask": planted_report(
            piped, stages, "DocumentMask", lambda ids: None
        ),
        "pp 2, positions not restarted": planted_report(
            piped, stages, "document_positions", _unreset
        ),
        "experts 4, ep 2": planted_report(experts),
    }


@pytest.mark.slow
def test_packed_documents_through_a_pipeline_and_experts_equal_the_unsplit_model():
    """GPT at pp 2 (1F1B, a layer a stage) and Llama with 4 experts at dp 2 × ep 2: clean
    within 1e-10. The stages dropping the document mask, or embedding at the row's
    positions instead of each document's, first fail where ``FIRST_FAILURE`` says, by more
    than 1e-2 relative."""
    found = run_ranks(_runs, 2)[0]
    print(found)
    for name in ("pp 2", "experts 4, ep 2"):
        rows, failure = found.pop(name)
        assert rows > 30 and failure is None, (name, failure)
    for name, (_, failure) in found.items():
        assert failure is not None and failure[:2] == FIRST_FAILURE[name], (name, failure)
        assert failure[2] > 1e-2, (name, failure)
