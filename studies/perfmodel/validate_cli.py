"""``tools/validate_perfmodel.py``: measured (or published) vs predicted, as markdown tables."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from engine.data.fsutil import file_problem
from engine.tool_args import ArgumentParser
from studies.perfmodel import published
from studies.perfmodel.cluster_spec import load_cluster
from studies.perfmodel.model import Layout, Workload
from studies.perfmodel.validate import (
    Point,
    breakdown_table,
    compare,
    error_summary,
    markdown_table,
    measure_with_probe,
    read_scaling_results,
)

TINY = Workload(
    hidden=128, layers=2, heads=4, vocab=8192, seq=128, global_batch=16, precision="fp32"
)
WIDER = replace(TINY, hidden=256, layers=4)
# The trainer's CPU path: attention dropout 0.1 runs SDPA's math kernel (s×s scores
# stored); ZeRO-1 reduce-scatters after backward (no overlap). One thread per rank
# (OMP_NUM_THREADS=1): on a shared machine a 2-thread OpenMP region stalls whenever one of
# its threads is descheduled, which no hardware model predicts.
_CPU = dict(fused_attention=False, threads=1)
MACHINE_POINTS = (
    Point("tiny tp1 dp1 mb4", TINY, Layout(1, 1, 4, **_CPU)),
    Point("tiny tp1 dp1 mb16", TINY, Layout(1, 1, 16, **_CPU)),
    Point("tiny tp2 dp1 mb4", TINY, Layout(2, 1, 4, **_CPU)),
    Point("tiny tp1 dp2 mb4", TINY, Layout(1, 2, 4, **_CPU)),
    Point("tiny tp2 dp2 mb4", TINY, Layout(2, 2, 4, **_CPU)),
    Point("tiny tp4 dp1 mb4", TINY, Layout(4, 1, 4, **_CPU)),
    Point("tiny tp1 dp4 mb4", TINY, Layout(1, 4, 4, **_CPU)),
    Point(
        "tiny tp1 dp2 mb4 zero1",
        TINY,
        Layout(1, 2, 4, dp_shard="optimizer", overlap_grad_reduce=False, **_CPU),
    ),
    Point("tiny tp2 dp1 mb4 sp", TINY, Layout(2, 1, 4, sequence_parallel=True, **_CPU)),
    Point("wider tp1 dp1 mb4", WIDER, Layout(1, 1, 4, **_CPU)),
    Point("wider tp2 dp1 mb4", WIDER, Layout(2, 1, 4, **_CPU)),
    Point("wider tp1 dp2 mb4", WIDER, Layout(1, 2, 4, **_CPU)),
    Point("tiny tp1 dp1 mb4, 2 threads", TINY, Layout(1, 1, 4, fused_attention=False)),
)


def point_indices(text: str) -> list[int]:
    """argparse type of ``--points``: ``all``, or a comma list of indices of MACHINE_POINTS."""
    count = len(MACHINE_POINTS)
    if text == "all":
        return list(range(count))
    indices = []
    for item in text.split(","):
        try:
            index = int(item)
        except ValueError:
            index = None
        if index is None or not 0 <= index < count:
            raise argparse.ArgumentTypeError(
                f"{item[:40]!r} is not a point index: give a comma list of 0..{count - 1} "
                f"(the {count} machine points), or all"
            )
        indices.append(index)
    return indices


def build_parser() -> argparse.ArgumentParser:
    """The command line of tools/validate_perfmodel.py."""
    p = ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("machine", help="run engine.pretrain here and compare")
    m.add_argument("--cluster", required=True, help="the calibrated spec of this machine")
    m.add_argument(
        "--points",
        type=point_indices,
        default="all",
        help=f"comma list of point indices (0..{len(MACHINE_POINTS) - 1}), or all",
    )
    m.add_argument("--steps", type=int, default=16, help="steps per run (log every 4)")
    m.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every point this many times, round by round (median)",
    )
    m.add_argument("--save", help="also write the measurements to this JSON file")
    m.add_argument(
        "--reuse",
        help="price the measurements saved by --save instead of measuring "
        "(a comma list of files: the median of each point over them)",
    )
    s = sub.add_parser("scaling", help="compare with a scaling-study results.csv")
    s.add_argument("--csv", required=True)
    s.add_argument("--cluster", required=True, help="the study's cluster spec (its links)")
    s.add_argument("--compute-from", help="spec whose device figures fill the study's (cpu_2core)")
    s.add_argument(
        "--no-overlap",
        action="store_true",
        help="the study ran with trainer.overlap_grad_reduce=false",
    )
    for flag, default in (
        ("hidden", 128),
        ("layers", 2),
        ("heads", 4),
        ("vocab", 8192),
        ("seq", 128),
    ):
        s.add_argument(f"--{flag}", type=int, default=default)
    sub.add_parser("published", help="published Megatron-LM rows vs predictions")
    d = sub.add_parser("dp-plots", help="write the parameter-server and async-DP plots")
    d.add_argument("--out", default="docs", help="directory for the PNGs")
    return p


def median_points(rounds: list) -> list[Point]:
    """The machine points measured in every one of ``rounds`` (lists of saved rows, or
    lists of such lists), each with the median step time, probe and parts over them."""
    flat = [r for rnd in rounds for r in (rnd if isinstance(rnd[0], list) else [rnd])]
    points = []
    for p in MACHINE_POINTS:
        rows = [next((x for x in rnd if x["label"] == p.label), None) for rnd in flat]
        if not rows or None in rows:
            continue
        parts = {k: statistics.median(r["parts"][k] for r in rows) for k in rows[0]["parts"] or {}}
        points.append(
            replace(
                p,
                measured_s=statistics.median(r["measured_s"] for r in rows),
                probe_gflops=statistics.median(r["probe_gflops"] for r in rows),
                parts=parts or None,
            )
        )
    return points


def _saved_rounds(path: str):
    """One ``--save`` file, or a one-line ValueError naming it and what it should be."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--reuse {path}: no such file (give files --save wrote)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--reuse {path}: not a JSON file --save wrote ({err})") from None


def _machine(args: argparse.Namespace) -> list:
    cluster = load_cluster(args.cluster)
    chosen = args.points
    if args.reuse:  # re-price earlier measurements (e.g. after a model change)
        rounds = [_saved_rounds(f) for f in args.reuse.split(",")]
        try:
            points = median_points(rounds)
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            raise ValueError(f"--reuse {args.reuse}: not what --save writes ({err!r})") from err
        if not points:  # labels of no machine point (or of none measured in every file)
            raise ValueError(
                f"--reuse {args.reuse}: no machine point is measured in every file; give what "
                "--save wrote"
            )
        return compare(points, cluster)
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds}: give 1 or more")
    rounds = []
    for r in range(args.rounds):  # round by round: a slow spell of the machine hits all points
        measured = []
        for i in chosen:
            point = measure_with_probe(MACHINE_POINTS[i], steps=args.steps)
            print(
                f"round {r + 1}/{args.rounds}: measured {point.label}: {point.measured_s:.4f} "
                f"s/step, probe {point.probe_gflops:.1f} GFLOP/s (load "
                f"{os.getloadavg()[0]:.2f})",
                file=sys.stderr,
            )
            measured.append(point)
        rounds.append(
            [
                {
                    "label": p.label,
                    "measured_s": p.measured_s,
                    "probe_gflops": p.probe_gflops,
                    "parts": p.parts,
                }
                for p in measured
            ]
        )
    measured = median_points(rounds)
    if args.save:  # one round: a list of points; several: a list of rounds
        tmp = f"{args.save}.tmp{os.getpid()}"
        Path(tmp).write_text(json.dumps(rounds[0] if len(rounds) == 1 else rounds, indent=1))
        os.replace(tmp, args.save)
    return compare(measured, cluster)


def main(argv: list[str] | None = None) -> int:
    """Entry point: prints a markdown table and the max / median |error|."""
    args = build_parser().parse_args(argv)
    problem = file_problem(args.csv) if args.command == "scaling" else None
    if problem:  # said as such, not as a bare [Errno 2]
        print(
            f"validate: --csv {args.csv} {problem}; give the results.csv of a scaling study "
            "(tools/scaling_study.py --out DIR writes DIR/results.csv)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "dp-plots":
            from studies.perfmodel.dp_analysis import write_plots

            print("\n".join(write_plots(args.out)))
            return 0
        if args.command == "published":
            results = published.evaluate_all()
            print(published.markdown_table(results))
            worst, median, agree = published.summary(results)
            print(
                f"\nmax |error| {100 * worst:.1f}%, median {100 * median:.1f}% (rows not fitted to), "
                f"planner's TP = published TP in {agree}/{len(results)} rows"
            )
            piped = published.evaluate_all(published.PIPELINE_ROWS)
            print("\n" + published.markdown_table(piped))
            worst, median, _ = published.summary(piped)
            within = sum(abs(r.error) <= 0.15 for r in piped)
            print(
                f"\npipeline rows: max |error| {100 * worst:.1f}%, median {100 * median:.1f}%, "
                f"{within}/{len(piped)} within 15%"
            )
            cp_rows = [published.evaluate_cp(r) for r in published.CP_ROWS]
            print(f"\ncontext parallelism ({published.LLAMA3_CITATION}):")
            print(published.cp_markdown_table(cp_rows))
            moe_rows = [published.evaluate_moe(r) for r in published.MOE_ROWS]
            print(f"\nmixture of experts ({published.MOE_CITATION}):")
            print(published.moe_markdown_table(moe_rows))
            return 0
        if args.command == "machine":
            rows = _machine(args)
            cluster = load_cluster(args.cluster)
        else:
            base = Workload(
                args.hidden, args.layers, args.heads, args.vocab, args.seq, 1, precision="fp32"
            )
            cluster = load_cluster(args.cluster, base=args.compute_from)
            rows = compare(read_scaling_results(args.csv, base, not args.no_overlap), cluster)
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (ValueError, RuntimeError, OSError) as err:
        print(f"validate: {err}", file=sys.stderr)
        return 2
    print(markdown_table(rows))
    if any(r.point.parts for r in rows):
        print("\nWhere the time goes, s/step (the trainer's metrics_file against the model):\n")
        print(breakdown_table(rows, cluster))
    worst, median = error_summary(rows)
    print(
        f"\nmax |error| {100 * worst:.1f}%, median {100 * median:.1f}% over {len(rows)} points; "
        "load average (1/5/15 min) " + "/".join(f"{v:.2f}" for v in os.getloadavg())
    )
    one = [r for r in rows if r.point.layout.threads == 1]
    if args.command == "machine" and one:
        within = sum(abs(r.error) <= 0.10 for r in one)
        print(f"within ±10 %: {within} of {len(one)} one-thread points")
    if all(r.share_scale for r in rows):
        worst, median = error_summary(rows, scaled=True)
        print(
            f"rescaled by the machine share: max |error| {100 * worst:.1f}%, "
            f"median {100 * median:.1f}%"
        )
    return 0
