"""Step time of each pipeline schedule at pp 2 or 4, side by side in one run.

``--pp`` local ranks (gloo, CPU; 2 by default) hold the stages of one GPT; every schedule
gets its own cut of the same model and runs the same micro-batches. The schedules take
turns step by step (round-robin), so a change in the machine's load moves them alike; the
first steps (shape inference, allocation) are dropped and the median of the rest is
reported with rank 0's stage compute, its wait on the other stages
(``PipelineRunner.timings``) and the planner's bubble formula at equal forward, input- and
weight-gradient times.

    python tools/bench_pipeline.py --steps 10 --microbatches 8
    python tools/bench_pipeline.py --pp 4 --microbatches 8

At ``--pp 4`` the V schedules and interleaved 1F1B cut the layers into 8 stages and
DualPipeV needs at least 2·pp micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from engine.tool_args import ArgumentParser, add_model_size_flags, non_negative_int, positive_int

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}  # stages per rank; else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="bench_pipeline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=positive_int, default=2, help="pipeline stages = local ranks")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per schedule")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps per schedule")
    p.add_argument("--microbatches", type=positive_int, default=8)
    p.add_argument("--micro-batch", type=positive_int, default=4)
    add_model_size_flags(p, layers=8, hidden=256, heads=8, vocab=1024, seq=128)
    args = p.parse_args(argv)
    unknown = [s for s in args.schedules.split(",") if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules {unknown[0]!r} is not one of {', '.join(SCHEDULES)}")
    if args.pp < 2:
        p.error(f"--pp {args.pp} has no pipeline to time: give --pp 2 or more")
    for schedule in args.schedules.split(","):  # the runtime's rules, before a rank starts
        try:
            _spec(args, schedule).check()
        except ValueError as err:
            p.error(f"--schedules {schedule}: {err}")
    return args


def _spec(args, schedule: str = "1f1b"):
    """The model and the pp layout of ``schedule`` (the verifier's spec: its tiny GPT at
    these sizes, a step of ``--microbatches`` micro-batches)."""
    from studies.verification.layouts import VerifySpec, model_sizes

    return VerifySpec(
        pp_size=args.pp,
        schedule=schedule,
        virtual_stages=VIRTUAL.get(schedule, 1),
        microbatches=args.microbatches,
        batch_size=args.microbatches * args.micro_batch,
        **model_sizes(args),
    )


def _runner(args, schedule: str, ps):
    from engine.models import build_model
    from engine.pipeline import PipelineModel, PipelineRunner

    spec = _spec(args)
    ps.seed(1234)
    model = build_model(spec.model_config(), ps, dtype=torch.float32)
    stages = PipelineModel(
        model,
        pp_rank=ps.pp_rank,
        pp_size=args.pp,
        pp_group=ps.pp_group,
        virtual=VIRTUAL.get(schedule, 1),
        schedule=schedule,
    )
    return PipelineRunner(
        stages, schedule=schedule, microbatches=args.microbatches, ps=ps, timed=True
    )


def _rank(args) -> dict | None:
    from engine.bootstrap import bootstrap_rank

    schedules = args.schedules.split(",")
    with bootstrap_rank(_spec(args).dims, backend="gloo") as ps:
        runners = {s: _runner(args, s, ps) for s in schedules}
        g = torch.Generator().manual_seed(7)
        micro = [
            {"input_ids": ids, "labels": torch.randint(args.vocab, ids.shape, generator=g)}
            for ids in torch.randint(
                args.vocab, (args.microbatches, args.micro_batch, args.seq), generator=g
            )
        ]
        times: dict[str, list] = {s: [] for s in schedules}
        for step in range(args.warmup + args.steps):
            for s, runner in runners.items():
                runner.train(micro)
                runner.model.zero_grad(set_to_none=True)
                if step >= args.warmup:
                    times[s].append((runner.wall_s, runner.compute_s))
        return times if ps.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    from studies.perfmodel.pipeline import bubble_fraction
    from studies.verification.layouts import launch_local

    args = parse_args(argv)
    times = launch_local(_rank, args.pp, args)
    m = args.microbatches
    base = statistics.median(w for w, _ in times["1f1b"]) if "1f1b" in times else None
    print(f"pp {args.pp}, {m} micro-batches of {args.micro_batch}×{args.seq}, {args.layers} layers")
    print("schedule          step s  ÷1f1b  compute s  wait/compute  formula")
    for s, rows in times.items():
        wall = statistics.median(w for w, _ in rows)
        compute = statistics.median(c for _, c in rows)
        ratio = f"{wall / base:5.2f}" if base else "    -"
        formula = bubble_fraction(args.pp, m, s, VIRTUAL.get(s, 1))
        print(
            f"{s:16s} {wall:7.3f}  {ratio}  {compute:9.3f}  "
            f"{(wall - compute) / compute:12.3f}  {formula:7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
