"""Running ``tools/verify_equivalence.py --hf-dir`` end to end, its ``main`` on real gloo
ranks as a launcher's ranks run it, for the tests of the transformers families that check
the verifier. (The tool's own launch, a fresh interpreter starting local workers, is run
by tests/test_hf_import_checks.py and tests/test_hf.py.)"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import torch.distributed as dist

from tests.multiproc import run_ranks

TOOL = Path(__file__).resolve().parents[1] / "tools" / "verify_equivalence.py"
PREFIX = "max abs logit error: "


def _tool_main():
    """``tools/verify_equivalence.py``'s ``main``, loaded from its file (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("verify_equivalence", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _verify_on_rank(runs: list[list[str]]) -> list[tuple[int, str]]:
    """Each argv of ``runs`` through the verifier's ``main`` on this rank, as a launcher's
    rank runs it (RANK and WORLD_SIZE set: its ``run_on_mesh`` path, on the group this rank
    already joined): the exit status and stdout of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    launcher = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
    os.environ.update({k: str(v) for k, v in launcher.items()})
    main, done = _tool_main(), []
    for argv in runs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(argv)
        done.append((status, out.getvalue()))
    return done


def verify_in_one_launch(world: int, *runs: list[str], timeout: float) -> list[str]:
    """Rank 0's report (stdout) for each argv of ``runs`` (``--hf-dir`` and a layout), all
    run one after another on the same ``world`` gloo ranks: one start of the ranks, whose
    forkserver has torch and the engine loaded, instead of a fresh interpreter and elastic
    launch per run (most of such a test's time). Every rank must exit 0 on every run."""
    ranks = run_ranks(_verify_on_rank, world, [list(argv) for argv in runs], timeout=timeout)
    for rank, done in enumerate(ranks):
        assert [status for status, _ in done] == [0] * len(runs), (rank, done)
    return [stdout for _, stdout in ranks[0]]


def logit_error(report: str) -> float:
    """The error a ``--hf-dir`` report ends with (its last line)."""
    last = report.strip().splitlines()[-1]
    assert last.startswith(PREFIX), last
    return float(last.removeprefix(PREFIX))
