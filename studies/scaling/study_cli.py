"""Command line of ``tools/scaling_study.py``: parse, validate, run the study, report."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path

from rich.console import Console

from engine.tool_args import ArgumentParser, in_flags
from studies.scaling.report import add_speedup, plot, write_csv, write_report
from studies.scaling.study import StudyConfig, measure_links, refused_points, run_study
from studies.scaling.workloads import WORKLOADS, RunSpec, grid_key_problem

CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "cluster"

EPILOG = """\
example (DP 1→2→4 on one node and on two emulated nodes at 1 Gbit/s):
  python tools/scaling_study.py --model gpt_tiny --tp 1 --dp 1,2,4 --nodes 1,2 \\
      --cluster emulated_1gbit --global-batch 16 --micro-batch 4 --steps 5 --out study/
example (one rank per emulated node: pp across 2 and 4 nodes against dp across them):
  python tools/scaling_study.py --model gpt_tiny --dp 1,2,4 --pp 1,2,4 --nodes 1,2,4 \\
      --procs-per-node 1 --cluster emulated_1gbit --out pp_study/ model.num_layers=4

Outputs in --out: results.csv, report.md, speedup.png, efficiency.png, time_shares.png,
bubble.png (points with pp > 1: measured bubble against (p-1)/m and (p-1)/(v*m)),
points.jsonl (finished points; --resume skips those that succeeded) and runs/ (logs).
--nodes > 1 needs root and `ip netns` (namespaces + tc tbf); without them every point
runs on one node.
"""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of integers, e.g. 1,2,4"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _schedules(text: str) -> tuple[str, ...]:
    from engine.config import PIPELINE_SCHEDULES

    values = tuple(text.split(","))
    bad = [v for v in values if v not in PIPELINE_SCHEDULES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{bad[0]!r} is not a schedule: one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    return values


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="scaling_study.py",
        epilog=EPILOG,
        formatter_class=argparse.RawTextHelpFormatter,
        description="Run a grid of training points (tp × dp × cp × pp × nodes) on real processes and "
        "report speedup, efficiency and where each step's time goes.",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides passed to every point")
    p.add_argument("--workload", default="pretrain", choices=sorted(WORKLOADS))
    p.add_argument("--model", help="configs/model preset (default: the workload's)")
    p.add_argument("--tp", type=_ints, default=(1,), help="tp sizes, e.g. 1,2")
    p.add_argument("--dp", type=_ints, default=(1, 2), help="dp sizes, e.g. 1,2,4")
    p.add_argument("--pp", type=_ints, default=(1,), help="pipeline stages, e.g. 1,2,4")
    p.add_argument(
        "--cp", type=_ints, default=(1,), help="context-parallel sizes (ring attention), e.g. 1,2"
    )
    p.add_argument(
        "--schedule",
        type=_schedules,
        default=("1f1b",),
        help="pipeline schedules at pp > 1, e.g. 1f1b,interleaved_1f1b",
    )
    p.add_argument(
        "--virtual-stages", type=int, default=2, help="stages per rank under interleaved_1f1b"
    )
    p.add_argument("--nodes", type=_ints, default=(1,), help="node counts, e.g. 1,2")
    p.add_argument("--procs-per-node", type=int, help="ranks per node (default: ranks ÷ nodes)")
    p.add_argument("--cluster", help="configs/cluster entry shaping the emulated links")
    p.add_argument(
        "--mode",
        choices=("strong", "weak"),
        default="strong",
        help="strong: fixed global batch; weak: --global-batch per DP rank",
    )
    p.add_argument(
        "--global-batch", type=int, default=16, help="sequences per step (weak: per DP rank)"
    )
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward")
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps run first, not measured")
    p.add_argument("--repeats", type=int, default=1, help="runs per point (pooled)")
    p.add_argument("--out", type=Path, default=Path("scaling_study"), help="output directory")
    p.add_argument(
        "--resume", action="store_true", help="continue the study in --out (re-runs failed points)"
    )
    p.add_argument("--no-links", action="store_true", help="skip the link bandwidth sweep")
    p.add_argument("--point-timeout", type=float, default=600.0, help="seconds per run")
    return p


def _link_mbit(name: str | None) -> int | None:
    if name is None:
        return None
    from omegaconf import OmegaConf

    path = Path(name) if name.endswith(".yaml") else CLUSTERS / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(f.stem for f in CLUSTERS.glob("*.yaml")))
        _fail(f"--cluster {name}: no {path} (known: {known})")
    try:
        spec = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # noqa: BLE001 - YAML's and OmegaConf's parse errors alike
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _fail(f"--cluster {name}: {path} is not a readable YAML file ({first})")
    emulation = spec.get("emulation") if isinstance(spec, dict) else None
    mbit = emulation.get("link_mbit") if isinstance(emulation, dict) else None
    if mbit is None:
        _fail(f"--cluster {name}: {path} has no emulation.link_mbit (not an emulated cluster)")
    if isinstance(mbit, bool) or not isinstance(mbit, int) or mbit < 1:
        _fail(f"--cluster {name}: emulation.link_mbit={mbit!r} in {path} is not a positive integer")
    return mbit


def _fail(message: str) -> None:
    print(f"scaling_study: {message}", file=sys.stderr)
    raise SystemExit(2)


def config_from(args: argparse.Namespace) -> StudyConfig:
    """The study the arguments ask for; one-line errors (exit 2) for what cannot run."""
    for name in ("global_batch", "micro_batch", "steps", "repeats"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        _fail(f"--warmup={args.warmup} must be >= 0")
    if args.virtual_stages < 2:
        _fail(f"--virtual-stages={args.virtual_stages} must be >= 2 (interleaved_1f1b)")
    if max(args.pp) > 1 and args.workload != "pretrain":
        _fail(f"--pp {max(args.pp)}: the {args.workload} workload has no pipeline; use --pp 1")
    if (args.out / "points.jsonl").exists() and not args.resume:
        _fail(f"--out {args.out} holds a study already: add --resume, or choose another --out")
    if args.resume and not args.out.is_dir():  # a mistyped --out would start afresh
        _fail(
            f"--resume: {args.out} does not exist (no study to continue); fix --out or drop --resume"
        )
    problem = _unwritable(args.out)
    if problem:  # known now, not after the first point's minutes
        _fail(f"--out {args.out} cannot be written: {problem}")
    problem = grid_key_problem(args.workload, args.overrides) or _overrides_problem(
        args.workload, args.model, args.overrides
    )
    if problem:  # the same for every point: refused before the first one starts
        _fail(problem)
    spec = RunSpec(args.model, tuple(args.overrides), args.steps, args.warmup)
    return StudyConfig(
        workload=args.workload,
        spec=spec,
        tp=args.tp,
        dp=args.dp,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        mode=args.mode,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        repeats=args.repeats,
        link_mbit=_link_mbit(args.cluster),
        out=args.out,
        point_timeout_s=args.point_timeout,
        pp=args.pp,
        schedules=args.schedule,
        virtual_stages=args.virtual_stages,
        cp=args.cp,
    )


def _overrides_problem(workload: str, model: str | None, overrides: list[str]) -> str | None:
    """One line for overrides no point could run with: a key the workload's config lacks,
    or (pretrain) a value Hydra cannot compose; None when they compose."""
    from engine.config_cli import hydra_error_line, unknown_key

    if workload == "classify":
        from apps.classify_config import ClassifyConfig

        return unknown_key(overrides, ClassifyConfig, "apps.classify")
    chosen = [f"model={model}"] if model else []
    problem = unknown_key([*chosen, *overrides])  # a mistyped --model is named as such
    if problem and model:
        problem = problem.replace(f"model={model} ", f"--model {model} ", 1)
        return problem.replace("did you mean model=", "did you mean --model ")
    if problem:
        return problem
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from engine.config import register_configs
    from engine.config_cli import CONFIGS

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            OmegaConf.to_object(compose("config", overrides=[*chosen, *overrides]))
    except (HydraException, OmegaConfBaseException) as err:
        return hydra_error_line(err)
    return None


def _unwritable(out: Path) -> str | None:
    from engine.preflight import probe_writable  # torch-heavy: only when a study starts

    return probe_writable(out, directory=True)


def _load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad argument is one line and exit status 2."""
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from(args)
    # Before the link sweep and the first point's minutes: what cannot run, in the study's
    # own flags. Refused points are reported as failed; the others run.
    refused, fatal = refused_points(cfg)
    flags = parser()._option_string_actions
    if fatal:
        print(f"scaling_study: {in_flags(fatal, flags)}", file=sys.stderr)
        return 2
    refused = {key: in_flags(line, flags) for key, line in refused.items()}
    for key, line in refused.items():
        print(f"scaling_study: point {key} cannot run, so it is not run: {line}", file=sys.stderr)
    cfg.out.mkdir(parents=True, exist_ok=True)
    console = Console(highlight=False, soft_wrap=True)
    # SIGTERM unwinds like Ctrl-C, so the emulated nodes are torn down on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    load = _load()
    try:
        links = {} if args.no_links else measure_links(cfg, console)
        rows = run_study(cfg, resume=args.resume, console=console, refused=refused)
    except KeyboardInterrupt:
        console.print("interrupted: finished points are in points.jsonl; rerun with --resume")
        return 130
    ok = add_speedup(rows, cfg.mode)
    failed = [r for r in rows if r.get("status") != "ok"]
    write_csv(ok, cfg.out / "results.csv")
    if ok:
        plot(ok, cfg.out, title=f"{cfg.spec.model or cfg.workload}, {cfg.mode} scaling")
    load = f"{load} at the start, {_load()} at the end"
    command = shlex.join(["python", "tools/scaling_study.py", *(argv or sys.argv[1:])])
    report = write_report(
        ok, failed, out=cfg.out, links=links, command=command, load=load, mode=cfg.mode
    )
    console.print(f"{len(ok)} point(s) measured, {len(failed)} failed: {report}")
    return 0 if ok and not failed else 1
