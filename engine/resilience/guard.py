"""Bad steps: a non-finite loss or gradient norm skips the step; too many in a row stop the run.

Every rank takes the same decision: the gradient norm is already the same on every rank
of the mesh, and a non-finite loss on any DP rank is agreed on with one all-reduce of a
flag. A checkpoint is never written while the run is in a streak of non-finite steps or
when the weights themselves are non-finite, so the last good checkpoints survive a run
that went bad (pruning only happens when a checkpoint is written).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from engine import comm
from engine.resilience.watchdog import RunStopped
from layers.utils import local_part


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is True on any rank of the run (every rank steps together)."""
    return comm.any_rank(flag, comm.world(), device)


class BadStepGuard:
    """Counts bad steps (non-finite loss or gradient norm, fp16 overflow) in a row.

    ``check`` says whether the optimizer step must be skipped and raises RunStopped when
    ``max_bad_steps`` bad steps came in a row; ``may_save`` says whether a checkpoint may
    be written now.
    """

    def __init__(
        self, max_bad_steps: int, device: torch.device, log: Callable[[str], None]
    ) -> None:
        self.max_bad_steps, self.device, self.log = max_bad_steps, device, log
        self.streak = 0  # bad steps in a row, of any kind
        # Steps of this process's run that succeeded, and that were non-finite; an fp16
        # overflow is neither (the loss scaler's calibration, normal at the start).
        self.good = self.bad = 0
        self.nonfinite_streak = 0  # of them, those with a non-finite loss or norm

    def check(
        self,
        step: int,
        loss: float,
        norm: float,
        *,
        overflow: bool = False,
        loss_scale: float | None = None,
    ) -> bool:
        """Whether step ``step`` must be skipped (collective: every rank calls it)."""
        loss_bad = _any_rank(not math.isfinite(loss), self.device)
        if not overflow and not loss_bad and math.isfinite(norm):
            self.streak = self.nonfinite_streak = 0
            self.good += 1
            return False
        self.streak += 1
        if overflow:  # the loss scaler's own business; the log window counts them
            why = f"the fp16 loss scale overflowed (scale now {loss_scale:g})"
        else:
            self.nonfinite_streak += 1
            self.bad += 1
            why = f"non-finite loss {loss:g} or gradient norm {norm:g}"
            self.log(
                f"step {step}: {why}: step skipped, weights unchanged "
                f"({self.streak} bad in a row, trainer.max_bad_steps={self.max_bad_steps})"
            )
        if self.streak >= self.max_bad_steps:
            raise RunStopped(
                f"stopped at step {step}: {self.streak} bad steps in a row, the last one "
                f"with {why}; no checkpoint was written since the last good step (lower "
                "optim.lr, or raise trainer.max_bad_steps)",
                agreed=True,
            )
        return True

    def check_any_good(self) -> None:
        """RunStopped when steps were non-finite and none succeeded, however few there were
        (a run shorter than ``max_bad_steps`` must not end as a success)."""
        if self.bad and not self.good:
            raise RunStopped(
                f"no step succeeded: {self.bad} steps of this run were non-finite and skipped, "
                "none was good; lower optim.lr, or check the data and the checkpoint",
                agreed=True,
            )

    def may_save(self, step: int, params: Iterable[torch.Tensor]) -> bool:
        """False (with a log line) while non-finite steps are being skipped; RunStopped when
        the weights themselves are non-finite. Collective: every rank calls it."""
        if self.nonfinite_streak:
            self.log(
                f"not saving step {step}: its last {self.nonfinite_streak} steps were skipped "
                "as non-finite (the previous checkpoints stay as they are)"
            )
            return False
        local_bad = any(not bool(torch.isfinite(local_part(p.detach())).all()) for p in params)
        if _any_rank(local_bad, self.device):
            raise RunStopped(
                f"stopped at step {step}: the weights are non-finite, so no checkpoint was "
                "written (the previous checkpoints stay as they are; lower optim.lr)",
                agreed=True,
            )
        return True
