"""README commands run one after another in one clone each do what their text says.

Every ``engine.pretrain`` run without its own ``name=`` checkpoints into the quick start's
folder (``checkpoints/<name>``), where the launcher refuses another model and a finished
run's other config, and trains nothing when the same finished command comes again. This
test composes each command of the README and of the docs/ pages holding its moved commands
with Hydra, in reading order (``tests.test_readme.reading_order``: the README, then each
page in the order the README links it; launchers' commands included: torchrun, srun and
mpirun start the same entry point), and follows the
checkpoint folders on paper: no training runs. Each must also pass the config checks
(``engine.config.validate``), its data files aside. A command may be refused only where the
README says so (its exit status 2 in ``tests/test_readme.py``'s ``RUN``), and then by the
refusal the README shows, not by its checkpoint folder.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from engine.checkpoint import checkpoint_dir
from engine.config import Config, parallel_dims, validate
from engine.pretrain import finished_run_problem, per_job_checkpoints
from tests.test_readme import ROOT, RUN, _program_args, readme_commands_in_order

# A checkpoint folder on paper: the config of the last run there and the step it reached.
Folders = dict[str, tuple[Config, int]]


def _config(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=overrides))


def _checkpoint_refusal(cfg: Config, folders: Folders) -> list[str]:
    """The launcher's refusals for the checkpoint folder ``cfg`` would resume
    (engine/pretrain.py ``_resume_problem``), against the folder as simulated."""
    root = checkpoint_dir(cfg)
    if root not in folders:
        return []
    saved, step = folders[root]
    changes = cfg.model.resume_changes(saved.model)
    if changes:
        return [f"{root} holds a run of another model: {changes}"]
    return finished_run_problem(cfg, dataclasses.asdict(saved), step, Path(root))


def _sweep_jobs(args: list[str]) -> list[list[str]]:
    """The override lists of a Hydra multirun (``-m key=a,b``), one per job."""
    jobs = [[]]
    for arg in args:
        values = arg.split("=", 1)[1].split(",") if "," in arg and "=" in arg else None
        options = [arg.split("=")[0] + "=" + v for v in values] if values else [arg]
        jobs = [job + [option] for job in jobs for option in options]
    return jobs


def simulate(commands: list[str]) -> list[str]:
    """What goes wrong when ``commands`` run in this order in one clone, one line each."""
    folders: Folders = {}
    problems = []
    for command in commands:
        found = _program_args(command)
        if "…" in command or found is None or found[0] != "engine.pretrain":
            continue  # abbreviated on purpose (test_readme maps it), or not a training run
        args = found[1]
        if "-m" in args:
            jobs = _sweep_jobs([a for a in args if a != "-m"])
            given = any(a.startswith("checkpoint.dir=") for a in args)
            if not given or all(
                "${hydra:job." in a for a in args if a.startswith("checkpoint.dir=")
            ):
                for job in jobs:  # each job its own folder: per_job_checkpoints, or the given
                    assert given or per_job_checkpoints(
                        dataclasses.replace(_config(job), run_dir="outputs/sweep/0"), True
                    ).checkpoint.dir.startswith("outputs/sweep/0"), command
                continue
            runs = [(command + f"  [job {i}]", job) for i, job in enumerate(jobs)]
        else:
            runs = [(command, args)]
        for shown, overrides in runs:
            problems += _run_on_paper(shown, _config(overrides), RUN.get(command, 0), folders)
    return problems


def _own_file(problem: str) -> bool:
    """A data file that the README's preprocessing commands make, or the reader brings: not
    here, and not this test's to judge."""
    return problem.startswith(("data.prefixes: ", "data.tokenizer: "))


def _run_on_paper(command: str, cfg: Config, status: int, folders: Folders) -> list[str]:
    refusal = _checkpoint_refusal(cfg, folders)
    if status == 2:  # the README shows its refusal: it must be that one, not the folder's
        invalid = validate(cfg, parallel_dims(cfg, None))
        if refusal and not invalid:
            return [f"{command!r} is refused by its checkpoint folder first: {refusal[0]}"]
        return []  # a refused run writes nothing
    if refusal:
        return [f"{command!r} is refused: {refusal[0]}"]
    invalid = [line for line in validate(cfg, parallel_dims(cfg, None)) if not _own_file(line)]
    if invalid:
        return [f"{command!r} is refused: {invalid[0]}"]
    root = checkpoint_dir(cfg)
    if root in folders and folders[root][1] >= cfg.trainer.max_steps:
        return [
            f"{command!r} trains nothing: {root} already reached step {folders[root][1]} "
            f"(trainer.max_steps={cfg.trainer.max_steps})"
        ]
    folders[root] = (cfg, cfg.trainer.max_steps)
    return []


@pytest.mark.slow
def test_readme_commands_in_order_neither_refused_nor_idle():
    commands = readme_commands_in_order()
    trained = [c for c in commands if "engine.pretrain" in shlex.split(c) and "…" not in c]
    assert len(trained) >= 15, trained  # the extraction found the README's training runs
    problems = simulate(commands)
    assert not problems, "\n".join(problems)


def test_the_simulation_catches_a_shared_folder():
    """The rule itself: after the quick start, a layout change in its folder is refused, the
    same command again trains nothing, and a raised trainer.max_steps resumes."""
    base = "python -m engine.pretrain"
    assert simulate([base, base + " tp_size=4 dp_size=1"])[0].endswith(
        "raise trainer.max_steps to continue that run"
    )
    assert "trains nothing" in simulate([base, base])[0]
    assert "another model" in simulate([base, base + " model.num_layers=4"])[0]
    assert not simulate([base, base + " tp_size=4 dp_size=1 trainer.max_steps=160"])
    assert not simulate([base, base + " tp_size=4 dp_size=1 name=tp4"])
    assert "num_heads=4 is not divisible by tp_size=8" in simulate([base + " tp_size=8"])[0]
