"""Scaling studies: the runner end to end, the emulated cluster, clean-up, sweeps, the timer."""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.data import build_default_corpus
from engine.step_timer import _DPClock
from studies.scaling.emulated_cluster import PREFIX, namespaces, unavailable_reason
from studies.scaling.report import COLUMNS
from tests.launch_util import call_main
from tests.launch_util import run as run_command
from tests.multiproc import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.vocab_size=512",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "data.seq_len=16",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """Overrides pointing at a small slice of the embedded corpus (no 4 MB cache build)."""
    prefix, tokenizer = build_default_corpus(
        tmp_path_factory.mktemp("corpus"), vocab_size=512, max_bytes=200_000, progress=False
    )
    return [f"data.prefixes=[{prefix}]", f"data.tokenizer={tokenizer}", "data.split='90,10,0'"]


# The three-point study's batch (no link benchmark), and its resume's: the same points.
BATCH_12_BY_2_NO_LINKS = ("--global-batch", "12", "--micro-batch", "2", "--no-links")


def _study_args(out: Path, data: list[str], *args: str) -> list[str]:
    return [
        "--out",
        str(out),
        "--steps",
        "3",
        "--warmup",
        "1",
        *args,
        *TINY,
        *data,
    ]


def _study(out: Path, data: list[str], *args: str, **kwargs) -> subprocess.Popen:
    argv = [sys.executable, str(ROOT / "tools" / "scaling_study.py")]
    argv += _study_args(out, data, *args)
    return subprocess.Popen(argv, env=subprocess_env(ROOT), cwd=out.parent, text=True, **kwargs)


def _study_here(out: Path, data: list[str], capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the study CLI's main() run in this process: its
    points are still real processes, and 3 s of a study process's imports are saved.
    --point-timeout 300 bounds a hung point as the subprocess's timeout did; it runs in
    the subprocess's working directory, ``out``'s parent."""
    from studies.scaling.study_cli import main

    capsys.readouterr()
    here = os.getcwd()
    os.chdir(out.parent)
    try:
        code = call_main(main, _study_args(out, data, "--point-timeout", "300", *args))
    finally:
        os.chdir(here)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        return list(reader)


@pytest.mark.slow
def test_three_point_study_reports_consistent_speedup(tmp_path, data, capsys):
    out = tmp_path / "study"
    # dp=5 cannot split a global batch of 12 into micro-batches of 2: that point is named
    # before anything runs, never started, and reported as failed; the others run.
    code, log, err = _study_here(out, data, capsys, "--dp", "1,5,2", *BATCH_12_BY_2_NO_LINKS)
    assert err.startswith(
        "scaling_study: point n1x5-tp1-dp5-mb2-gb12 cannot run, so it is not run: "
        "--global-batch 12 is not a multiple of --micro-batch × --dp = 2 × 5 = 10"
    ), err
    log += err
    assert code == 1, log  # 1: some point failed
    assert "point n1x5-tp1-dp5-mb2-gb12 failed" in log and "not a multiple" in log, log
    assert not (out / "runs" / "n1x5-tp1-dp5-mb2-gb12").exists()
    rows = _rows(out)
    assert [int(r["dp_size"]) for r in rows] == [1, 2]
    # Independent of the report code: medians of the measured steps (step > warm-up 1) of
    # each run's own metrics JSON. Tolerance 1e-9 relative: the CSV prints full floats.
    t, mean = {}, {}
    for r in rows:
        key = f"n{r['nodes']}x{r['procs_per_node']}-tp1-dp{r['dp_size']}-mb2-gb12"
        steps = json.loads((out / "runs" / key / "repeat0" / "metrics.json").read_text())["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3, 4]
        n = int(r["world_size"])
        t[n] = statistics.median(s["step_time_s"] for s in steps[1:])
        mean[n] = statistics.mean(s["step_time_s"] for s in steps[1:])
        assert float(r["step_time_s"]) == pytest.approx(t[n], rel=1e-9)
        assert float(r["step_time_p10_s"]) <= float(r["step_time_s"]) <= float(r["step_time_p90_s"])
    for r in rows:
        n = int(r["world_size"])
        assert float(r["speedup"]) == pytest.approx(t[1] / t[n], rel=1e-9)
        assert float(r["efficiency"]) == pytest.approx(t[1] / t[n] / n, rel=1e-9)
        # The parts of a step add up to its mean time: the phases are contiguous wall clocks
        # and TP time is cut out of compute (1e-6 relative: float sums of a few terms).
        parts = ("compute_s", "tp_comm_s", "dp_comm_exposed_s", "data_s", "optimizer_s")
        assert sum(float(r[k]) for k in parts) == pytest.approx(mean[n], rel=1e-6)
    assert float(rows[0]["dp_comm_total_s"]) == 0.0 and float(rows[1]["dp_comm_total_s"]) > 0
    import matplotlib.image as mpimg

    for name in ("speedup.png", "efficiency.png", "time_shares.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert mpimg.imread(out / name).shape[2] in (3, 4)
    report = (out / "report.md").read_text()
    assert "| ranks | 1 node(s) |" in report and "--dp 1,5,2" in report
    assert "## Failed points" in report and "dp5" in report
    # The same command again refuses to overwrite it (before any work: one line on stderr);
    # --resume re-runs no finished point.
    code, _, err = _study_here(out, data, capsys, "--dp", "1,5,2", "--no-links")
    assert code == 2 and err.count("\n") == 1 and "--resume" in err
    before = (out / "points.jsonl").read_text()
    code, log, err = _study_here(
        out, data, capsys, "--dp", "1,2", *BATCH_12_BY_2_NO_LINKS, "--resume"
    )
    assert code == 0 and "2 of 2 points already done" in log + err, log + err
    assert (out / "points.jsonl").read_text() == before  # nothing ran again
    assert _rows(out) == rows


NO_NETNS = unavailable_reason()
LINK_MBIT = 400


def _cluster_yaml(tmp_path: Path, mbit: int) -> Path:
    path = tmp_path / f"emulated_{mbit}mbit.yaml"
    path.write_text(f"name: test\ngpus_per_node: 2\nemulation:\n  link_mbit: {mbit}\n")
    return path


@pytest.mark.slow
@pytest.mark.skipif(NO_NETNS is not None, reason=f"network namespaces refused: {NO_NETNS}")
def test_emulated_two_nodes_train_and_links_hold_the_configured_rate(tmp_path, data, capsys):
    # 400 Mbit/s: a twenty-fifth of what loopback carried here (≥ 10 Gbit/s), so the
    # measured rate is the shaper's, not the CPU's; twice 200 Mbit/s's rate halves the
    # seconds the sweep's 4 and 16 MiB messages wait on the shaper (about 2.5 s).
    out = tmp_path / "study"
    cluster = _cluster_yaml(tmp_path, LINK_MBIT)
    code, log, err = _study_here(
        out, data, capsys, "--dp", "4", "--nodes", "2", "--cluster", str(cluster)
    )
    assert code == 0, log + err
    [row] = _rows(out)
    assert (row["nodes"], row["procs_per_node"], row["world_size"]) == ("2", "2", "4")
    assert float(row["dp_comm_total_s"]) > 0
    links = json.loads((out / "links.json").read_text())
    inter = max(links["inter_node"], key=lambda r: r["bytes"])  # 16 MiB: burst negligible
    intra = max(links["intra_node"], key=lambda r: r["bytes"])
    # Within 20 %: tbf holds the rate, headers (~3 %) and gloo's framing take a little.
    assert inter["busbw_Gbps"] == pytest.approx(LINK_MBIT / 1000, rel=0.2)
    assert intra["busbw_Gbps"] > 2 * LINK_MBIT / 1000  # the node-local path is not shaped
    assert _leftover_namespaces(out) == []


def _leftover_namespaces(out: Path) -> list[str]:
    """Namespaces of this study still present (the study records each cluster's tag)."""
    tags = [p.read_text() for p in out.rglob("*cluster_tag")]
    assert tags, "the study made no emulated cluster"
    return [ns for tag in tags for ns in namespaces(PREFIX + tag)]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_study_killed_midway_leaves_nothing_behind(tmp_path, data, sig):
    # Ctrl-C unwinds the study, which stops its workers and removes its namespaces.
    # SIGKILL gives it no chance: its guard process must. Without namespaces the study
    # runs on the host, where only the first can be cleaned up.
    if sig == signal.SIGKILL and NO_NETNS is not None:
        pytest.skip(f"SIGKILL clean-up is the namespaces' guard; namespaces refused: {NO_NETNS}")
    out = tmp_path / "killed"
    proc = _study(
        out,
        data,
        "--dp",
        "2",
        "--nodes",
        "2",
        "--cluster",
        str(_cluster_yaml(tmp_path, 500)),
        "--no-links",
        "--steps",
        "500",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("runs/*/repeat0/log.txt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # the workers are starting or training
    assert proc.poll() is None, "the study ended before it could be killed"
    assert _processes_mentioning(str(out)), "no worker was running"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30

    def leftovers() -> list:
        found = _processes_mentioning(str(out))
        if NO_NETNS is None:  # the namespaces, and the guard and `ip netns exec` naming them
            tags = [p.read_text() for p in out.rglob("*cluster_tag")]
            found += _leftover_namespaces(out) + [p for t in tags for p in _processes_mentioning(t)]
        return found

    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == []


@pytest.mark.slow
def test_multirun_gives_every_job_its_own_checkpoints(tmp_path, data):
    common = [
        "tp_size=1",
        "dp_size=1",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "trainer.sample_tokens=0",
        "trainer.tensorboard=false",
        "checkpoint.every=1",
        "checkpoint.save_final=false",
        *TINY,
        *data,
    ]
    single = [sys.executable, "-m", "engine.pretrain", *common, f"hydra.run.dir={tmp_path / 'r'}"]
    sweep = [
        sys.executable,
        "-m",
        "engine.pretrain",
        "-m",
        "trainer.seed=1,2",
        *common,
        "trainer.metrics_file=${hydra:runtime.output_dir}/m.json",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    runs = []
    for argv in (single, sweep):  # the case: the main job ran before the sweep
        runs.append(run_command(argv, tmp_path, 300))
        assert runs[-1].returncode == 0, runs[-1].stderr[-2000:]
    assert (tmp_path / "checkpoints" / "gpt_tiny_stdlib" / "step_00000001").is_dir()
    assert "resuming" not in runs[1].stdout and "nothing to train" not in runs[1].stdout
    for job in ("0", "1"):
        steps = json.loads((tmp_path / "sweep" / job / "m.json").read_text())["steps"]
        assert [s["step"] for s in steps] == [1]
        assert (tmp_path / "sweep" / job / "checkpoints" / "step_00000001").is_dir()


def test_dp_busy_time_is_the_union_of_overlapping_collectives():
    # Hand-derived: spans [0, 2], [1, 3] (queued behind the first) and [5, 6] are busy for
    # 3 + 1 = 4 s; a span whose callback has not run ends when the wait returned (t = 8).
    clock = _DPClock(torch.device("cpu"))
    clock._async = [[0.0, 2.0], [1.0, 3.0], [5.0, 6.0]]
    assert clock.async_busy(waited=10.0) == pytest.approx(4.0)
    clock._async.append([7.0, None])
    assert clock.async_busy(waited=8.0) == pytest.approx(5.0)


def test_linear_lr_scaling_rule():
    from engine.config import OptimConfig, TrainerConfig
    from engine.optim import scale_lr

    scaled = scale_lr(
        OptimConfig(lr=1e-3, min_lr=1e-4, scale_lr_with_batch=16), TrainerConfig(global_batch=64)
    )
    assert (scaled.lr, scaled.min_lr) == pytest.approx((4e-3, 4e-4))  # × 64 / 16
    plain = OptimConfig(lr=1e-3)
    assert scale_lr(plain, TrainerConfig(global_batch=64)) is plain


def test_without_root_the_study_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = unavailable_reason()
    assert reason is not None and "\n" not in reason and "root" in reason


def test_weak_scaling_speedup_counts_the_larger_batch():
    from studies.scaling.report import add_speedup

    # Hand-derived: 2 ranks do twice the batch in 1.25× the time: speedup 2/1.25 = 1.6,
    # efficiency 0.8; a failed point is left out.
    rows = [
        {"status": "ok", "world_size": 1, "nodes": 1, "global_batch": 8, "step_time_s": 1.0},
        {"status": "ok", "world_size": 2, "nodes": 1, "global_batch": 16, "step_time_s": 1.25},
        {"status": "failed", "world_size": 4, "nodes": 1, "global_batch": 32},
    ]
    ok = add_speedup(rows, "weak")
    assert len(ok) == 2
    assert (ok[1]["speedup"], ok[1]["efficiency"]) == pytest.approx((1.6, 0.8))


def test_report_leaves_out_tables_that_do_not_apply_and_plots_carry_titles(tmp_path):
    """A pre-training study's rows carry the time-to-accuracy columns empty: its report has
    no such table (it would be all n/a); a classification row with an accuracy keeps it.
    Every figure gets a title naming what it shows and the study."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from studies.scaling.report import plot, write_report

    row = {
        "status": "ok",
        "nodes": 1,
        "procs_per_node": 2,
        "tp_size": 1,
        "dp_size": 2,
        "world_size": 2,
        "global_batch": 8,
        "step_time_s": 0.5,
        "step_time_p10_s": 0.4,
        "step_time_p90_s": 0.6,
        "speedup": 1.0,
        "efficiency": 1.0,
        "compute_s": 0.4,
        "time_to_accuracy_s": None,
        "test_accuracy": None,
    }
    kwargs = dict(out=tmp_path, links={}, command="x", load="0", mode="strong")
    text = write_report([row], [], **kwargs).read_text()
    assert "Time to accuracy" not in text and "## Speedup" in text
    reached = {**row, "test_accuracy": 0.86, "time_to_accuracy_s": 12.0, "epochs": 3}
    assert "## Time to accuracy" in write_report([reached], [], **kwargs).read_text()
    # The links' line reads as a sentence with a rate or without one ("unshaped Mbit/s").
    from studies.scaling.report import link_table

    assert link_table({"configured_mbit": None})[0] == (
        "Configured inter-node link: none (no --cluster, so no link is shaped)."
    )
    assert link_table({"configured_mbit": 1000})[0] == (
        "Configured inter-node link: 1000 Mbit/s (tc tbf, each direction). Latency is not injected."
    )

    titles = []
    saved = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: titles.append(fig.axes[0].get_title())
    try:
        paths = plot([row], tmp_path, title="gpt_tiny, strong scaling")
    finally:
        plt.Figure.savefig = saved
    assert [p.name for p in paths] == ["speedup.png", "efficiency.png", "time_shares.png"]
    assert titles == [
        "Speedup over 2 rank(s)\ngpt_tiny, strong scaling",
        "Parallel efficiency\ngpt_tiny, strong scaling",
        "Where the step time goes\ngpt_tiny, strong scaling",
    ]


def test_pp_sweep_plans_what_the_trainer_accepts_and_reports_the_bubble(tmp_path):
    """--pp × --dp on 2 emulated nodes: the planned points are those the trainer's own
    config check accepts (one-line skips for the rest); their commands carry the pipeline
    keys (a pp 1 point's command and key are as before the axis). The report gets a bubble
    table and plot only when a point is pipelined, and no link table without links."""
    from engine.config import Config, parallel_dims, validate
    from studies.scaling.report import plot, write_report
    from studies.scaling.study import StudyConfig, grid
    from studies.scaling.workloads import RunSpec, pretrain_command

    cfg = StudyConfig(
        workload="pretrain",
        spec=RunSpec(None, (), 1, 0),
        tp=(1,),
        dp=(1, 2),
        nodes=(2,),
        procs_per_node=None,
        mode="strong",
        global_batch=16,
        micro_batch=4,
        repeats=1,
        link_mbit=1000,
        out=tmp_path,
        pp=(1, 2, 4),
        schedules=("1f1b", "interleaved_1f1b"),
    )
    points, skipped = grid(cfg)
    assert [(p.dp_size, p.pp_size, p.schedule, p.microbatches) for p in points] == [
        (2, 1, "1f1b", 2),
        (1, 2, "1f1b", 4),
        (1, 2, "interleaved_1f1b", 4),
        (2, 2, "1f1b", 2),
        (2, 2, "interleaved_1f1b", 2),
        (1, 4, "1f1b", 4),
        (1, 4, "interleaved_1f1b", 4),
    ]
    assert len(skipped) == 3 and all("\n" not in line for line in skipped)
    assert "tp=1 dp=2 pp=4 on 2 node(s): schedule=1f1b needs at least pp_size=4" in skipped[1]
    for point in points:  # the runtime's own check, with 8 layers for 4 × 2 stages
        run = Config(tp_size=1, dp_size=point.dp_size, pp_size=point.pp_size)
        run.model.num_layers = 8
        run.trainer.global_batch, run.trainer.micro_batch = 16, 4
        run.pipeline.schedule, run.pipeline.virtual_stages = point.schedule, point.virtual_stages
        assert validate(run, parallel_dims(run, None)) == [], point
    argv = pretrain_command(points[2], cfg.spec, tmp_path / "m.json", tmp_path)
    assert {"pp_size=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"} <= set(
        argv
    )
    assert points[2].key == "n2x1-tp1-dp1-mb4-gb16-pp2-interleaved_1f1b-v2"
    assert points[0].key == "n2x1-tp1-dp2-mb4-gb16"
    plain_argv = pretrain_command(points[0], cfg.spec, tmp_path, tmp_path)
    assert not [a for a in plain_argv if a.startswith(("pp_size", "pipeline."))]

    base = dict(status="ok", step_time_s=0.5, step_time_p10_s=0.4, step_time_p90_s=0.6)
    base |= dict(speedup=1.0, efficiency=1.0, compute_s=0.4)
    rows = [
        {**base, **vars(p), "world_size": p.world_size, "layout": p.layout}
        | {"microbatches": p.microbatches, "pp_compute_s": 0.2, "pp_wait_s": 0.1}
        | ({"pp_bubble": 0.5} if p.pp_size > 1 else {})
        for p in points[:3]
    ]
    kwargs = dict(out=tmp_path, links={}, command="x", load="0", mode="strong")
    plain = write_report(rows[:1], [], **kwargs).read_text()
    assert "Pipeline bubble" not in plain and "## Links" not in plain and "bubble.png" not in plain
    text = write_report(rows, [], **kwargs).read_text()
    # Hand-derived: (2 − 1)/4 for 1F1B, (2 − 1)/(2 · 4) interleaved.
    assert "| 2×1 tp1 dp1 pp2 1f1b | 2 | 1 | 4 | 200.0 | 100.0 | 0.500 | 0.250 |" in text
    assert (
        "| 2×1 tp1 dp1 pp2 interleaved_1f1b v2 | 2 | 2 | 4 | 200.0 | 100.0 | 0.500 | 0.125 |"
        in text
    )
    assert [p.name for p in plot(rows[:1], tmp_path)] == [
        "speedup.png",
        "efficiency.png",
        "time_shares.png",
    ]
    assert plot(rows, tmp_path, title="t")[-1].name == "bubble.png"


@pytest.mark.slow
def test_cp_axis_runs_ring_attention_points_labelled_by_cp(tmp_path, data, capsys):
    """``--cp 1,2``: the cp 2 point runs 2 ranks whose trainer says ``cp=2 (ring
    attention)`` in its own log, and results.csv labels it cp_size 2, world 2. Before,
    cp reached a study only as the override cp_size=2, which ran every point at cp 2
    while results.csv said world 1; such an override is now refused (test_bad_input)."""
    out = tmp_path / "cp"
    args = ("--model", "llama_tiny", "--dp", "1", "--cp", "1,2", *BATCH_12_BY_2_NO_LINKS)
    args += ("trainer.device=cpu",)  # 2 ranks on CPU on a machine with a GPU as well
    code, _, err = _study_here(out, data, capsys, *args)
    assert code == 0, err
    rows = {r["cp_size"]: r for r in _rows(out)}
    assert rows.keys() == {"1", "2"}
    assert (rows["2"]["world_size"], rows["2"]["procs_per_node"]) == ("2", "2")
    assert all(r["step_time_s"] for r in rows.values())
    log = (out / "runs" / "n1x2-tp1-dp1-mb2-gb12-cp2" / "repeat0" / "log.txt").read_text()
    assert "tp=1 dp=1 cp=2 (ring attention)" in log
    assert "| 1×2 tp1 dp1 cp2 |" in (out / "report.md").read_text()
