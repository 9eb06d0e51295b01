"""A scaling study: a grid of points, each run on real processes, repeated, then summarized.

Per point and repeat the workload writes its metrics JSON; the warm-up steps are dropped
and the measured steps of every repeat pooled. ``points.jsonl`` in the output directory
holds one finished point per line (ok or failed, with its error), which is what
``--resume`` reads; results.csv, report.md and the plots are rebuilt from it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.pipeline.split import microbatch_rule
from studies.scaling.emulated_cluster import EmulatedCluster, unavailable_reason
from studies.scaling.launch import run_on_nodes
from studies.scaling.workloads import WORKLOADS, Point, RunSpec

PARTS = ("compute_s", "tp_comm_s", "dp_comm_exposed_s", "dp_comm_total_s", "data_s", "optimizer_s")
# A pipelined step's stage compute and its wait on the other stages (inside compute_s).
PIPELINE_PARTS = ("pp_compute_s", "pp_wait_s")


@dataclass(frozen=True)
class StudyConfig:
    """Everything the CLI chose."""

    workload: str
    spec: RunSpec
    tp: tuple[int, ...]
    dp: tuple[int, ...]
    nodes: tuple[int, ...]
    procs_per_node: int | None
    mode: str  # "strong": fixed global batch; "weak": fixed batch per DP rank
    global_batch: int
    micro_batch: int
    repeats: int
    link_mbit: int | None
    out: Path
    point_timeout_s: float = 600.0
    pp: tuple[int, ...] = (1,)
    schedules: tuple[str, ...] = ("1f1b",)  # pipeline schedules swept at pp > 1
    virtual_stages: int = 2  # stages per pipeline rank under interleaved_1f1b
    cp: tuple[int, ...] = (1,)  # context-parallel sizes


def grid(cfg: StudyConfig) -> tuple[list[Point], list[str]]:
    """The points of the study, and one line per combination that cannot be laid out (the
    ranks do not fill the nodes, or a schedule lacks micro-batches)."""
    points, skipped = [], []
    for nodes, tp, cp, pp, dp in itertools.product(cfg.nodes, cfg.tp, cfg.cp, cfg.pp, cfg.dp):
        world = tp * dp * pp * cp
        procs = cfg.procs_per_node or world // nodes
        name = (
            f"tp={tp} dp={dp}" + (f" cp={cp}" if cp > 1 else "") + (f" pp={pp}" if pp > 1 else "")
        )
        if cfg.procs_per_node and nodes * procs != world:
            skipped.append(f"{name} ({world} ranks) does not fill {nodes} node(s) × {procs} procs")
            continue
        if nodes * procs != world:
            skipped.append(
                f"{name} ({world} rank{'s' * (world > 1)}) does not split evenly over {nodes} nodes"
            )
            continue
        batch = cfg.global_batch * (dp if cfg.mode == "weak" else 1)
        for schedule in cfg.schedules if pp > 1 else ("1f1b",):
            virtual = cfg.virtual_stages if schedule == "interleaved_1f1b" else 1
            point = Point(nodes, procs, tp, dp, cfg.micro_batch, batch, pp, schedule, virtual, cp)
            rule = pp > 1 and microbatch_rule(schedule, pp, point.microbatches)
            if rule:
                skipped.append(f"{name} on {nodes} node(s): {rule}; raise --global-batch")
                continue
            points.append(point)
    return points, skipped


def refused_points(cfg: StudyConfig) -> tuple[dict[str, str], str | None]:
    """The points whose command would be refused, by key, each with why (the workload's
    own rules; for pretrain, the config checks ``engine.pretrain`` runs before its workers
    start), and why the study as a whole cannot run (no point fits its nodes, or every
    point is refused), else None. All found before any run."""
    if max(cfg.nodes) > 1 and unavailable_reason():  # run_study runs it on one node
        cfg = _single_node(cfg)
    points, skipped = grid(cfg)
    if not points:
        return {}, f"no point of the grid can run: {'; '.join(skipped)}"
    refused = {}
    for point in points:
        try:
            argv = WORKLOADS[cfg.workload](point, cfg.spec, Path("metrics.json"), Path("run"))
        except ValueError as err:
            refused[point.key] = str(err)
            continue
        problems = cfg.workload == "pretrain" and _config_problems(argv[2:], point.procs_per_node)
        if problems:
            refused[point.key] = "; ".join(problems)
    if len(refused) == len(points):
        why = "; ".join(f"{key}: {line}" for key, line in refused.items())
        return refused, f"no point of the grid can run: {why}"
    return refused, None


def _config_problems(overrides: list[str], local_ranks: int) -> list[str]:
    """What ``engine.pretrain`` would refuse in the config these overrides compose to: its
    layout and config rules, then whether ``local_ranks`` such ranks fit one node's memory
    (this machine's: every emulated node is this machine). The data is the run's to check."""
    from engine.config_cli import compose_run_config, rule_problems
    from engine.preflight import check_memory

    cfg = compose_run_config(overrides)
    problems = rule_problems(cfg)
    return problems or check_memory(cfg, local_ranks, on_gpu=torch.cuda.is_available())


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One point's figures from its runs' step records (warm-up steps of each run dropped)."""
    steps = [r for r in records if r["step"] > warmup]
    if not steps:
        raise ValueError("no measured steps (raise --steps)")
    times = sorted(r["step_time_s"] for r in steps)
    out = {
        "step_time_s": statistics.median(times),
        "step_time_p10_s": _quantile(times, 0.1),
        "step_time_p90_s": _quantile(times, 0.9),
        "tokens_per_s": _median(steps, "tokens_per_s"),
        "tflops_per_rank": _median(steps, "tflops_per_rank"),
        "peak_mem_gib": max(_present(steps, "peak_mem_gib"), default=None),
    }
    for part in (*PARTS, *PIPELINE_PARTS):  # means: the parts add up to the mean step
        values = [r[part] for r in steps if r.get(part) is not None]
        out[part] = sum(values) / len(values) if values else None
    compute, wait = out["pp_compute_s"], out["pp_wait_s"]  # stage 0's (rank 0 writes)
    out["pp_bubble"] = wait / compute if compute and wait is not None else None
    out["mean_step_time_s"] = sum(times) / len(times)
    return out


def _present(records: list[dict[str, Any]], key: str) -> list[float]:
    # A workload writes null for what it does not measure (classify: tokens, TP comm).
    return [r[key] for r in records if r.get(key) is not None]


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = _present(records, key)
    return statistics.median(values) if values else None


def summarize_runs(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """A point's run-level figures (classify: time to accuracy) from its repeats' summaries.

    Medians over the repeats; time to accuracy is None unless every repeat reached the target.
    """
    if not summaries:
        return {}
    times = [s.get("time_to_accuracy_s") for s in summaries]
    return {
        "time_to_accuracy_s": None if None in times else statistics.median(times),
        "test_accuracy": _median(summaries, "test_accuracy"),
        "images_per_s": _median(summaries, "images_per_s"),
        "epochs": _median(summaries, "epochs"),
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def load_finished(out: Path) -> dict[str, dict[str, Any]]:
    """Finished points of an earlier (interrupted) run of the study, by point key."""
    path = out / "points.jsonl"
    if not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash: that point runs again
            continue
        done[row["key"]] = row
    return done


def _append(out: Path, row: dict[str, Any]) -> None:
    with open(out / "points.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_point(cfg: StudyConfig, point: Point, use_cluster: bool, on_repeat) -> dict[str, Any]:
    """Run every repeat of ``point``; its summary row (status ok or failed, with the error)."""
    row: dict[str, Any] = {"key": point.key, **asdict(point), "world_size": point.world_size}
    row |= {"layout": point.layout, "microbatches": point.microbatches}
    point_dir = cfg.out / "runs" / point.key
    point_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    try:
        for repeat in range(cfg.repeats):
            run_dir = point_dir / f"repeat{repeat}"
            metrics = run_dir / "metrics.json"
            argv = WORKLOADS[cfg.workload](point, cfg.spec, metrics, run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = run_dir / "log.txt"
            if use_cluster:
                link = cfg.link_mbit if point.nodes > 1 else None
                cluster = EmulatedCluster(point.nodes, link)
                (run_dir / "cluster_tag").write_text(cluster.tag)  # for whoever checks clean-up
                with cluster:
                    rc = _run(argv, point, cluster, log, cfg.point_timeout_s)
            else:
                rc = _run(argv, point, None, log, cfg.point_timeout_s)
            if rc != 0 or not metrics.exists():
                raise RuntimeError(f"exit status {rc}: {_last_error(log)} (log: {log})")
            payload = json.loads(metrics.read_text())
            records += payload["steps"]
            if payload.get("summary"):
                summaries.append(payload["summary"])
            on_repeat()
        row |= {"status": "ok", **summarize(records, cfg.spec.warmup), **summarize_runs(summaries)}
    except (RuntimeError, ValueError, KeyError, json.JSONDecodeError) as err:
        row |= {"status": "failed", "error": str(err)}
    return row


def _run(argv, point: Point, cluster, log: Path, timeout_s: float) -> int:
    return run_on_nodes(
        argv,
        nodes=point.nodes,
        procs=point.procs_per_node,
        cluster=cluster,
        log_path=log,
        timeout_s=timeout_s,
        self_launching=True,
    )


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "error" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def run_study(
    cfg: StudyConfig, *, resume: bool, console: Console, refused: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run (or continue) the study; returns every point's row, in grid order. A point of
    ``refused`` (:func:`refused_points`) is recorded as failed with its reason, not run."""
    nodes_wanted = max(cfg.nodes) > 1
    reason = unavailable_reason()
    if reason and nodes_wanted:
        console.print(f"[yellow]{reason}[/yellow]")
        cfg = _single_node(cfg)
    points, skipped = grid(cfg)
    for line in skipped:
        console.print(f"[yellow]skipped:[/yellow] {line}")
    finished = load_finished(cfg.out) if resume else {}
    todo = [p for p in points if finished.get(p.key, {}).get("status") != "ok"]
    if len(todo) < len(points):
        console.print(f"resuming: {len(points) - len(todo)} of {len(points)} points already done")
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("study", total=len(todo) * cfg.repeats)
        for point in todo:
            progress.update(task, description=f"{point.key}")
            if point.key in (refused or {}):
                row = {"key": point.key, **asdict(point), "world_size": point.world_size}
                row |= {"status": "failed", "error": f"refused: {refused[point.key]}"}
                progress.advance(task, cfg.repeats)
            else:
                row = run_point(cfg, point, reason is None, lambda: progress.advance(task))
            if row["status"] != "ok":
                console.print(f"[red]point {point.key} failed:[/red] {row['error']}")
            finished[point.key] = row
            _append(cfg.out, row)
    return [finished[p.key] for p in points if p.key in finished]


def measure_links(cfg: StudyConfig, console: Console) -> dict[str, Any]:
    """Gloo all-reduce sweeps: between two emulated nodes (when the study has several) and
    between two ranks of one node; cached in links.json for ``--resume``."""
    path = cfg.out / "links.json"
    if path.exists():
        return json.loads(path.read_text())
    links: dict[str, Any] = {"configured_mbit": cfg.link_mbit}
    multi = max(cfg.nodes) > 1 and unavailable_reason() is None
    layouts = [("intra_node", 1, 2)] + ([("inter_node", 2, 1)] if multi else [])
    for name, nodes, procs in layouts:
        out = cfg.out / f"link_{name}.json"
        argv = ["-m", "studies.scaling.linkbench", "--out", str(out), "--repeats", "5"]
        log = cfg.out / f"link_{name}.log"
        cluster = EmulatedCluster(nodes, cfg.link_mbit if nodes > 1 else None) if multi else None
        if cluster is not None:
            (cfg.out / f"link_{name}.cluster_tag").write_text(cluster.tag)
        rc = _sweep(argv, nodes, procs, cluster, log)
        if rc == 0 and out.exists():
            links[name] = json.loads(out.read_text())["rows"]
        else:
            console.print(f"[yellow]link measurement {name} failed[/yellow] (log: {log})")
    path.write_text(json.dumps(links, indent=1))
    return links


def _sweep(argv: list[str], nodes: int, procs: int, net: EmulatedCluster | None, log: Path) -> int:
    """One link sweep on the emulated cluster ``net`` (or this host); its ranks start without
    torchrun's agents, as the sweep needs only ``env://``."""
    with net or contextlib.nullcontext():
        return run_on_nodes(
            argv, nodes=nodes, procs=procs, cluster=net, log_path=log, timeout_s=300, direct=True
        )


def _single_node(cfg: StudyConfig) -> StudyConfig:
    from dataclasses import replace

    return replace(cfg, nodes=(1,), procs_per_node=None)
