"""Which transformer layers each pipeline stage holds (torch-free: the config checks it
before any worker starts)."""

from __future__ import annotations

import itertools


def layer_split(
    num_layers: int, stages: int, layers_per_stage: list[int] | None = None
) -> list[range]:
    """The layer indices of each of ``stages`` stages: equal runs, or ``layers_per_stage``.

    Raises ValueError (one line) when the layers do not divide or the list does not fit.
    """
    if layers_per_stage:
        counts = list(layers_per_stage)
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"pipeline.layers_per_stage={counts} must have {stages} entries (pp_size × "
                f"pipeline.virtual_stages), each >= 1, summing to model.num_layers={num_layers}"
            )
    elif num_layers % stages:
        raise ValueError(
            f"model.num_layers={num_layers} is not divisible by the {stages} pipeline stages "
            "(pp_size × pipeline.virtual_stages); change one, or give pipeline.layers_per_stage"
        )
    else:
        counts = [num_layers // stages] * stages
    starts = itertools.accumulate(counts, initial=0)
    return [range(start, start + n) for start, n in zip(starts, counts, strict=False)]


def microbatch_rule(schedule: str, pp: int, microbatches: int) -> str | None:
    """What ``schedule`` at ``pp`` stages needs of the micro-batches per step and
    ``microbatches`` lacks (torch's rules for 1F1B and interleaved 1F1B), else None."""
    if schedule != "gpipe" and microbatches < pp:
        return (
            f"schedule={schedule} needs at least pp_size={pp} micro-batches per step, "
            f"got {microbatches}"
        )
    if schedule == "interleaved_1f1b" and microbatches % pp:
        return (
            f"schedule=interleaved_1f1b needs micro-batches per step ({microbatches}) "
            f"divisible by pp_size={pp}"
        )
    return None
