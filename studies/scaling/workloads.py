"""What a study point runs: a table of command builders, one per workload.

A builder turns a point into ``python -m MODULE overrides...``; the run must honour
``trainer.metrics_file`` (the per-run JSON every workload writes, see engine/step_timer.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from studies.runs import STEPS_ONLY


@dataclass(frozen=True)
class Point:
    """One configuration of a study (the ``results.csv`` key columns)."""

    nodes: int
    procs_per_node: int
    tp_size: int
    dp_size: int
    micro_batch: int
    global_batch: int
    pp_size: int = 1
    schedule: str = "1f1b"  # the pipeline schedule (pp_size > 1)
    virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b)
    cp_size: int = 1  # context-parallel ranks splitting each sequence

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size * self.pp_size * self.cp_size

    @property
    def microbatches(self) -> int:
        """Micro-batches per step and DP rank: the pipeline schedule's m."""
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def layout(self) -> str:
        """``tp=T`` (``tp=T cp=C`` with context parallelism), and through a pipeline
        ``tp=T pp=P schedule`` (``v=V`` interleaved)."""
        model = f"tp={self.tp_size}" + (f" cp={self.cp_size}" if self.cp_size > 1 else "")
        if self.pp_size == 1:
            return model
        virtual = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{model} pp={self.pp_size} {self.schedule}{virtual}"

    @property
    def key(self) -> str:
        key = (
            f"n{self.nodes}x{self.procs_per_node}-tp{self.tp_size}-dp{self.dp_size}"
            f"-mb{self.micro_batch}-gb{self.global_batch}"
        )
        if self.pp_size > 1:  # pp 1 keeps the keys of studies made before the axis
            key += f"-pp{self.pp_size}-{self.schedule}"
            key += f"-v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return key + (f"-cp{self.cp_size}" if self.cp_size > 1 else "")


@dataclass(frozen=True)
class RunSpec:
    """How long a point trains and what else it is given."""

    model: str | None  # a configs/model preset, None: the workload's default
    overrides: tuple[str, ...]  # Hydra overrides passed through
    steps: int  # measured steps
    warmup: int  # steps run first and left out of the figures


Builder = Callable[[Point, RunSpec, Path, Path], list[str]]


def pretrain_command(point: Point, spec: RunSpec, metrics: Path, run_dir: Path) -> list[str]:
    """``engine.pretrain`` for warmup + steps, with everything but the steps switched off."""
    argv = ["-m", "engine.pretrain"]
    if spec.model:
        argv.append(f"model={spec.model}")
    argv += [
        f"tp_size={point.tp_size}",
        f"dp_size={point.dp_size}",
        f"trainer.micro_batch={point.micro_batch}",
        f"trainer.global_batch={point.global_batch}",
        *pipeline_overrides(point),
        *([f"cp_size={point.cp_size}"] if point.cp_size > 1 else []),
        f"trainer.max_steps={spec.warmup + spec.steps}",
        f"trainer.log_every={spec.warmup + spec.steps}",
        f"trainer.metrics_file={metrics}",
        *STEPS_ONLY,
        f"checkpoint.dir={run_dir}/ckpt",
        f"hydra.run.dir={run_dir}",
        "hydra.output_subdir=null",
    ]
    return argv + list(spec.overrides)


def pipeline_overrides(point: Point) -> list[str]:
    """The pipeline keys of a point (none at pp 1, so those commands stay as they were)."""
    if point.pp_size == 1:
        return []
    return [
        f"pp_size={point.pp_size}",
        f"pipeline.schedule={point.schedule}",
        f"pipeline.virtual_stages={point.virtual_stages}",
    ]


def classify_command(point: Point, spec: RunSpec, metrics: Path, run_dir: Path) -> list[str]:
    """``apps.classify`` (Fashion-MNIST) until its target accuracy or ``trainer.epochs``.

    Its ``trainer.batch_size`` is images per DP rank per step: the point's global batch split
    over dp (in weak mode that global batch is already ``--global-batch`` × dp). It has no
    step count: ``spec.steps`` is unused, and ``spec.warmup`` only drops the first step
    records from the step-time figures; time to accuracy comes from the run's summary.
    """
    if importlib.util.find_spec("apps.classify") is None:
        raise RuntimeError("apps.classify is not in this checkout: --workload classify needs it")
    if point.global_batch % point.dp_size:
        raise ValueError(
            f"global batch {point.global_batch} is not divisible by dp={point.dp_size}: "
            "choose a --global-batch that every dp size divides"
        )
    if point.pp_size > 1:
        raise ValueError(f"pp={point.pp_size}: the classify workload has no pipeline; use --pp 1")
    if point.cp_size > 1:
        raise ValueError(f"cp={point.cp_size}: the classify workload has no sequence; use --cp 1")
    if spec.model:
        raise ValueError(
            f"--model {spec.model}: the classify workload has one model; set its "
            "width with the override model.hidden_size=N"
        )
    argv = ["-m", "apps.classify"]
    argv += [
        f"tp_size={point.tp_size}",
        f"dp_size={point.dp_size}",
        f"trainer.batch_size={point.global_batch // point.dp_size}",
        f"trainer.metrics_file={metrics}",
        "trainer.progress=false",
        f"hydra.run.dir={run_dir}",
        "hydra.output_subdir=null",
    ]
    return argv + list(spec.overrides)


WORKLOADS: dict[str, Builder] = {"pretrain": pretrain_command, "classify": classify_command}

# The keys each workload's command sets from the grid or the study, with the flag that sets
# them (None: the study's own bookkeeping). Given again among the overrides, they would run
# every point at one value while results.csv labels it by the grid's.
_PRETRAIN_GRID = {
    "tp_size": "--tp",
    "dp_size": "--dp",
    "pp_size": "--pp",
    "cp_size": "--cp",
    "parallel.tp": "--tp",
    "parallel.dp": "--dp",
    "parallel.pp": "--pp",
    "parallel.cp": "--cp",
    "model": "--model",
    "trainer.micro_batch": "--micro-batch",
    "trainer.global_batch": "--global-batch",
    "pipeline.schedule": "--schedule",
    "pipeline.virtual_stages": "--virtual-stages",
    "trainer.max_steps": "--steps and --warmup",
    "trainer.log_every": None,
    "trainer.metrics_file": None,
    "checkpoint.dir": None,
    "hydra.run.dir": None,
}
_CLASSIFY_GRID = {
    "tp_size": "--tp",
    "dp_size": "--dp",
    "parallel.tp": "--tp",
    "parallel.dp": "--dp",
    "trainer.batch_size": "--global-batch",
    "trainer.metrics_file": None,
    "hydra.run.dir": None,
}
GRID_KEYS = {"pretrain": _PRETRAIN_GRID, "classify": _CLASSIFY_GRID}


def grid_key_problem(workload: str, overrides: list[str]) -> str | None:
    """One line for an override of a key the study sets itself, naming the flag to use."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key not in GRID_KEYS[workload]:
            continue
        flag = GRID_KEYS[workload][key]
        if flag is None:
            return (
                f"{override} among the overrides: the study sets {key} for each point "
                "itself (its files go under --out); drop it"
            )
        value = override.split("=", 1)[1] if "=" in override else ""
        instead = f"{flag} {value}" if flag.startswith("--") and " " not in flag else flag
        return (
            f"{override} among the overrides would run every point at it while the study "
            f"labels each by {flag}: drop it and give {instead} instead"
        )
    return None
