"""Fashion-MNIST: the IDX reader, the classifier's DP/TP gradients, and real training runs."""

from __future__ import annotations

import gzip
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import parallel_state
from apps.classify_loop import local_batch
from engine.data import fashion_mnist
from engine.data.idx import IDXError, read_idx
from engine.models.mlp import MLPClassifier
from tests.launch_util import run
from tests.multiproc import run_ranks

REPO = Path(__file__).resolve().parents[1]
HAVE_DATA = all(
    (Path(fashion_mnist.DEBIAN_DIR) / f"{stem}.gz").is_file()
    for stem in fashion_mnist.FILES.values()
)
needs_data = pytest.mark.skipif(
    not HAVE_DATA, reason="dataset-fashion-mnist is not installed (CI installs it: .ci/run)"
)


def _idx_bytes(type_code: int, shape: tuple[int, ...], payload: bytes) -> bytes:
    # Written by hand from the format (magic 0 0 type ndim, big-endian uint32 sizes, data),
    # independently of engine.data.idx.write_idx.
    return bytes([0, 0, type_code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + payload


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reader_reads_uint8_images_and_big_endian_ints(tmp_path, gz):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    ints = np.array([1, -2, 70000], dtype=">i4")
    opener = gzip.open if gz else open
    suffix = ".gz" if gz else ""
    with opener(tmp_path / f"img{suffix}", "wb") as f:
        f.write(_idx_bytes(0x08, (2, 3, 4), images.tobytes()))
    with opener(tmp_path / f"int{suffix}", "wb") as f:
        f.write(_idx_bytes(0x0C, (3,), ints.tobytes()))
    got = read_idx(tmp_path / f"img{suffix}")
    assert got.dtype == torch.uint8 and got.shape == (2, 3, 4)
    assert torch.equal(got, torch.from_numpy(images))
    assert read_idx(tmp_path / f"int{suffix}").tolist() == [1, -2, 70000]


def test_idx_reader_names_the_fault(tmp_path):
    (tmp_path / "short").write_bytes(_idx_bytes(0x08, (2, 2), b"\x01\x02\x03"))
    with pytest.raises(IDXError, match=r"short: 3 data bytes, but shape \[2, 2\]"):
        read_idx(tmp_path / "short")
    (tmp_path / "bad").write_bytes(b"\x12\x34\x08\x01")
    with pytest.raises(IDXError, match="bad magic"):
        read_idx(tmp_path / "bad")
    (tmp_path / "fake.gz").write_bytes(b"not gzip")
    with pytest.raises(IDXError, match="cannot read"):
        read_idx(tmp_path / "fake.gz")


@pytest.mark.slow
def test_missing_data_set_is_one_line_with_the_install_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist.find_files(tmp_path)
    out = _classify(tmp_path, f"data.dir={tmp_path}", "--epochs", "1")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "apt-get install dataset-fashion-mnist" in lines[0]
    assert "Traceback" not in out.stderr


def _grads_vs_whole_batch(tp: int, dp: int) -> float:
    ps = parallel_state.initialize(tp, dp)
    ps.seed(7)
    model = MLPClassifier(32, tp_group=ps.tp_group, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(12, 784, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (12,), generator=gen)
    from engine.data_parallel import GradSync

    sync = GradSync(model.parameters(), grad_group=ps.dp_group, tp_group=ps.tp_group)
    idx = local_batch(torch.arange(12), 0, 12 // dp, ps.dp_rank, dp)
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    sync.finish()
    got = model.full_grad_dict()
    # Reference: plain torch on the whole batch with the same full weights, no meshtron layer.
    w = {n: t.clone().requires_grad_() for n, t in model.full_state_dict().items()}
    h = F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))
    h = F.relu(F.linear(h, w["fc2.weight"], w["fc2.bias"]))
    F.cross_entropy(F.linear(h, w["head.weight"], w["head.bias"]), y).backward()
    worst = 0.0
    for name, t in w.items():
        # float64: only summation order differs (per-rank partial means, then the average).
        torch.testing.assert_close(got[name], t.grad, rtol=1e-12, atol=1e-14)
        worst = max(worst, float((got[name] - t.grad).abs().max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2)])
def test_dp_gradients_equal_the_whole_batch_gradients(tp, dp):
    worst = run_ranks(_grads_vs_whole_batch, tp * dp, tp, dp)
    assert max(worst) < 1e-14


def _classify(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "apps.classify", *args], cwd, 300)


@pytest.mark.slow
@needs_data
def test_two_ranks_reach_085_on_the_full_data_set(tmp_path):
    metrics = tmp_path / "m" / "metrics.json"
    out = _classify(
        tmp_path,
        "--num-gpus",
        "2",
        "--target-accuracy",
        "0.85",
        # lr 0.05 (default 0.02) reaches 0.85 at epoch 2 rather than 3 (here: 0.8230, 0.8530;
        # at 0.02: 0.8241, 0.8481, 0.8605): one epoch of 468 steps less per rank. The cap of
        # 4 epochs still leaves room should another machine's rounding need a third.
        "--lr",
        "0.05",
        "--epochs",
        "4",
        "trainer.progress=false",
        f"trainer.metrics_file={metrics}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"reached test accuracy (0\.\d{4}) at epoch (\d+) in ([\d.]+) s", last)
    assert match, last
    assert float(match.group(1)) >= 0.85
    data = json.loads(metrics.read_text())
    assert (data["workload"], data["dp_size"], data["world_size"]) == ("classify", 2, 2)
    assert data["global_batch"] == 2 * data["micro_batch"] == 128
    assert len(data["steps"]) == int(match.group(2)) * (60000 // 128)
    assert data["steps"][0]["tokens_per_s"] is None  # images, not tokens: see images_per_s
    summary = data["summary"]
    assert summary["reached"] and summary["test_accuracy"] == pytest.approx(
        float(match.group(1)), abs=5e-5
    )
    assert summary["time_to_accuracy_s"] > 0 and summary["images_per_s"] > 0
    assert not list(tmp_path.glob("outputs")) and not list(tmp_path.glob(".hydra"))


@pytest.mark.slow
@needs_data
def test_unreached_target_exits_1(tmp_path):
    out = _classify(
        tmp_path,
        "--epochs",
        "1",
        "--target-accuracy",
        "0.99",
        "data.train_subset=2000",
        "data.test_subset=1000",
        "trainer.progress=false",
    )
    assert out.returncode == 1, out.stderr[-2000:]
    summary, last = out.stdout.strip().splitlines()[-2:]
    assert re.fullmatch(
        r"did not reach test accuracy 0\.99 in 1 epoch: 0\.\d{4} after [\d.]+ s", last
    )
    # it said "time to accuracy nan s"
    assert re.fullmatch(r"target accuracy not reached, \d+ training images/s over 1 epoch", summary)
    assert "tp=1 dp=1" in out.stdout


@pytest.mark.slow
def test_config_errors_exit_2_before_any_rank(tmp_path):
    out = _classify(tmp_path, "--tp-size", "3", "--num-gpus", "3", "model.hidden_size=100")
    assert out.returncode == 2
    assert (
        out.stderr.strip() == ("config error: model.hidden_size=100 is not divisible by tp_size=3")
        or "model.hidden_size=100 is not divisible by tp_size=3" in out.stderr
    )
    out = _classify(tmp_path, "--num-gpus")
    assert out.returncode == 2 and "--num-gpus needs a value" in out.stderr
    out = _classify(tmp_path, "--num-gpus", "0")  # it trained on one rank before
    assert out.returncode == 2, out.stdout[-500:]
    assert out.stderr.strip() == "config error: launch.ranks_per_node=0 must be >= 1", out.stderr
