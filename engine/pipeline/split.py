"""Which transformer layers each pipeline stage holds, which stages each pipeline rank
holds, and what each schedule needs of the stages per rank and the micro-batches
(torch-free: the config checks it before any worker starts)."""

from __future__ import annotations

import itertools

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# Schedules that place two stages per rank in a V: rank r holds stages r and 2·pp − 1 − r,
# so the first and the last stage share rank 0 and the turn of the V stays on rank pp − 1.
V_SCHEDULES = ("zbv", "dualpipev")
# Schedules that split each backward into the input gradient and a later weight gradient.
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")


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


def stages_of_rank(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank ``rank`` holds, in stage order: ``rank, rank + pp,
    …`` (the loop placement of the interleaved schedules), or for the V schedules ``rank``
    and ``2·pp − 1 − rank``."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(virtual)]


def virtual_rule(schedule: str, virtual: int) -> str | None:
    """What ``schedule`` needs of the stages per rank (``virtual``) and ``virtual`` lacks,
    else None: interleaved 1F1B two or more, the V schedules exactly two, interleaved zero
    bubble any number (one is the paper's ZB-H1), GPipe and 1F1B one."""
    if schedule == "interleaved_1f1b":
        ok, rule = virtual >= 2, ">= 2 for interleaved_1f1b"
    elif schedule in V_SCHEDULES:
        ok, rule = virtual == 2, f"2 for {schedule} (its V: stages r and 2·pp−1−r on rank r)"
    elif schedule == "zero_bubble":
        ok, rule = virtual >= 1, ">= 1 for zero_bubble"
    else:
        ok, rule = virtual == 1, f"1 for {schedule}"
    return None if ok else f"virtual_stages={virtual} must be {rule}"


def microbatch_rule(schedule: str, pp: int, microbatches: int) -> str | None:
    """What ``schedule`` at ``pp`` stages needs of the micro-batches per step and
    ``microbatches`` lacks (torch's rules, kept whole-number simple), else None: every
    schedule but GPipe at least ``pp``, DualPipeV at least 2·pp (one per stage), the
    interleaved ones a multiple of ``pp``."""
    least = 2 * pp if schedule == "dualpipev" else pp
    if schedule != "gpipe" and microbatches < least:
        what = f"2 × pp_size={pp} = {least}" if schedule == "dualpipev" else f"pp_size={pp}"
        return (
            f"schedule={schedule} needs at least {what} micro-batches per step, got {microbatches}"
        )
    if schedule in ("interleaved_1f1b", "zero_bubble") and microbatches % pp:
        return (
            f"schedule={schedule} needs micro-batches per step ({microbatches}) "
            f"divisible by pp_size={pp}"
        )
    return None


def dp_rule(schedule: str, dp_shard: str, tied: bool) -> str | None:
    """What ``schedule`` does not run with under ``parallel.dp_shard=dp_shard`` (``tied``:
    the model ties its head to the word embedding), one line, else None.

    - ZeRO-3 (``full``) reshards each layer after its forward and gathers it again in the
      backward's hook; the weight-gradient pass runs later, outside any hook, when the
      layer holds its shards again (its gradients came out wrong, O(1)). ``gradients``
      keeps the stage gathered for the step, as the pipelined ``full`` would have to.
    - Under a V, rank 0's first and last stage both hold the tied word embedding: FSDP
      would shard the one tensor twice.
    """
    if schedule in SPLIT_BACKWARD and dp_shard == "full":
        return (
            f"schedule={schedule} under parallel.dp_shard=full is not built yet (the "
            "weight-gradient pass runs after FSDP has resharded the layer): set "
            "parallel.dp_shard=gradients"
        )
    if schedule in V_SCHEDULES and tied and dp_shard == "gradients":
        return (
            f"schedule={schedule} with tied embeddings under parallel.dp_shard=gradients is not "
            "built yet (rank 0's first and last stage share the word embedding, FSDP would "
            "shard it twice): set model.tie_embeddings=false"
        )
    return None


def compile_rule(
    schedule: str,
    compiled: bool,
    *,
    cuda_graphs: bool = False,
    off: str = "set model.compile=false",
) -> str | None:
    """What a compiled stage (``model.compile``: each stage's forward one graph, and its
    backward one compiled function) does not run with, one line naming ``off`` (how the
    caller turns compilation off), else None.

    - The zero-bubble schedules split each backward into the input-gradient pass and a
      later weight-gradient pass (``SPLIT_BACKWARD``); a compiled backward computes both
      at once and frees its buffers (AOTAutograd's donated buffers refuse the retained
      graph the split needs).
    - CUDA graphs replay each forward into the same output buffers, so a stage's later
      micro-batch would overwrite the activations an earlier one still waits to
      backward with.
    """
    if compiled and schedule in SPLIT_BACKWARD:
        return (
            f"schedule={schedule} splits each backward into input and weight passes, which a "
            f"compiled stage runs as one: set pipeline.schedule=1f1b (or interleaved_1f1b), or {off}"
        )
    if cuda_graphs:
        return (
            "model.cuda_graphs=true replays each forward into one set of buffers, which a "
            "pipeline's micro-batches in flight would share: set model.cuda_graphs=false"
        )
    return None
