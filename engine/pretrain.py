"""``python -m engine.pretrain [overrides]``: pre-train GPT or BERT at any tp_size × dp_size.

- Under a launcher (torchrun, Slurm srun, mpirun) every process is one rank.
- Without one, when tp_size × dp_size > 1, the local worker processes are started here
  through PyTorch's elastic launcher API, exactly as ``torchrun --standalone`` would.
- Either way a failed worker can be restarted (``torchrun --max-restarts N``, or
  ``trainer.max_restarts=N`` here); the restarted workers resume from the newest checkpoint.

The config is validated, and the embedded corpus built, before any worker starts: a bad
config prints one line per problem and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from engine.config import Config, register_configs, resolve_dp_size, validate
from parallel_state.launcher import detect_launch

register_configs()


def prepare(cfg: Config) -> Config:
    """Validate ``cfg`` for the launch at hand and resolve dp_size and the data paths.

    Raises SystemExit(2) after printing every problem, one line each.
    """
    info = detect_launch()
    world = info.world_size if info.launcher != "none" else None
    try:
        dp_size = resolve_dp_size(cfg, world)
    except ValueError as err:
        _fail([str(err)])
    problems = validate(cfg, dp_size, world)
    if problems:
        _fail(problems)
    from engine.data_setup import resolve_data

    cfg = dataclasses.replace(cfg, dp_size=dp_size, data=resolve_data(cfg.data))
    if not os.path.exists(cfg.data.tokenizer):
        _fail([f"data.tokenizer: {cfg.data.tokenizer} does not exist (pass data.tokenizer=PATH)"])
    from engine.data_setup import check_data

    problems = check_data(cfg) + _check_checkpoint_dir(cfg)
    if problems:
        _fail(problems)
    if cfg.model.sequence_parallel and cfg.data.seq_len % cfg.tp_size:
        _fail([f"data.seq_len={cfg.data.seq_len} is not divisible by tp_size={cfg.tp_size} "
               "(needed by model.sequence_parallel=true)"])  # fmt: skip
    return cfg


def _check_checkpoint_dir(cfg: Config) -> list[str]:
    """The checkpoint directory must be writable, and a fresh start must not clobber a run."""
    from pathlib import Path

    from engine.checkpoint.storage import step_dirs
    from engine.trainer import checkpoint_dir

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
    return []


def _fail(problems: list[str]) -> None:
    for line in problems:
        print(f"config error: {line}", file=sys.stderr)
    raise SystemExit(2)


def launch(cfg: Config) -> dict:
    """Run the job on this process, or start tp × dp local workers if no launcher did."""
    from engine.trainer import run_worker

    world = cfg.tp_size * cfg.dp_size
    if detect_launch().launcher != "none" or world == 1:
        return run_worker(cfg)
    from engine.launching import launch_workers

    results = launch_workers(run_worker, cfg, nproc_per_node=world,
                             max_restarts=cfg.trainer.max_restarts)  # fmt: skip
    return results.get(0, {})


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dcfg)
    cfg = dataclasses.replace(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    summary = launch(prepare(cfg))
    if summary.get("history"):
        first, last = summary["history"][0], summary["history"][-1]
        print(f"loss {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]})")


if __name__ == "__main__":
    main()
