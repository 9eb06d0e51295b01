"""``python -m engine.pretrain [overrides]``: pre-train GPT or BERT at any tp_size × dp_size.

- Under a launcher (torchrun, Slurm srun, mpirun) every process is one rank.
- Without one, when tp_size × dp_size > 1, the local worker processes are started here
  through PyTorch's elastic launcher API, exactly as ``torchrun --standalone`` would.
- Either way a failed worker can be restarted (``torchrun --max-restarts N``, or
  ``trainer.max_restarts=N`` here); the restarted workers resume from the newest checkpoint.

The config is validated, and the embedded corpus built, before any worker starts: a bad
config prints one line per problem and exits with status 2. A worker that fails prints one
line (its traceback goes to the run log, ``pretrain.log`` in the run directory) and exits
non-zero: 3 when the run stopped itself (bad steps, a frozen or lost peer), 1 otherwise.
SIGTERM, SIGUSR1 or Ctrl-C save a checkpoint after the current step and exit with status 75
(engine/resilience/preemption.py); a second Ctrl-C exits at once with status 130.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from engine.config import Config, parallel_dims, register_configs, validate
from engine.optim import scale_lr
from engine.resilience.preemption import EXIT_PREEMPTED
from engine.resilience.watchdog import run_rank
from parallel_state.dims import LayoutError
from parallel_state.launcher import detect_launch

register_configs()


def prepare(cfg: Config) -> Config:
    """Validate ``cfg`` for the launch at hand and resolve dp_size and the data paths.

    Raises SystemExit(2) after printing every problem, one line each.
    """
    info = detect_launch()
    world = info.world_size if info.launcher != "none" else None
    try:
        dims = parallel_dims(cfg, world)
    except LayoutError as err:
        _fail([str(err)])
    problems = validate(cfg, dims)
    if problems:
        _fail(problems)
    from engine.data.pipeline import resolve_data

    cfg = dataclasses.replace(
        cfg, dp_size=dims.dp, data=resolve_data(cfg.data), optim=scale_lr(cfg.optim, cfg.trainer)
    )
    if not os.path.exists(cfg.data.tokenizer):
        _fail([f"data.tokenizer: {cfg.data.tokenizer} does not exist (pass data.tokenizer=PATH)"])
    import parallel_state
    from engine.data.pipeline import check_data
    from engine.preflight import check_memory

    local_ranks = (info.local_world_size or 1) if info.launcher != "none" else dims.world
    try:
        backend = parallel_state.backend_for(cfg.trainer.device, local_ranks, warn=info.rank == 0)
    except ValueError as err:
        _fail([str(err)])
    # The memory estimate is only worth giving for a config that is otherwise sound.
    problems = check_data(cfg) + _check_checkpoint_dir(cfg) or check_memory(
        cfg, local_ranks, on_gpu=backend == "nccl"
    )
    if problems:
        _fail(problems)
    return cfg


def _check_checkpoint_dir(cfg: Config) -> list[str]:
    """The checkpoint directory must be writable, and a fresh start must not clobber a run."""
    from pathlib import Path

    from engine.checkpoint import checkpoint_dir
    from engine.checkpoint.storage import step_dirs

    root = Path(checkpoint_dir(cfg))
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        return [f"checkpoint.dir={root} is not writable: {err.strerror or err}"]
    steps = sorted(step_dirs(root))
    if steps and not cfg.checkpoint.resume:
        return [f"checkpoint.resume=false but {root} already holds checkpoints (steps "
                f"{', '.join(map(str, steps))}) that a fresh run would replace; choose another "
                "checkpoint.dir, or delete that directory first"]  # fmt: skip
    from engine.preflight import check_resume_model

    return check_resume_model(cfg, root)


def _fail(problems: list[str]) -> None:
    for line in problems:
        print(f"config error: {line}", file=sys.stderr)
    raise SystemExit(2)


def launch(cfg: Config) -> dict:
    """Run the job on this process, or start tp × dp local workers if no launcher did."""
    world = parallel_dims(cfg, None).world  # dp_size is resolved by ``prepare``
    if detect_launch().launcher != "none" or world == 1:
        return run_rank(cfg)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine.checkpoint import checkpoint_dir
    from engine.launching import launch_workers
    from engine.resilience.elastic_report import reporting, resume_step
    from engine.resilience.watchdog import run_log_path

    with reporting(cfg.run_dir, lambda: resume_step(checkpoint_dir(cfg))) as report:
        try:
            results = launch_workers(run_rank, cfg, nproc_per_node=world,
                                     max_restarts=cfg.trainer.max_restarts)  # fmt: skip
        except SignalException as err:
            # The agent passed the signal on to the workers, which saved and said so.
            return {"stopped_by": signal.Signals(err.sigval).name}
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            report.failure = (rank, failure.exitcode)
            print(f"{report.who()}; no restart left (trainer.max_restarts="
                  f"{cfg.trainer.max_restarts}); details in {run_log_path(cfg.run_dir)}",
                  file=sys.stderr)  # fmt: skip
            raise SystemExit(1) from None
    return results.get(0, {})


def per_job_checkpoints(cfg: Config, multirun: bool) -> Config:
    """Under ``-m`` each job checkpoints into its own output directory, so no job of a sweep
    resumes from another's; a single run keeps the stable ``checkpoints/<name>``."""
    if not multirun or cfg.checkpoint.dir is not None:
        return cfg
    directory = os.path.join(cfg.run_dir, "checkpoints")
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=directory))


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dcfg)
    hydra_cfg = HydraConfig.get()
    cfg = dataclasses.replace(cfg, run_dir=hydra_cfg.runtime.output_dir)
    cfg = per_job_checkpoints(cfg, hydra_cfg.mode == RunMode.MULTIRUN)
    cfg = prepare(cfg)
    try:
        summary = launch(cfg)
    except KeyboardInterrupt:
        from engine.checkpoint import checkpoint_dir

        print(f"interrupted by a second Ctrl-C: not saved; the checkpoints in "
              f"{checkpoint_dir(cfg)} are intact (a partial one is discarded)", file=sys.stderr)  # fmt: skip
        raise SystemExit(130) from None
    if summary.get("stopped_by"):
        raise SystemExit(EXIT_PREEMPTED)  # the sbatch template requeues on this status
    if summary.get("history"):
        first, last = summary["history"][0], summary["history"][-1]
        line = f"loss {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]})"
        print(line)
        from engine.resilience.watchdog import append_run_log

        append_run_log(cfg.run_dir, line)


def cli() -> None:
    """The command line: Hydra's own override and composition errors become one line, exit 2.

    Hydra prints those errors over several lines and exits 1; asking it to raise them
    instead (HYDRA_FULL_ERROR, for this process only) lets them be reported like every
    other configuration error.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        _fail([hydra_error_line(err)])
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def hydra_error_line(err: BaseException) -> str:
    """Hydra's message and its cause's (OmegaConf's, naming the key), as one line."""
    override = getattr(err, "override", None)  # set on Hydra's override parse errors
    parts = [f"cannot parse the override {override!r}:"] if override else []
    for e in (err, err.__cause__):
        for line in str(e or "").split("Config search path")[0].splitlines():
            skip = ("object_type=", "reference_type=", "See https://hydra.cc")
            if line.strip() and not line.strip().startswith(skip):
                parts.append(line.strip())
    return " ".join(dict.fromkeys(parts)) or type(err).__name__


if __name__ == "__main__":
    cli()
