"""The rank runner's handling of a rank that crashes (``tests/multiproc.py``): a rank
killed by a signal is noticed when it dies (not after the timeout), the run is repeated once,
and a second crash fails the test naming the signal. The crash is a real SIGSEGV sent to
the rank's own process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.multiproc import RankFailure, run_ranks


def _crash_once(marker: str, always: bool) -> int:
    """Rank 1 kills itself by SIGSEGV (the first time only, unless ``always``); rank 0
    waits in a collective for it, as a rank whose peer crashed does."""
    if dist.get_rank() == 1 and (always or not Path(marker).exists()):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return dist.get_rank()


def test_a_rank_killed_once_by_a_signal_is_run_again(tmp_path, capfd):
    assert run_ranks(_crash_once, 2, str(tmp_path / "crashed"), False, timeout=60) == [0, 1]
    assert "rank 1 by SIGSEGV; running the 2 ranks once more" in capfd.readouterr().err


def test_a_rank_that_crashes_again_fails_at_once_naming_the_signal(tmp_path):
    with pytest.raises(RankFailure, match="SIGSEGV.*in the run before.*SIGSEGV") as err:
        run_ranks(_crash_once, 2, str(tmp_path / "crashed"), True, timeout=600)
    # Noticed by the exit code or the peer's error, not by waiting out the timeout.
    assert "did not finish" not in str(err.value)
