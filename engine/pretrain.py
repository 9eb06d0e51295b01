"""``python -m engine.pretrain [overrides]``: pre-train GPT or BERT at any tp_size × dp_size.

- Under a launcher (torchrun, Slurm srun, mpirun) every process is one rank.
- Without one, when tp_size × dp_size > 1, the local worker processes are started here
  through PyTorch's elastic launcher API, exactly as ``torchrun --standalone`` would.
- Either way a failed worker can be restarted (``torchrun --max-restarts N``, or
  ``trainer.max_restarts=N`` here); the restarted workers resume from the newest checkpoint.

The config is validated, and the embedded corpus built, before any worker starts: a bad
config (a mistyped key included: the nearest real one is named) prints one line per problem,
exits with status 2 and leaves nothing on disk. The run then holds its checkpoint
directory's lock for its whole life: a second run on it is refused the same way. A worker that fails prints one
line (its traceback goes to the run log, ``pretrain.log`` in the run directory) and exits
non-zero: 3 when the run stopped itself (bad steps, a frozen or lost peer), 1 otherwise.
SIGTERM, SIGUSR1 or Ctrl-C save a checkpoint after the current step and exit with status 75
(engine/resilience/preemption.py); a second Ctrl-C exits at once with status 130.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from engine.config import Config, parallel_dims, register_configs, validate
from engine.config_cli import fail_config, model_overrides
from engine.observe import console_streams
from engine.optim import scale_lr
from engine.resilience.preemption import EXIT_PREEMPTED
from engine.worker import run_rank
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
        fail_config([str(err)])
    problems = validate(cfg, dims) + _step_limit_problem(cfg)
    if problems:
        fail_config(problems)
    from engine.data.fsutil import file_problem
    from engine.data.run_data import resolve_data

    if not cfg.data.prefixes and (problem := _cache_dir_problem(cfg)):
        fail_config(problem)  # the embedded default corpus is built (once) in the cache
    try:
        data = resolve_data(cfg.data)
    except ValueError as err:
        fail_config([str(err)])
    cfg = dataclasses.replace(
        cfg, dp_size=dims.dp, data=data, optim=scale_lr(cfg.optim, cfg.trainer)
    )
    if (problem := file_problem(cfg.data.tokenizer)) is not None:  # a FIFO would block the read
        fail_config([f"data.tokenizer: {cfg.data.tokenizer} {problem} (pass data.tokenizer=PATH)"])
    import parallel_state
    from engine.data.run_data import check_data
    from engine.inference import init_from_problems
    from engine.preflight import check_memory

    local_ranks = (info.local_world_size or 1) if info.launcher != "none" else dims.world
    try:
        backend = parallel_state.backend_for(cfg.trainer.device, local_ranks, warn=info.rank == 0)
    except ValueError as err:
        fail_config([str(err)])
    # The memory estimate is only worth giving for a config that is otherwise sound.
    problems = check_data(cfg) + _check_checkpoint_dir(cfg) + init_from_problems(cfg)
    problems = problems or check_memory(cfg, local_ranks, on_gpu=backend == "nccl")
    if problems:
        fail_config(problems)
    return cfg


def _cache_dir_problem(cfg: Config) -> list[str]:
    """The cache directory the default corpus is built in must be writable (it is locked
    there even when already built)."""
    from engine.data.default_corpus import default_cache_dir
    from engine.preflight import probe_writable

    given = cfg.data.cache_dir
    cache = Path(given) if given else default_cache_dir()
    problem = probe_writable(cache, directory=True)
    if not problem:
        return []
    where = f"data.cache_dir={cache}" if given else f"the corpus cache {cache}"
    return [
        f"{where} cannot hold the embedded default corpus: {problem} (pass data.cache_dir=DIR "
        "or set MESHTRON_CACHE, or data.prefixes=[PREFIX] for your own data)"
    ]


def _check_checkpoint_dir(cfg: Config) -> list[str]:
    """The checkpoint directory must be writable, and a fresh start must not clobber a run."""
    from engine.checkpoint import checkpoint_dir
    from engine.checkpoint.storage import step_dirs
    from engine.preflight import probe_writable

    root = Path(checkpoint_dir(cfg))
    problem = probe_writable(root, directory=True)
    if problem:
        return [f"checkpoint.dir={root} is not writable: {problem}"]
    metrics = cfg.trainer.metrics_file
    problem = metrics and probe_writable(Path(metrics), directory=False)
    if problem:
        return [f"trainer.metrics_file={metrics} cannot be written: {problem}"]
    steps = sorted(step_dirs(root))
    if steps and not cfg.checkpoint.resume:
        return [
            f"checkpoint.resume=false but {root} already holds checkpoints (steps "
            f"{', '.join(map(str, steps))}) that a fresh run would replace; choose another "
            "checkpoint.dir, or delete that directory first"
        ]
    return _resume_problem(cfg, root)


def _step_limit_problem(cfg: Config) -> list[str]:
    """A run whose later checkpoints would be named past the step directories' digits (the
    storage's rule, checked here: engine.config cannot import the storage back)."""
    from engine.checkpoint.storage import MAX_STEP, STEP_DIGITS
    from engine.config import INT64_MAX

    steps = cfg.trainer.max_steps
    if cfg.checkpoint.every < 1 or not MAX_STEP < steps <= INT64_MAX:
        return []  # past 64 bits is validate's line
    return [
        f"trainer.max_steps={steps} is past the last step a checkpoint directory can name "
        f"({MAX_STEP}, {STEP_DIGITS} digits): later checkpoints would never be found again; "
        f"give trainer.max_steps <= {MAX_STEP}, or checkpoint.every=0 (no checkpoints)"
    ]


def _resume_problem(cfg: Config, root: Path) -> list[str]:
    """One line when the checkpoint this run would resume from holds another model: one
    of the keys a resume keeps (engine/models/config.py RESUME_FIXED) changed."""
    from engine.checkpoint.manager import newest_index, unusable_checkpoints
    from engine.models.config import ModelConfig

    found = newest_index(root) if cfg.checkpoint.resume else None
    if found is None:
        damaged = unusable_checkpoints(root) if cfg.checkpoint.resume else []
        if not damaged:
            return []
        more = f" (and {len(damaged) - 1} older)" if len(damaged) > 1 else ""
        return [
            f"checkpoint.dir={root} holds no usable checkpoint to resume: {damaged[0]}{more}; "
            "delete the damaged step directories, or give this run another checkpoint.dir"
        ]
    try:
        saved = ModelConfig.from_dict(found[1]["model_config"])
    except (TypeError, ValueError):
        return []  # a malformed model_config is the loader's to report (and to fall back from)
    changes = cfg.model.resume_changes(saved)
    if not changes:
        index = found[1]
        saved = index.get("trainer_state", {}).get("config")
        return finished_run_problem(cfg, saved, index.get("step"), root)
    differ = "; ".join(f"model.{key}={old!r}, the model {new!r}" for key, old, new in changes)
    back = model_overrides(cfg.model, saved)
    return [
        f"checkpoint.dir={root} holds a run of another model (checkpoint has {differ}, step "
        f"{found[1]['step']}); set {back} back to resume it, or give this run its own "
        "name=NAME or checkpoint.dir=DIR, or delete that directory"
    ]


# Keys that may differ between a run and the same run started again: where its logs go.
_RERUN_FREE = frozenset({"run_dir"})
# Keys every rank resolves from None ("auto") before its checkpoints record the config
# (engine/worker.py): None here is the same setting as whatever the run resolved it to.
_AUTO_IN_RANK = frozenset({"model.compile"})


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def finished_run_problem(cfg: Config, saved: object, step: object, root: Path) -> list[str]:
    """One line when the run this one would resume (its config ``saved``, as the checkpoint
    records it, at ``step``, in ``root``) has already trained its steps under another
    config: it would find the finished run, train nothing and exit 0 (a layout or data
    change after the quick start did exactly that). The same command again is fine: it says
    there is nothing to train. Pure: tests/test_readme_order.py applies the same rule."""
    if not isinstance(step, int) or step < cfg.trainer.max_steps or not isinstance(saved, dict):
        return []
    mine, theirs = _flat(dataclasses.asdict(cfg)), _flat(saved)
    differ = [
        k
        for k in mine
        if k not in _RERUN_FREE
        and k in theirs
        and mine[k] != theirs[k]
        and not (k in _AUTO_IN_RANK and mine[k] is None)
    ]
    if not differ:
        return []
    shown = ", ".join(f"{k}={theirs[k]!r} (this run: {mine[k]!r})" for k in differ[:3])
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    return [
        f"checkpoint.dir={root} holds a finished run (step {step}, trainer.max_steps="
        f"{cfg.trainer.max_steps}) of another config: {shown}{more}; this run would train "
        "nothing: give it its own name=NAME (or checkpoint.dir=DIR), or raise "
        "trainer.max_steps to continue that run"
    ]


def launch(cfg: Config) -> dict:
    """Run the job on this process, or start tp × dp local workers if no launcher did."""
    dims = parallel_dims(cfg, None)  # dp_size is resolved by ``prepare``
    world = dims.world
    if detect_launch().launcher != "none" or world == 1:
        return run_rank(cfg)
    # Starting and joining the ranks takes a while on a busy machine: say so at once.
    cp = f" × cp={dims.cp}" if dims.cp > 1 else ""
    print(f"starting {world} local ranks (tp={dims.tp} × dp={dims.dp}{cp} × pp={dims.pp}) ...")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine.checkpoint import checkpoint_dir
    from engine.launching import launch_workers
    from engine.resilience.elastic_report import reporting, resume_step
    from engine.resilience.watchdog import run_log_path

    with reporting(cfg.run_dir, lambda: resume_step(checkpoint_dir(cfg))) as report:
        try:
            results = launch_workers(
                run_rank, cfg, nproc_per_node=world, max_restarts=cfg.trainer.max_restarts
            )
        except SignalException as err:
            # The agent passed the signal on to the workers, which saved and said so.
            return {"stopped_by": signal.Signals(err.sigval).name}
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            report.failure = (rank, failure.exitcode)
            # The kernel's out-of-memory killer sends SIGKILL, and the memory check before
            # the launch is a floor (estimate_rank_bytes): say what to look at and change.
            oom = (
                "; SIGKILL is the out-of-memory killer's signal (dmesg says if it was): a "
                "smaller trainer.micro_batch or data.seq_len needs less memory"
                if failure.exitcode == -signal.SIGKILL
                else ""
            )
            print(
                f"{report.who()}; no restart left (trainer.max_restarts="
                f"{cfg.trainer.max_restarts}); details in {run_log_path(cfg.run_dir)}{oom}",
                file=sys.stderr,
            )
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
    with refused_leaves_nothing(cfg.run_dir):
        cfg = prepare(cfg)
        lock = checkpoint_lock(cfg)
    try:
        with lock:
            summary = launch(cfg)
    except KeyboardInterrupt:
        from engine.checkpoint import checkpoint_dir

        print(
            f"interrupted by a second Ctrl-C: not saved; the checkpoints in "
            f"{checkpoint_dir(cfg)} are intact (a partial one is discarded)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    if summary.get("stopped_by"):
        # Saved and said so: a Ctrl-C from here on ends the process at once, as it ends any
        # program, instead of a KeyboardInterrupt traceback from an exit handler (torch's).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        raise SystemExit(EXIT_PREEMPTED)  # the sbatch template requeues on this status
    if summary.get("history"):
        line = loss_summary(summary["history"])
        print(line)
        from engine.resilience.watchdog import append_run_log

        append_run_log(cfg.run_dir, line)


def loss_summary(history: list[tuple[int, float]]) -> str:
    """The run's last console line: its first and last logged (step, loss), or the one
    where a short run or resume logged a single step."""
    (first_step, first), (last_step, last) = history[0], history[-1]
    line = f"loss {first:.4f} (step {first_step})"
    return line if last_step == first_step else f"{line} -> {last:.4f} (step {last_step})"


@contextlib.contextmanager
def refused_leaves_nothing(run_dir: str) -> Iterator[None]:
    """On a refusal (exit 2) inside, remove what Hydra made for this run in ``run_dir``
    (its ``.hydra`` record and an empty ``pretrain.log``) and the folders left empty
    (``outputs/DATE``), up to the working directory; an older run's files stay.

    Not when an outside launcher (srun, mpirun, torchrun) started this process as one of
    several ranks: they share the run directory and refuse each on its own, and one rank's
    removal would pull the directory from under another still opening its log there (a
    traceback instead of its one line). Such a refused run leaves its run directory."""
    launch = detect_launch()
    shared = launch.launcher != "none" and launch.world_size > 1
    try:
        yield
    except SystemExit as exit_:
        if exit_.code == 2 and not shared:
            _remove_fresh_run_dir(Path(run_dir))
        raise


def _remove_fresh_run_dir(run_dir: Path) -> None:
    log = run_dir / "pretrain.log"
    try:
        if set(os.listdir(run_dir)) - {".hydra", "pretrain.log"}:
            return
        if log.exists() and log.stat().st_size:
            return
        shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
        log.unlink(missing_ok=True)
        cwd, folder = Path.cwd().resolve(), run_dir.resolve()
        while folder != cwd and cwd in folder.parents and not os.listdir(folder):
            folder.rmdir()
            folder = folder.parent
    except OSError:
        pass  # best effort: the refusal's line matters more than its leftovers


def checkpoint_lock(cfg: Config) -> contextlib.AbstractContextManager:
    """The lock on the checkpoint directory, taken here (before any worker starts) by the
    process that lives as long as the run: the launching process, or rank 0 under an
    outside launcher. Another run holding it is a refusal (exit 2) naming that run."""
    from engine.checkpoint import checkpoint_dir
    from engine.checkpoint.manager import CheckpointDirBusy, CheckpointDirLock

    if detect_launch().rank != 0:
        return contextlib.nullcontext()
    lock = CheckpointDirLock(checkpoint_dir(cfg), run_dir=cfg.run_dir)
    try:
        lock.acquire(log=print)
    except CheckpointDirBusy as err:
        fail_config([str(err)])
    return lock


def print_help(argv: list[str]) -> None:
    """``--help``: every key with its default (as composed with ``argv``) and its doc."""
    from hydra import compose, initialize_config_dir

    from engine.config_cli import CONFIGS, help_text

    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        print(help_text(OmegaConf.to_object(compose("config", overrides=overrides))))


def cli() -> None:
    """The command line: ``--help``, unknown keys (with the nearest real one), an unusable
    run directory and Hydra's own errors become one line and exit 2 before anything runs."""
    from engine.config_cli import run_checked, sweep_problems
    from engine.tool_args import run_tool
    from parallel_state.launcher import launch_env_problem

    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        run_tool(lambda: print_help([a for a in argv if a not in ("--help", "-h")]))
    console_streams()  # a run outlives its console's reader; --help does not
    # Hydra takes its flags before the overrides; a sweep's -m is often typed among them.
    sweep = [a for a in argv if a in ("-m", "--multirun")]
    argv = sweep + [a for a in argv if a not in sweep]
    if problem := launch_env_problem():  # the shared run directory reads the launcher's
        fail_config([problem])
    if sweep and (problems := sweep_problems(argv)):  # before the first job, not at the bad one
        fail_config(problems)
    sys.argv[1:] = argv = with_shared_run_dir(argv)
    run_checked(main, argv, fail_config)


def with_shared_run_dir(argv: list[str]) -> list[str]:
    """``argv`` naming the run directory all ranks of an outside launcher's job share
    (``engine.launching.shared_run_dir``), unless it names one or sweeps (``-m``)."""
    from engine.launching import shared_run_dir

    if any(a.startswith("hydra.run.dir=") or a in ("-m", "--multirun") for a in argv):
        return argv
    shared = shared_run_dir()
    return argv if shared is None else [*argv, f"hydra.run.dir={shared}"]


if __name__ == "__main__":
    cli()
