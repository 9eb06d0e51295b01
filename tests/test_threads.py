"""Thread defaults of the entry points that start ranks (engine.launching.share_cores)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine.launching import cgroup_cpu_quota, share_cores, usable_cores


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2: a 1500m Kubernetes limit
        ({"cpu.max": "max 100000\n"}, None),  # v2, unlimited
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files at all
    ],
)
def test_cgroup_quota_is_read_as_cpus(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(str(tmp_path)) == quota


def test_a_container_limit_caps_the_usable_cores(tmp_path):
    """A 1.5-CPU quota gives 1 usable core whatever the host has (os.cpu_count() would give
    every host core, and each rank would start that many threads)."""
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == affinity


def test_ranks_split_the_cores_and_say_so(monkeypatch):
    """No launcher, 4 ranks here: each gets usable ÷ 4 threads (at least 1); the returned
    line names the choice and the override. OMP_NUM_THREADS wins and is named instead."""
    saved = torch.get_num_threads()
    ps = SimpleNamespace(device=torch.device("cpu"), world_size=4)
    for name in (
        "OMP_NUM_THREADS",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    try:
        line = share_cores(ps)
        cores = usable_cores()
        assert torch.get_num_threads() == max(1, cores // 4)
        assert line == (
            f"threads: {max(1, cores // 4)} per rank ({cores} usable cores / 4 "
            "ranks on this node; OMP_NUM_THREADS=N overrides)"
        )
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)  # what the OpenMP runtime does with the variable at start
        assert share_cores(ps) == "threads: 3 per rank (OMP_NUM_THREADS)"
        assert torch.get_num_threads() == 3
        assert share_cores(SimpleNamespace(device=torch.device("cuda"), world_size=4)) is None
    finally:
        torch.set_num_threads(saved)


def test_a_cap_limits_the_share_and_the_classifier_asks_for_one_thread(monkeypatch):
    """``max_threads`` caps the core share and the line says so; the classifier's default
    (trainer.threads=1) reaches the bootstrap: its MLP's matmuls are too small for threads."""
    import apps.classify_loop as loop
    from apps.classify_config import ClassifyConfig

    saved = torch.get_num_threads()
    ps = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    for name in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("engine.launching.usable_cores", lambda: 8)
    try:
        line = share_cores(ps, max_threads=1)
        assert torch.get_num_threads() == 1
        assert line == (
            "threads: 1 per rank (8 usable cores / 1 rank on this node, capped at 1; "
            "OMP_NUM_THREADS=N overrides)"
        )
    finally:
        torch.set_num_threads(saved)
    asked = {}

    def bootstrap(dims, **kwargs):
        asked.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("engine.bootstrap.bootstrap_rank", bootstrap)
    with pytest.raises(SystemExit):
        loop.run_worker(ClassifyConfig())
    assert asked["max_threads"] == 1
