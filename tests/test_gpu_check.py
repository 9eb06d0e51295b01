"""tools/gpu_check.py: its CPU rehearsal runs every item's code path, its budget and
time limits hold, and its results are written whatever stops it."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from studies.bench import gpu_check, step_profile

ROOT = Path(__file__).resolve().parents[1]
KERNEL_OPS = {"layer_norm", "bias_gelu", "bias_dropout_add", "rms_norm", "swiglu", "cross_entropy"}
# fp32 losses of meshtron and the plain PyTorch GPT agree to summation order (~1e-7 per op);
# the benchmark itself refuses to time them past 1e-4 (eagerly, in eval mode), so a gap
# above that in the loops' first steps (fp32 on CPU, the same weights) is a wrong model.
LOSS_GAP = 1e-4


def _run(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp / "unused")}
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=900,
    )


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    done = _run("--rehearse", "--out", str(out), "--commit", "abc1234", tmp=out)
    return done, out


# slow as pyproject defines it (about 50 s on idle cores: six subprocesses, each importing
# torch); the budget and kill tests below (about 3 s each) are slow too, the argument test not.
@pytest.mark.slow
def test_rehearsal_runs_every_item_and_writes_the_table(rehearsal):
    done, out = rehearsal
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["commit"] == "abc1234"
    items = {item["name"]: item for item in doc["items"]}
    assert list(items) == [item.name for item in gpu_check.ITEMS]  # all, starred too, in order
    # No GPU here (two GPUs); the 1.3B and llama_1b loops go through the same bench path as
    # 350M's, whose rehearsal takes every loop flag but CUDA graphs', so it runs alone.
    skipped = {"two_gpus", "train_gpt_1.3b", "train_llama_1b", "kernels_1.3b"}
    for name, item in items.items():
        expected = "not run here" if name in skipped else "ok"
        assert item["status"] == expected, (name, item["note"])
        assert name in skipped or item["rows"], name
    assert "needs 2 GPUs" in items["two_gpus"]["note"]

    kernels = items["kernels"]["rows"]
    assert {row["case"].split()[0] for row in kernels} == KERNEL_OPS
    for row in kernels:  # the benchmark checks each kernel against torch in fp32
        err = float(row["note"].split("max err vs torch ")[1].split(";")[0])
        assert err < 1e-4, row

    by_kind = " time by kind"  # the profiled rows: where each loop's step time goes
    gpt = {row["case"]: row for row in items["train_gpt_350m"]["rows"]}
    timed = {case for case in gpt if not case.endswith(by_kind)}
    loops = {"meshtron compiled", "meshtron", "meshtron torch-kernels"}
    assert timed == loops | {"pytorch compile", "pytorch eager"}
    assert set(gpt) - timed == {f"{case}:{by_kind}" for case in timed}
    for case in timed:  # CPU time off CUDA, each against the compiled plain GPT
        row = gpt[f"{case}:{by_kind}"]
        assert row["note"] == "CPU time per step, profiled"
        parts = re.findall(r"(\w[\w ]*?) ([\d.]+)", row["value"].split(" (total")[0])
        total = float(re.search(r"\(total ([\d.]+)\) ms", row["value"]).group(1))
        assert {kind for kind, _ in parts} <= set(step_profile.KIND_NAMES), row
        # each kind is rounded to 0.1 ms: the sum may drift by 0.05 ms a kind
        assert sum(float(ms) for _, ms in parts) == pytest.approx(total, abs=0.05 * len(parts))
        if case == "pytorch compile":
            assert row["ratio"] == "", row
        else:
            assert row["ratio"].startswith("vs pytorch compile: "), row
    for case in ("meshtron", "meshtron torch-kernels", "pytorch compile", "pytorch eager"):
        gap = float(gpt[case]["note"].split("loss gap to the first loop ")[1])
        assert gap <= LOSS_GAP, gpt[case]
    assert "pytorch compile's tokens/s" in gpt["meshtron"]["ratio"]
    fsdp = {"meshtron", "meshtron ZeRO-3"}  # each compiled and eager
    assert {row["case"] for row in items["fsdp_full"]["rows"]} == fsdp | {
        f"{case} compiled" for case in fsdp
    }
    moe = {row["case"]: row for row in items["train_moe"]["rows"]}
    assert set(moe) == {"meshtron compiled", "meshtron"} | {
        f"{case}: time by kind" for case in ("meshtron compiled", "meshtron")
    }
    gap = float(moe["meshtron"]["note"].split("loss gap to the first loop ")[1])
    assert gap <= LOSS_GAP, moe["meshtron"]
    sides = {row["case"].split(" (")[0] for row in items["checkpoint"]["rows"]}
    assert sides == {f"meshtron against {s}" for s in ("dcp", "torch.save", "safetensors")}

    table = (out / "gpu_check.md").read_text()
    assert "| item | case | value | ratio | note |" in table
    assert f"torch {torch.__version__}" in table and "commit abc1234" in table
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {name} " in log for name in items if name not in skipped)
    assert log.count("steps, top ops by") == 5 + 2  # 350M's five loops and the MoE's two
    assert not (out / "unused").exists()  # --out wins over $OUT


@pytest.mark.slow
def test_a_spent_budget_skips_every_item_and_still_writes(tmp_path):
    done = _run("--rehearse", "--budget", "1", "--out", str(tmp_path), tmp=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [item["status"] for item in doc["items"]] == ["skipped"] * len(gpu_check.ITEMS)
    assert all("budget spent (1 s)" in item["note"] for item in doc["items"])


@pytest.mark.slow
def test_an_item_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    with open(tmp_path / "log", "w") as log:
        code, _ = gpu_check._run_subprocess([sys.executable, "-c", script], 3, log)
    assert code is None  # killed, not finished
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # the kill is sent; wait (bounded) until the kernel has done it
        state = Path(f"/proc/{grandchild}/status")
        if not state.exists() or "State:\tZ" in state.read_text():
            break
        time.sleep(0.05)
    assert not state.exists() or "State:\tZ" in state.read_text()


def test_bad_arguments_are_one_line(tmp_path, monkeypatch, capsys):
    done = _run("--rehearse", "--items", "kernels,nonsense", tmp=tmp_path)
    assert done.returncode == 2
    assert "--items: unknown 'nonsense'; choose from kernels," in done.stderr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device is visible: run it on the GPU machine, or --rehearse" in (
        capsys.readouterr().err
    )


def test_profile_rows_give_each_kind_the_gap_and_the_gpus_busy_share():
    """A GPU profile's rows: ms per kind, the differences to the anchor loop, and the
    kernels' share of the timed step (hand-computed: 92 of 100 ms, 88 of 90 ms)."""
    ours, ref = "meshtron compiled tp=1 dp=1", "pytorch compile"
    profile = {
        ours: {"clock": "gpu", "ms_per_step": {"matmul": 80.0, "compiled": 12.0, "total": 92.0}},
        ref: {"clock": "gpu", "ms_per_step": {"matmul": 80.0, "compiled": 8.0, "total": 88.0}},
    }
    rows = gpu_check._profile_rows("train", profile, ref, {ours: 100.0, ref: 90.0})
    assert [row["case"] for row in rows] == [
        "meshtron compiled: time by kind",
        "pytorch compile: time by kind",
    ]
    assert rows[0]["value"] == "matmul 80.0 · compiled 12.0 (total 92.0) ms"
    assert rows[0]["ratio"] == "vs pytorch compile: compiled +4.0, total +4.0 ms"
    assert rows[0]["note"].endswith("; GPU busy 92% of the timed 100.0 ms step")
    assert rows[1]["ratio"] == "" and rows[1]["note"].endswith(
        "GPU busy 98% of the timed 90.0 ms step"
    )


def test_a_gpu_run_leaves_the_starred_items_out_and_a_rehearsal_runs_them():
    """The default GPU run: the items no two windows have settled (one 480 s call reaches
    them all); the starred ones run when named. A rehearsal runs every item, so none rots."""
    starred = {"kernels_1.3b", "checkpoint", "fsdp_full", "train_moe"}
    gpu = [item.name for item in gpu_check.parse_args([]).items]
    assert starred.isdisjoint(gpu) and "train_gpt_350m" in gpu, gpu
    rehearsal = [item.name for item in gpu_check.parse_args(["--rehearse"]).items]
    assert rehearsal == [item.name for item in gpu_check.ITEMS] and starred <= set(rehearsal)
    named = gpu_check.parse_args(["--items", "train_moe,fsdp_full"]).items
    assert [item.name for item in named] == ["train_moe", "fsdp_full"]
