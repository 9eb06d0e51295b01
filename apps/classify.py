"""``python -m apps.classify``: a Fashion-MNIST MLP, data (and tensor) parallel, trained
until its test accuracy reaches a target.

The tutorials' flags are aliases of Hydra keys (``--help`` lists them)::

    python -m apps.classify --num-gpus 4 --target-accuracy 0.85 --batch-size 64
    MASTER_ADDR=node0 MASTER_PORT=29400 python -m apps.classify --num-nodes 2 --node-id 1 --num-gpus 4

Without a launcher it starts ``num_gpus`` local ranks itself (torchrun-style, several nodes
through a static rendezvous at MASTER_ADDR:MASTER_PORT); under torchrun, srun or mpirun
every process is one rank. The config and the data set are checked before any rank starts
(one line per problem, exit status 2). The run ends with exactly one line,
``reached test accuracy A at epoch E in T s`` (exit 0) or ``did not reach ...`` (exit 1).
"""

from __future__ import annotations

import math
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from apps.classify_config import ClassifyConfig, register_classify_configs
from engine.config import INT64_MAX, MAX_LR, numbers_out_of_range, sized_dims
from engine.config_cli import fail_config
from parallel_state.dims import LayoutError
from parallel_state.launcher import DEFAULT_MASTER_PORT, detect_launch

register_classify_configs()

# Tutorial flag -> Hydra key. Each takes one value: --flag V or --flag=V.
ALIASES = {
    "--num-nodes": "launch.num_nodes",
    "--node-id": "launch.node_id",
    "--num-gpus": "launch.ranks_per_node",
    "--target-accuracy": "trainer.target_accuracy",
    "--batch-size": "trainer.batch_size",
    "--epochs": "trainer.epochs",
    "--lr": "trainer.lr",
    "--tp-size": "tp_size",
}


def translate_aliases(argv: list[str]) -> list[str]:
    """``argv`` with every tutorial flag rewritten as its ``key=value`` Hydra override."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in ALIASES:
            if not eq:
                if i + 1 >= len(argv):
                    fail_config([f"{flag} needs a value ({flag} N), it sets {ALIASES[flag]}"])
                value, i = argv[i + 1], i + 1
            arg = f"{ALIASES[flag]}={value}"
        out.append(arg)
        i += 1
    return out


def layout(cfg: ClassifyConfig) -> tuple[int, int, int]:
    """(world size, dp size, ranks per node) of this run, or exit 2 naming the mismatch."""
    info, launch, tp = detect_launch(), cfg.launch, cfg.tp_size
    bad = [
        f"{key}={value} must be >= 1"
        for key, value in (
            ("launch.num_nodes", launch.num_nodes),
            # None: tp × dp; 0 is a value, and refused (it ran one rank before)
            (
                "launch.ranks_per_node",
                1 if launch.ranks_per_node is None else launch.ranks_per_node,
            ),
        )
        if value < 1
    ]
    try:
        asked = sized_dims(tp, cfg.dp_size)  # dp_size=auto: 1 until the world is known
    except LayoutError as err:
        bad.insert(0, str(err))
    if bad:
        fail_config(bad)
    if info.launcher != "none":
        world, per_node = info.world_size, info.local_world_size or info.world_size
    else:
        per_node = launch.ranks_per_node or max(1, asked.world // launch.num_nodes)
        world = per_node * launch.num_nodes
    try:
        dims = sized_dims(tp, cfg.dp_size, world)
    except LayoutError as err:
        nodes = f"{launch.num_nodes} node{'s' * (launch.num_nodes != 1)}"
        fail_config([f"{err}; the run has {nodes} × {per_node} ranks per node"])
    return world, dims.dp, per_node


def validate(cfg: ClassifyConfig, dp_size: int) -> list[str]:
    """Every problem of ``cfg`` at this layout, one line each."""
    from apps.classify_loop import DTYPES, steps_per_epoch

    t, launch, problems = cfg.trainer, cfg.launch, []
    checks = [
        (
            cfg.model.hidden_size % cfg.tp_size == 0,
            f"model.hidden_size={cfg.model.hidden_size} is not divisible by tp_size={cfg.tp_size}",
        ),
        (
            cfg.model.dtype in DTYPES,
            f"model.dtype={cfg.model.dtype!r} is not one of {list(DTYPES)}",
        ),
        (t.batch_size >= 1, f"trainer.batch_size={t.batch_size} must be >= 1"),
        (t.epochs >= 1, f"trainer.epochs={t.epochs} must be >= 1"),
        (
            0 < t.target_accuracy <= 1,
            f"trainer.target_accuracy={t.target_accuracy} must be in (0, 1]",
        ),
        (t.lr > 0, f"trainer.lr={t.lr} must be > 0"),
        (
            t.lr_scaling in ("none", "linear"),
            f"trainer.lr_scaling={t.lr_scaling!r} is not none or linear",
        ),
        (
            0 <= launch.node_id < launch.num_nodes,
            f"launch.node_id={launch.node_id} must be in [0, launch.num_nodes={launch.num_nodes})",
        ),
    ]
    problems += [message for ok, message in checks if not ok]
    problems += _validate_values(cfg, problems)
    train_images = cfg.data.train_subset or 60_000
    subset_ok = cfg.data.train_subset >= 0  # a negative subset is refused above
    if t.batch_size >= 1 and subset_ok and steps_per_epoch(train_images, t.batch_size, dp_size) < 1:
        problems.append(
            f"trainer.batch_size={t.batch_size} × dp_size={dp_size} exceeds the {train_images} "
            "training images: not one step per epoch"
        )
    return problems


def _validate_values(cfg: ClassifyConfig, reported: list[str]) -> list[str]:
    """Ranges no other check covers, then every number's type range (64 bits, finite)."""
    from pathlib import Path

    from engine.preflight import probe_writable

    t, launch, problems = cfg.trainer, cfg.launch, []
    checks = [
        (t.lr <= MAX_LR, f"trainer.lr={t.lr} must be in (0, {MAX_LR:g}]"),
        (0 <= t.momentum < 1, f"trainer.momentum={t.momentum} must be in [0, 1)"),
        (0 <= t.seed <= INT64_MAX, f"trainer.seed={t.seed} must be in [0, 2**63-1]"),
        (t.grad_bucket_mb > 0, f"trainer.grad_bucket_mb={t.grad_bucket_mb} must be > 0"),
        (t.threads >= 0, f"trainer.threads={t.threads} must be >= 0 (0: the core share)"),
        (
            0 < launch.rendezvous_timeout_s < math.inf,
            f"launch.rendezvous_timeout_s={launch.rendezvous_timeout_s} must be > 0 and finite",
        ),
        (
            cfg.data.train_subset >= 0 and cfg.data.test_subset >= 0,
            f"data.train_subset={cfg.data.train_subset} and data.test_subset="
            f"{cfg.data.test_subset} must be >= 0 (0: all)",
        ),
    ]
    problems += [message for ok, message in checks if not ok]
    problem = t.metrics_file and probe_writable(Path(t.metrics_file), directory=False)
    if problem:
        problems.append(f"trainer.metrics_file={t.metrics_file} cannot be written: {problem}")
    return problems + numbers_out_of_range(cfg, reported + problems)


def launch(cfg: ClassifyConfig, per_node: int) -> dict:
    """Run here under a launcher (or alone), else start this node's ranks; a rank's summary."""
    from apps.classify_loop import run_worker

    info = detect_launch()
    if info.launcher != "none" or per_node * cfg.launch.num_nodes == 1:
        return run_worker(cfg)
    from engine.launching import launch_workers

    launch = cfg.launch
    addr = launch.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = launch.master_port or int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    results = launch_workers(
        run_worker,
        cfg,
        nproc_per_node=per_node,
        num_nodes=launch.num_nodes,
        node_rank=launch.node_id,
        master_addr=addr,
        master_port=port,
    )
    return results[min(results)]


def final_line(summary: dict) -> str:
    """The closing line that scripts and tutorials grep for."""
    if summary["reached"]:
        return (
            f"reached test accuracy {summary['test_accuracy']:.4f} at epoch "
            f"{summary['epochs']} in {summary['time_to_accuracy_s']:.2f} s"
        )
    epochs = summary["epochs"]
    return (
        f"did not reach test accuracy {summary['target_accuracy']} in {epochs} "
        f"epoch{'s' * (epochs != 1)}: {summary['test_accuracy']:.4f} after "
        f"{summary['elapsed_s']:.2f} s"
    )


@hydra.main(config_path="../configs", config_name="classify", version_base=None)
def main(dcfg: DictConfig) -> None:
    cfg: ClassifyConfig = OmegaConf.to_object(dcfg)
    _world, dp_size, per_node = layout(cfg)
    problems = validate(cfg, dp_size)
    from engine.data import fashion_mnist

    try:
        fashion_mnist.find_files(cfg.data.dir)
    except FileNotFoundError as err:
        problems.append(str(err))
    if problems:
        fail_config(problems)
    cfg.dp_size = dp_size
    summary = launch(cfg, per_node)
    if detect_launch().rank != 0:  # under a launcher, rank 0 speaks for the run
        raise SystemExit(0 if summary["reached"] else 1)
    seconds = summary["time_to_accuracy_s"]
    reached = f"time to accuracy {seconds:.2f} s" if seconds else "target accuracy not reached"
    epochs = summary["epochs"]
    print(
        f"{reached}, {summary['images_per_s']:.0f} training images/s over {epochs} "
        f"epoch{'s' * (epochs != 1)}"
    )
    print(final_line(summary), flush=True)
    if not summary["reached"]:
        raise SystemExit(1)


def cli() -> None:
    """The command line: tutorial flags, then unknown keys (with the nearest real one), an
    unusable run directory and Hydra's own errors as one line, exit 2."""
    from engine.config_cli import run_checked
    from engine.observe import console_streams

    console_streams()
    sys.argv = sys.argv[:1] + translate_aliases(sys.argv[1:])
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        main()  # Hydra's help, with the tutorial flags' template
        return
    run_checked(
        main, argv, fail_config, schema=ClassifyConfig, prog="apps.classify", default_run_dir="."
    )


if __name__ == "__main__":
    cli()
