"""Per-DP-rank micro-batches of each optimizer step, as a pure function of consumed samples."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

Batch = torch.Tensor | dict[str, torch.Tensor]


def collate(samples: list[Any]) -> Batch:
    """Stack tensors, or stack each field of dict samples."""
    if isinstance(samples[0], dict):
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    return torch.stack(samples)


class DataIterator:
    """Feeds one data-parallel rank the micro-batches of each optimizer step.

    Step samples are global indices ``consumed .. consumed + global_batch - 1``; DP rank ``r``
    takes the ``r``-th contiguous ``global_batch / dp_size`` of them, cut into
    ``global_batch / (micro_batch * dp_size)`` micro-batches for gradient accumulation. The
    batches depend only on ``(dp_rank, consumed_samples)``: every TP rank of a group sees the
    same data, and resuming from a checkpoint's ``consumed_samples`` replays the same stream.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
    ) -> None:
        if min(global_batch, micro_batch, dp_size) < 1 or consumed_samples < 0:
            raise ValueError(
                f"need positive global_batch ({global_batch}), micro_batch ({micro_batch}), "
                f"dp_size ({dp_size}) and non-negative consumed_samples ({consumed_samples})"
            )
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"global_batch {global_batch} is not divisible by micro_batch {micro_batch} "
                f"x dp_size {dp_size} = {micro_batch * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        self.dataset = dataset
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.accum_steps = global_batch // (micro_batch * dp_size)
        self.consumed_samples = consumed_samples

    def step_indices(self) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches for the next step."""
        per_rank = self.global_batch // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        return [
            list(range(start + m * self.micro_batch, start + (m + 1) * self.micro_batch))
            for m in range(self.accum_steps)
        ]

    def next_step(self) -> list[Batch]:
        """This rank's ``accum_steps`` micro-batches for one optimizer step; advances the stream."""
        batches = [collate([self.dataset[i] for i in micro]) for micro in self.step_indices()]
        self.consumed_samples += self.global_batch
        return batches

    def __iter__(self) -> Iterator[list[Batch]]:
        return self

    def __next__(self) -> list[Batch]:
        return self.next_step()

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must store to resume the stream."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` output."""
        self.consumed_samples = int(state["consumed_samples"])
