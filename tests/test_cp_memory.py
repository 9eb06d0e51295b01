"""The context-parallel memory benchmark's plumbing (``studies/bench/cp_memory.py``) on a
short sequence at cp 1: every field present and positive, and the measured growth at least
what one forward + backward must hold alive at once, a bound derived by hand. The cp 4 run
at 16k tokens (minutes on a 2-core CPU) is in docs/BENCHMARKS.md, not here."""

from __future__ import annotations

import pytest

from studies.bench.cp_memory import measure, parse_args
from tests.multiproc import run_ranks

SEQ = 64


def _launch(fn, world, args):
    """The benchmark's launcher contract on the test harness's gloo ranks."""
    return run_ranks(fn, world, args)[0]


@pytest.mark.slow  # a spawned rank imports torch and the engine: ~3 s or more on one core
def test_cp1_fields_are_positive_and_cover_the_logits():
    """llama_tiny (vocabulary 8192) in fp32: the cross-entropy's backward needs the
    [SEQ, 8192] fp32 logits (or their softmax, the same size) alive, 2 MiB here, so a growth
    below that means the window missed the pass (the peak read before it, or the baseline
    taken after it)."""
    r = measure(parse_args(["--seq-len", str(SEQ), "--cp", "1"]), launch=_launch)
    fields = ("cp1_bytes", "cpN_bytes", "share_bytes", "ratio")
    assert all(r[k] > 0 for k in fields), r
    assert r["cp1_bytes"] >= SEQ * 8192 * 4, r
    assert len(r["cpN_bytes_per_rank"]) == 1, r
