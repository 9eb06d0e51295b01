"""The layout verifier at cp 2 on packed documents, and ring bugs planted one at a time.

The verifier compares the cp 2 model with the unsplit one in fp64 (tolerance 1e-10: the
ring only reorders sums; see studies/verification/layouts.py). Each planted bug is a
monkeypatch of one function of ``layers.ring_attention``, so the first module whose
output differs is the first attention core (``layers.0.attention.core``): everything
before it (embedding, norm, QKV projection) runs per token and never sees the ring. Each
bug changes which keys a query weighs or how, so the error there is O(1e-3) or more.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks
from tests.test_context_parallel import planted_report

CORE = ("output", "layers.0.attention.core")


def _skip_no_rescale(out, lse, block_out, block_lse) -> None:
    """``_merge_`` without the log-sum-exp rescale of the running output: the blocks'
    outputs are added as if the earlier ones had been normalised by the final sum."""
    new = torch.logaddexp(lse, block_lse)
    base = new.masked_fill(new == float("-inf"), 0.0)
    out.add_(block_out * torch.exp(block_lse - base)[..., None])
    lse.copy_(new)


def _plants():
    """(name, module attribute, replacement, document mask) of each run; None: clean."""
    import layers.ring_attention as ring

    original_blocks = ring.ring_blocks

    def swapped(rank, source, cp_size, local_len, *, causal):
        """A visiting rank's two chunks taken in swapped order: its late chunk where its
        early one belongs (the early one precedes both of ours)."""
        blocks = original_blocks(rank, source, cp_size, local_len, causal=causal)
        if causal and source < rank:
            return (ring.Block(slice(0, local_len), slice(local_len // 2, local_len), False),)
        return blocks

    def leaky(rank, source, cp_size, local_len, *, causal):
        """A block entirely in the future (our early chunk against a later rank's early
        chunk) computed with the diagonal's causal triangle instead of skipped."""
        blocks = original_blocks(rank, source, cp_size, local_len, causal=causal)
        if causal and source > rank:
            half = slice(0, local_len // 2)
            return (*blocks, ring.Block(half, half, True))
        return blocks

    class _NoDocuments(ring._Ring):
        """The ring ignoring the document ids it is handed."""

        def __init__(self, group, causal, scale, documents, *rest, **keywords):
            super().__init__(group, causal, scale, None, *rest, **keywords)

    return (
        ("documents", None, None, True),
        ("documents ignored", "_Ring", _NoDocuments, True),
        ("no rescale", "_merge_", _skip_no_rescale, False),
        ("chunks swapped", "ring_blocks", swapped, False),
        ("future block masked", "ring_blocks", leaky, False),
    )


def _verify_with_plants() -> dict[str, tuple | None]:
    """Per plant: (rows compared, first failing row as (kind, name, max_rel) or None)."""
    import layers.ring_attention as ring
    from studies.verification.layouts import VerifySpec

    found = {}
    for name, attribute, replacement, documents in _plants():
        spec = VerifySpec(model="llama", tp_size=1, cp_size=2, num_heads=4, document_mask=documents)
        plant = (ring, attribute, replacement) if attribute else ()
        found[name] = planted_report(spec, *plant)
    return found


@pytest.mark.slow
def test_the_verifier_on_packed_documents_and_the_ring_bugs_it_names():
    """cp 2 on rows packed with 1 to 4 documents: every output, the loss and every
    gradient within 1e-10. The ring ignoring the documents, merging without the
    log-sum-exp rescale, taking a visiting rank's chunks in swapped order, or computing a
    future block under the causal triangle instead of skipping it: each first fails at the
    first attention core, by more than 1e-3 relative."""
    found = run_ranks(_verify_with_plants, 2)[0]
    print(found)
    rows, failure = found.pop("documents")
    assert rows > 30 and failure is None, failure
    for name, (_, failure) in found.items():
        assert failure is not None and failure[:2] == CORE, (name, failure)
        assert failure[2] > 1e-3, (name, failure)


def test_the_document_mask_is_refused_where_the_model_takes_no_document_ids():
    """BERT packs no documents: one line, before any rank starts. The causal decoders take
    it at every layout (pipelines and experts: tests/test_document_mask_layouts.py)."""
    from studies.verification.layouts import VerifySpec

    with pytest.raises(ValueError, match=r"^--document-mask packs causal documents, not bert$"):
        VerifySpec(model="bert", tp_size=1, document_mask=True).check()
    piped = {"pp_size": 2, "num_layers": 2, "microbatches": 2}
    for extra in (piped, {"experts": 4, "dp_size": 1}):
        VerifySpec(model="llama", tp_size=1, num_heads=4, document_mask=True, **extra).check()
