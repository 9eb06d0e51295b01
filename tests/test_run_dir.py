"""One run, one run directory: every rank of an outside launcher's job shares one Hydra
output folder (issue 45), and a run's first console line arrives while it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.data import build_default_corpus
from engine.launching import shared_run_dir
from engine.pretrain import with_shared_run_dir
from tests.launch_util import env_with_repo, free_port, tiny_overrides


def _torchrun(rank: int, run_id: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": run_id,
    }


def test_every_rank_of_a_job_names_the_same_run_dir():
    slurm = [
        {"SLURM_PROCID": str(r), "SLURM_NTASKS": "4", "SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0"}
        for r in range(4)
    ]
    assert {shared_run_dir(env) for env in slurm} == {"outputs/slurm-812-0"}
    mpi = [
        {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "n0"}
        | {"PMIX_NAMESPACE": "prte@1"}
        for r in range(2)
    ]
    assert {shared_run_dir(env) for env in mpi} == {"outputs/mpi-prte_1"}
    assert {shared_run_dir(_torchrun(r, "5f0c")) for r in range(2)} == {"outputs/torchrun-5f0c"}
    # torchrun without a rendezvous id: the ranks' common parent (the agent) names the run.
    no_id = {shared_run_dir(_torchrun(r, "none")) for r in range(2)}
    assert len(no_id) == 1 and no_id.pop().startswith("outputs/torchrun-ppid")
    assert shared_run_dir({}) is None  # a lone process keeps Hydra's outputs/DATE/TIME


def test_an_explicit_run_dir_or_a_sweep_is_left_alone(monkeypatch):
    monkeypatch.setattr("engine.launching.shared_run_dir", lambda: "outputs/torchrun-x")
    assert with_shared_run_dir(["tp_size=2"]) == ["tp_size=2", "hydra.run.dir=outputs/torchrun-x"]
    assert with_shared_run_dir(["hydra.run.dir=mine"]) == ["hydra.run.dir=mine"]
    assert with_shared_run_dir(["-m", "tp_size=1,2"]) == ["-m", "tp_size=1,2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    return build_default_corpus(
        tmp_path_factory.mktemp("corpus"), vocab_size=512, max_bytes=300_000, progress=False
    )


def _tiny(corpus, tmp_path, steps: int) -> list[str]:
    # tiny_overrides' run, with Hydra's folder left to the entry point (under tmp_path).
    return [
        o for o in tiny_overrides(corpus, tmp_path, max_steps=steps) if "hydra.run.dir" not in o
    ]


@pytest.mark.slow
def test_torchrun_leaves_one_run_folder(corpus, tmp_path):
    """torchrun --nproc-per-node 2 (a static rendezvous: no run id) leaves one Hydra
    folder, whose log holds the run's lines (Hydra's own clock gave each rank one when
    they started in different seconds)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        "-m",
        "engine.pretrain",
        "tp_size=1",
        "dp_size=2",
        *_tiny(corpus, tmp_path, 2),
    ]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env_with_repo(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    folders = [p.parent for p in (tmp_path / "outputs").rglob(".hydra")]
    assert len(folders) == 1, folders
    assert "step" in (folders[0] / "pretrain.log").read_text()
