"""Validate the model against step times measured on this machine.

Two sources of measurements:

- ``measure_pretrain``: runs ``python -m engine.pretrain`` at one layout and reads the step
  time from its console lines (tokens per step ÷ tok/s of each logging window, the first
  window dropped as warmup);
- ``read_scaling_results``: the ``results.csv`` of ``tools/scaling_study.py`` (columns
  tp_size, dp_size, micro_batch, global_batch, step_time_s, nodes, ...).

``compare`` prices each point with the performance model and returns the relative errors.
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from studies.perfmodel.cluster_spec import ClusterSpec
from studies.perfmodel.model import Layout, Workload, predict
from studies.perfmodel.probes import probe_gflops
from studies.runs import STEPS_ONLY

ROOT = Path(__file__).resolve().parents[2]
_TOKS = re.compile(r"step\s+(\d+)/\d+\s.*?\s([\d.]+) tok/s")


@dataclass(frozen=True)
class Point:
    """One measured layout: the workload, the layout and the measured step time."""

    label: str
    workload: Workload
    layout: Layout
    measured_s: float | None = None
    overrides: tuple[str, ...] = ()
    probe_gflops: float | None = None  # the machine share around the run (calibrate.probe_gflops)
    parts: dict[str, float] | None = None  # measured mean seconds per step of each part
    ranks_per_node: int | None = None  # emulated nodes of a scaling study: ranks on each


# The trainer's per-step breakdown (trainer.metrics_file) next to the model's.
PARTS = ("compute_s", "tp_comm_s", "dp_comm_exposed_s", "optimizer_s", "data_s")


def pretrain_overrides(w: Workload, lay: Layout, steps: int, log_every: int) -> list[str]:
    """Hydra overrides that make engine.pretrain run exactly this point, writing nothing."""
    return [
        f"tp_size={lay.tp}",
        f"dp_size={lay.dp}",
        f"model.hidden_size={w.hidden}",
        f"model.num_layers={w.layers}",
        f"model.num_heads={w.heads}",
        f"model.sequence_parallel={str(lay.sequence_parallel).lower()}",
        f"model.recompute={lay.recompute}",
        f"data.seq_len={w.seq}",
        f"trainer.global_batch={w.global_batch}",
        f"trainer.micro_batch={lay.micro_batch}",
        f"parallel.dp_shard={lay.dp_shard}",
        f"pp_size={lay.pp}",
        f"trainer.max_steps={steps}",
        f"trainer.overlap_grad_reduce={str(lay.overlap_grad_reduce).lower()}",
        f"trainer.log_every={log_every}",
        *STEPS_ONLY,
        "checkpoint.resume=false",
    ]


def parse_step_times(console: str, tokens_per_step: int) -> list[float]:
    """Seconds per step of each logging window after the first (warmup)."""
    rates = [float(m.group(2)) for m in _TOKS.finditer(console)]
    return [tokens_per_step / r for r in rates[1:]]


def measure_pretrain(
    point: Point, steps: int = 16, log_every: int = 4, timeout: int = 600
) -> float:
    """Median step time of engine.pretrain at ``point`` (seconds); raises on a failed run."""
    return run_pretrain(point, steps, log_every, timeout)[0]


def run_pretrain(
    point: Point, steps: int, log_every: int, timeout: int
) -> tuple[float, dict[str, float]]:
    """(median step time, mean seconds per step of each part) after the first window."""
    w, lay = point.workload, point.layout
    with tempfile.TemporaryDirectory() as tmp:
        args = pretrain_overrides(w, lay, steps, log_every) + list(point.overrides)
        args += [
            f"checkpoint.dir={tmp}/ckpt",
            f"hydra.run.dir={tmp}/run",
            f"trainer.metrics_file={tmp}/metrics.json",
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if lay.threads:  # the trainer keeps an explicit OMP_NUM_THREADS
            env["OMP_NUM_THREADS"] = str(lay.threads)
        out = subprocess.run(
            [sys.executable, "-m", "engine.pretrain", *args],
            cwd=tmp,  # whatever the run writes beside it stays in the temporary folder
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        times = parse_step_times(out.stdout, w.global_batch * w.seq)
        if out.returncode != 0 or not times:
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{point.label}: engine.pretrain failed: {tail[0]}")
        parts = read_parts(Path(tmp) / "metrics.json", skip=log_every)
    return statistics.median(times), parts


def read_parts(path: Path, skip: int) -> dict[str, float]:
    """Mean seconds per step of each part in a trainer.metrics_file, first ``skip`` steps dropped."""
    if not path.is_file():
        return {}
    steps = json.loads(path.read_text()).get("steps", [])[skip:]
    return {k: statistics.fmean(s[k] or 0.0 for s in steps) for k in PARTS if steps}


def measure_with_probe(point: Point, steps: int = 16, log_every: int = 4) -> Point:
    """``point`` with its measured step time and the GEMM probe averaged before and after."""
    before = probe_gflops()
    seconds, parts = run_pretrain(point, steps, log_every, timeout=600)
    share = (before + probe_gflops()) / 2
    return replace(point, measured_s=seconds, probe_gflops=share, parts=parts)


SCALING_COLUMNS = ("tp_size", "dp_size", "micro_batch", "global_batch", "step_time_s")
"""The columns of a scaling study's results.csv that ``read_scaling_results`` prices."""


def read_scaling_results(path: str | Path, base: Workload, overlap: bool = True) -> list[Point]:
    """Points of a scaling-study results.csv (``base`` gives the model sizes and seq;
    ``overlap``: whether the study ran with trainer.overlap_grad_reduce). ValueError (one
    line naming the file) for a file without the columns, a bad value, or no usable row."""
    needs = "give the results.csv of tools/scaling_study.py, with the columns " + ", ".join(
        SCALING_COLUMNS
    )
    points = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in SCALING_COLUMNS if c not in (reader.fieldnames or ())]
        if reader.fieldnames is None or len(missing) == len(SCALING_COLUMNS):
            why = "the file is empty" if reader.fieldnames is None else "no header row"
            raise ValueError(f"{path} has no usable rows ({why}); {needs}")
        if missing:
            raise ValueError(f"{path} has no usable rows (no column {', '.join(missing)}); {needs}")
        for line, row in enumerate(reader, start=2):
            if not row.get("step_time_s"):
                continue  # a failed point
            try:
                points.append(_scaling_point(row, base, overlap))
            except (TypeError, ValueError) as err:  # a short row (None) or a non-number
                raise ValueError(f"{path}: line {line}: {err}; {needs}") from None
    if not points:
        raise ValueError(
            f"{path} has no usable rows (none has a step_time_s: no point of the study ran)"
        )
    return points


def _scaling_point(row: dict, base: Workload, overlap: bool) -> Point:
    """One row of a results.csv as a Point."""
    w = replace(base, global_batch=int(row["global_batch"]))
    # the study's ranks: CPU, one thread each, attention dropout (unfused SDPA)
    lay = Layout(
        int(row["tp_size"]),
        int(row["dp_size"]),
        int(row["micro_batch"]),
        fused_attention=False,
        threads=1,
        overlap_grad_reduce=overlap,
        # studies made before an axis have no column for it: 1 (and 1F1B), as they ran
        pp=int(row.get("pp_size") or 1),
        schedule=row.get("schedule") or "1f1b",
        virtual_stages=int(row.get("virtual_stages") or 1),
        cp=int(row.get("cp_size") or 1),
    )
    label = f"nodes={row.get('nodes', 1)} tp={lay.tp} dp={lay.dp} mb={lay.micro_batch}"
    label += f" cp={lay.cp}" if lay.cp > 1 else ""
    label += f" pp={lay.pp} {lay.schedule}" if lay.pp > 1 else ""
    label += "" if overlap else " no-overlap"
    per_node = int(row.get("procs_per_node") or 0) or None
    return Point(label, w, lay, float(row["step_time_s"]), ranks_per_node=per_node)


@dataclass(frozen=True)
class Comparison:
    """Measured vs predicted step time of one point (and the prediction rescaled by the
    machine share the run had: calibration probe ÷ probe around the run)."""

    point: Point
    predicted_s: float
    share_scale: float | None = None

    @property
    def error(self) -> float:
        """Relative error of the prediction (+ means predicted slower)."""
        return self.predicted_s / self.point.measured_s - 1

    @property
    def scaled_error(self) -> float | None:
        """Relative error of the share-rescaled prediction; None without probes."""
        if self.share_scale is None:
            return None
        return self.predicted_s * self.share_scale / self.point.measured_s - 1


def _spec(point: Point, cluster: ClusterSpec) -> ClusterSpec:
    """The cluster as the point ran on it (a scaling study's ranks per emulated node)."""
    return replace(cluster, gpus_per_node=point.ranks_per_node) if point.ranks_per_node else cluster


def compare(points: list[Point], cluster: ClusterSpec) -> list[Comparison]:
    """Predict every measured point."""
    ref = cluster.extras.get("probe_gflops") or None
    rows = []
    for p in points:
        scale = ref / p.probe_gflops if ref and p.probe_gflops else None
        rows.append(
            Comparison(p, predict(p.workload, p.layout, _spec(p, cluster)).step_time_s, scale)
        )
    return rows


def error_summary(rows: list[Comparison], scaled: bool = False) -> tuple[float, float]:
    """(max |error|, median |error|), of the raw or the share-rescaled predictions."""
    errors = [abs(r.scaled_error if scaled else r.error) for r in rows]
    return max(errors), statistics.median(errors)


def markdown_table(rows: list[Comparison]) -> str:
    """Measured vs predicted, one line per point."""
    lines = [
        "| point | measured s/step | predicted | error | machine share | rescaled error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = f"{1 / r.share_scale:.2f}" if r.share_scale else "-"
        scaled = f"{100 * r.scaled_error:+.1f}%" if r.share_scale else "-"
        lines.append(
            f"| {r.point.label} | {r.point.measured_s:.4f} | {r.predicted_s:.4f} | "
            f"{100 * r.error:+.1f}% | {share} | {scaled} |"
        )
    return "\n".join(lines)


def breakdown_table(rows: list[Comparison], cluster: ClusterSpec) -> str:
    """Measured vs predicted seconds per step of each part (where the run wrote them)."""
    names = ("compute", "TP comm", "DP exposed", "optimizer", "data")
    head = " | ".join(f"{n} meas / pred" for n in names)
    lines = [f"| point | {head} |", "|---" * (len(names) + 1) + "|"]
    for r in rows:
        if not r.point.parts:
            continue
        pred = predict(r.point.workload, r.point.layout, _spec(r.point, cluster)).breakdown
        cells = [f"{r.point.parts.get(k, 0.0):.4f} / {float(pred.get(k, 0.0)):.4f}" for k in PARTS]
        lines.append(f"| {r.point.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
