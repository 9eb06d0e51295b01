"""The zero-bubble schedules (interleaved zero bubble, ZB-V, DualPipeV) against the
unsplit model, and their rules.

Each splits every backward into the input gradient (sent upstream at once) and the weight
gradient (run later, to fill the bubble): two ``autograd.grad`` calls over the graph one
``backward`` walks at 1F1B, so the weight gradients are the same sums, taken in another
order. float64, 1e-10 relative (the verifier's float64 tolerance), as tests/test_pipeline.py
argues: reordered sums stay near 1e-15 while a lost weight gradient or a stage run twice
shows as O(1).
"""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.test_pipeline import _check, _compare, _pp

ZB_SPECS = {
    "zero_bubble": _pp("zero_bubble"),  # one stage per rank: the paper's ZB-H1
    "zbv": _pp("zbv", virtual_stages=2),
    "dualpipev": _pp("dualpipev", virtual_stages=2),
}


@pytest.mark.parametrize("schedule", list(ZB_SPECS))
def test_pp2_zero_bubble_schedules_match_unsplit(schedule):
    """GPT at pp 2 (tied embeddings: under a V rank 0 holds the first and the last stage,
    both reading the one word embedding): outputs, hand-offs, loss and every gradient."""
    _check(run_ranks(_compare, 2, [ZB_SPECS[schedule]], timeout=120)[0])
