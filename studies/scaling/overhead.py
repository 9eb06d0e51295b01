"""What the step timer costs: steps with it on and off, interleaved in one run.

Run under a launcher, every rank one process of the mesh::

    torchrun --standalone --nproc-per-node 4 -m studies.scaling.overhead --steps 60 \\
        tp_size=2 dp_size=2

After ``--warmup`` steps, consecutive steps alternate on/off in ABBA order (on, off, off,
on, ...) so drift in the machine's load hits both alike; rank 0 prints and writes
(``--out``) the medians and their ratio. It also times a no-op call with and without the
TP clock around it: the per-collective cost behind the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from engine.bootstrap import bootstrap_rank
from engine.config import parallel_dims, register_configs
from engine.pretrain import prepare
from layers.utils import timed

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def per_call_cost_s(calls: int = 200_000) -> dict[str, float]:
    """Seconds per call of a no-op "collective" with and without the TP clock around it:
    the instrumentation's own cost, free of the network's and the scheduler's noise."""
    from engine.step_timer import _Clock

    def noop(x, group=None):
        return x

    x, clock, best = torch.zeros(1), _Clock(torch.device("cpu")), {}
    for _ in range(3):
        for name, timer in (("plain_s", None), ("timed_s", clock)):
            start = time.perf_counter()
            for _ in range(calls):
                timed(timer, noop, x, group=None)
            best[name] = min(best.get(name, 1.0), (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="step timer overhead, on vs off")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=40, help="measured steps (half on)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", help="JSON written by rank 0")
    args = parser.parse_args(argv)
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        dcfg = compose(
            "config",
            overrides=[
                *args.overrides,
                "trainer.progress=false",
                "checkpoint.resume=false",
                "checkpoint.every=0",
            ],
        )
    cfg = prepare(OmegaConf.to_object(dcfg))
    from engine.trainer import Trainer

    with bootstrap_rank(lambda world: parallel_dims(cfg, world)) as ps:
        trainer = Trainer(cfg, ps)
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.warmup + args.steps):
            on = i % 4 in (0, 3)  # ABBA
            trainer.timer.enabled = on
            trainer.timer.attach(trainer.model, trainer.dp)
            step_time = trainer.train_step()["step_time"]
            trainer.step += 1
            if i >= args.warmup:
                times[on].append(step_time)
        cost = per_call_cost_s()
        result = {
            "tp_size": ps.tp_size,
            "dp_size": ps.dp_size,
            "steps_each": args.steps // 2,
            "median_on_s": statistics.median(times[True]),
            "median_off_s": statistics.median(times[False]),
            **cost,
        }
        result["overhead"] = result["median_on_s"] / result["median_off_s"] - 1
        if ps.rank == 0:
            print(json.dumps(result, indent=1))
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
