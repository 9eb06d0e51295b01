"""The scaling-study tool with the Fashion-MNIST classifier as its workload."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from studies.scaling.study import StudyConfig, grid
from studies.scaling.workloads import RunSpec, classify_command
from tests.launch_util import call_main

DATA = Path("/usr/share/datasets/fashion-mnist")


def _config(mode: str, global_batch: int) -> StudyConfig:
    return StudyConfig(
        workload="classify",
        spec=RunSpec(None, (), 5, 2),
        tp=(1,),
        dp=(1, 2, 4),
        nodes=(1,),
        procs_per_node=None,
        mode=mode,
        global_batch=global_batch,
        micro_batch=4,
        repeats=1,
        link_mbit=None,
        out=Path("unused"),
    )


def _batch(argv: list[str]) -> int:
    [value] = [a.split("=", 1)[1] for a in argv if a.startswith("trainer.batch_size=")]
    return int(value)


@pytest.mark.parametrize(
    ("mode", "expected"),
    # strong: 64 images per step split over dp; weak: 64 per DP rank, whatever dp is
    [("strong", {1: 64, 2: 32, 4: 16}), ("weak", {1: 64, 2: 64, 4: 64})],
)
def test_classify_points_get_images_per_rank(mode, expected):
    cfg = _config(mode, 64)
    points, _ = grid(cfg)
    got = {
        p.dp_size: _batch(classify_command(p, cfg.spec, Path("m.json"), Path("r"))) for p in points
    }
    assert got == expected
    argv = classify_command(points[0], cfg.spec, Path("m.json"), Path("r"))
    # apps.classify has no step count, micro batch or model preset: none may be passed
    assert not [a for a in argv if a.startswith(("trainer.max_steps", "trainer.micro", "model="))]


def test_classify_point_with_an_indivisible_batch_is_refused():
    cfg = _config("strong", 64)
    point = replace(grid(cfg)[0][0], dp_size=3)
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        classify_command(point, cfg.spec, Path("m.json"), Path("r"))


@pytest.mark.slow
@pytest.mark.skipif(
    not (DATA / "train-images-idx3-ubyte.gz").exists(),
    reason="Fashion-MNIST missing: apt-get install dataset-fashion-mnist",
)
def test_two_point_classify_study_reports_time_to_accuracy(tmp_path, capsys, monkeypatch):
    from studies.scaling.study_cli import main

    monkeypatch.chdir(tmp_path)  # where the study process ran: anything written beside stays
    out = tmp_path / "study"
    # The study's main() runs in this process (its points are real processes, one thread
    # each: the study sets OMP_NUM_THREADS per rank); --point-timeout 240 bounds a hung
    # point as the subprocess's timeout did.
    argv = [
        "--point-timeout",
        "240",
        "--workload",
        "classify",
        "--dp",
        "1,2",
        "--global-batch",
        "64",
        "--no-links",
        "--out",
        str(out),
        "data.train_subset=4096",
        "data.test_subset=1000",
        "trainer.target_accuracy=0.5",
        "trainer.epochs=3",
    ]
    code = call_main(main, argv)
    done = capsys.readouterr()
    assert code == 0, done.out[-2000:] + done.err[-2000:]
    lines = (out / "results.csv").read_text().splitlines()
    rows = {int(r["dp_size"]): r for r in csv.DictReader(lines)}
    assert sorted(rows) == [1, 2]
    for dp, row in rows.items():
        # the figures are the run's own summary (rank 0's metrics file), not recomputed
        [metrics] = (out / "runs").glob(f"*-dp{dp}-*/repeat0/metrics.json")
        summary = json.loads(metrics.read_text())["summary"]
        assert summary["reached"] and summary["test_accuracy"] >= 0.5
        assert float(row["time_to_accuracy_s"]) == pytest.approx(summary["time_to_accuracy_s"])
        assert float(row["test_accuracy"]) == pytest.approx(summary["test_accuracy"])
        assert json.loads(metrics.read_text())["global_batch"] == 64  # strong: fixed global batch
        assert row["tokens_per_s"] == ""  # classify measures no tokens: empty, not 0
    t1, t2 = (float(rows[dp]["time_to_accuracy_s"]) for dp in (1, 2))
    # rel 1e-9: the CSV holds Python's repr of each float, so only rounding may differ
    assert float(rows[2]["tta_speedup"]) == pytest.approx(t1 / t2, rel=1e-9)
    assert float(rows[2]["tta_efficiency"]) == pytest.approx(t1 / t2 / 2, rel=1e-9)
    assert float(rows[1]["tta_speedup"]) == 1.0
    assert "## Time to accuracy" in (out / "report.md").read_text()
