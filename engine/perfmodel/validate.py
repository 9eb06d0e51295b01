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
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from engine.perfmodel.cluster import ClusterSpec
from engine.perfmodel.model import Layout, Workload, predict

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


def pretrain_overrides(w: Workload, lay: Layout, steps: int, log_every: int) -> list[str]:
    """Hydra overrides that make engine.pretrain run exactly this point, writing nothing."""
    return [
        f"tp_size={lay.tp}", f"dp_size={lay.dp}", f"model.hidden_size={w.hidden}",
        f"model.num_layers={w.layers}", f"model.num_heads={w.heads}",
        f"model.sequence_parallel={str(lay.sequence_parallel).lower()}",
        f"model.recompute={lay.recompute}", f"data.seq_len={w.seq}",
        f"trainer.global_batch={w.global_batch}", f"trainer.micro_batch={lay.micro_batch}",
        f"optim.distributed={str(lay.zero1).lower()}", f"trainer.max_steps={steps}",
        f"trainer.log_every={log_every}", "trainer.eval_every=0", "trainer.sample_tokens=0",
        "trainer.tensorboard=false", "trainer.progress=false", "checkpoint.every=0",
        "checkpoint.save_final=false", "checkpoint.resume=false",
    ]  # fmt: skip


def parse_step_times(console: str, tokens_per_step: int) -> list[float]:
    """Seconds per step of each logging window after the first (warmup)."""
    rates = [float(m.group(2)) for m in _TOKS.finditer(console)]
    return [tokens_per_step / r for r in rates[1:]]


def measure_pretrain(
    point: Point, steps: int = 16, log_every: int = 4, timeout: int = 600
) -> float:
    """Median step time of engine.pretrain at ``point`` (seconds); raises on a failed run."""
    w, lay = point.workload, point.layout
    with tempfile.TemporaryDirectory() as tmp:
        args = pretrain_overrides(w, lay, steps, log_every) + list(point.overrides)
        args += [f"checkpoint.dir={tmp}/ckpt", f"hydra.run.dir={tmp}/run"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if lay.threads:  # the trainer keeps an explicit OMP_NUM_THREADS
            env["OMP_NUM_THREADS"] = str(lay.threads)
        out = subprocess.run([sys.executable, "-m", "engine.pretrain", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)  # fmt: skip
    times = parse_step_times(out.stdout, w.global_batch * w.seq)
    if out.returncode != 0 or not times:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{point.label}: engine.pretrain failed: {tail[0]}")
    return statistics.median(times)


def measure_with_probe(point: Point, steps: int = 16, log_every: int = 4) -> Point:
    """``point`` with its measured step time and the GEMM probe averaged before and after."""
    from engine.perfmodel.calibrate import probe_gflops

    before = probe_gflops()
    seconds = measure_pretrain(point, steps=steps, log_every=log_every)
    return replace(point, measured_s=seconds, probe_gflops=(before + probe_gflops()) / 2)


def read_scaling_results(path: str | Path, base: Workload) -> list[Point]:
    """Points of a scaling-study results.csv (``base`` gives the model sizes and seq)."""
    points = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if not row.get("step_time_s"):
                continue  # a failed point
            w = replace(base, global_batch=int(row["global_batch"]))
            lay = Layout(int(row["tp_size"]), int(row["dp_size"]), int(row["micro_batch"]))
            label = f"nodes={row.get('nodes', 1)} tp={lay.tp} dp={lay.dp} mb={lay.micro_batch}"
            points.append(Point(label, w, lay, float(row["step_time_s"])))
    return points


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


def compare(points: list[Point], cluster: ClusterSpec) -> list[Comparison]:
    """Predict every measured point."""
    ref = cluster.extras.get("probe_gflops") or None
    rows = []
    for p in points:
        scale = ref / p.probe_gflops if ref and p.probe_gflops else None
        rows.append(Comparison(p, predict(p.workload, p.layout, cluster).step_time_s, scale))
    return rows


def error_summary(rows: list[Comparison], scaled: bool = False) -> tuple[float, float]:
    """(max |error|, median |error|), of the raw or the share-rescaled predictions."""
    errors = [abs(r.scaled_error if scaled else r.error) for r in rows]
    return max(errors), statistics.median(errors)


def markdown_table(rows: list[Comparison]) -> str:
    """Measured vs predicted, one line per point."""
    lines = ["| point | measured s/step | predicted | error | machine share | rescaled error |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        share = f"{1 / r.share_scale:.2f}" if r.share_scale else "-"
        scaled = f"{100 * r.scaled_error:+.1f}%" if r.share_scale else "-"
        lines.append(f"| {r.point.label} | {r.point.measured_s:.4f} | {r.predicted_s:.4f} | "
                     f"{100 * r.error:+.1f}% | {share} | {scaled} |")  # fmt: skip
    return "\n".join(lines)
