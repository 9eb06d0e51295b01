"""Training stall per checkpoint save: synchronous, meshtron's async_save, torch DCP's async_save.

One process trains a small GPT (``--preset``, tp=1, fp32, AdamW) on random tokens and
saves every ``--every`` steps, in rounds of each side in turn:

- ``sync``: ``engine.checkpoint.save_checkpoint`` (what ``checkpoint.async_save=false`` does);
- ``async``: ``stage_checkpoint(copy=True)`` + ``BackgroundSaver`` (``async_save=true``):
  the step waits for the previous save, copies to host memory, a thread writes and commits;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the model and optimizer
  tensors by name (no process group), the previous one's future awaited first.

The stall of a save is the time its call held the training loop (for the asynchronous
sides: waiting for the previous save, staging, starting the write); ``excess`` is what
the step that saved and the steps after it, until the next save, took above the median
step without a save (the stall plus what the write running beside them cost them: on a
busy shared CPU mostly noise). Medians
over the saves; the ratios to ``sync`` are printed.

    python -m studies.bench.async_checkpoint --preset gpt_tiny --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from engine.checkpoint import save_checkpoint
from engine.checkpoint.background import BackgroundSaver
from engine.checkpoint.manager import stage_checkpoint
from engine.config import OptimConfig
from engine.flops import params_count
from engine.models import build_model, preset, preset_names
from engine.optim import build_optimizer
from engine.tool_args import (
    ArgumentParser,
    add_model_size_flags,
    output_dir,
    output_file,
    positive_int,
)

SIDES = ("sync", "async", "dcp_async")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt_tiny", choices=preset_names())
    add_model_size_flags(p, layers=8, hidden=512, vocab=8192, seq=64, batch=4)
    p.add_argument("--every", type=positive_int, default=8, help="steps between saves")
    p.add_argument("--saves", type=positive_int, default=3, help="saves per side per round")
    p.add_argument("--rounds", type=positive_int, default=2, help="rounds of every side")
    p.add_argument(
        "--dir", type=output_dir, default=None, help="scratch directory (default: a new temp dir)"
    )
    p.add_argument("--out", type=output_file, default=None, help="also write the results as JSON")
    return p.parse_args(argv)


class Side:
    """One way of saving: ``save(step)`` is the call inside the step, ``drain`` the end."""

    def __init__(self, kind: str, root: Path, model, optimizer) -> None:
        self.kind, self.root, self.model, self.optimizer = kind, root, model, optimizer
        self.saver, self.future, self.buffers = BackgroundSaver(), None, {}

    def save(self, step: int) -> None:
        kw = dict(model=self.model, optimizer=self.optimizer, ps=None, state={}, keep=2)
        if self.kind == "sync":
            save_checkpoint(self.root, step, **kw)
        elif self.kind == "async":
            self.saver.wait()  # one in flight, as RunCheckpoints.save does
            self.saver.submit(
                step, stage_checkpoint(self.root, step, copy=True, buffers=self.buffers, **kw)
            )
        else:
            import torch.distributed.checkpoint as dcp

            if self.future is not None:
                self.future.result()
            self.future = dcp.async_save(
                self._state(), checkpoint_id=str(self.root / f"step_{step}"), no_dist=True
            )

    def _state(self) -> dict:
        state = {"model": dict(self.model.named_parameters())}
        opt = {}
        for name, p in self.model.named_parameters():
            s = self.optimizer.state.get(p, {})
            opt[name] = {k: v for k, v in s.items() if torch.is_tensor(v)}
        return {**state, "optim": opt}

    def drain(self) -> None:
        self.saver.wait()
        if self.future is not None:
            self.future.result()
            self.future = None


def run_side(kind: str, cfg, args, root: Path, tokens: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4), torch.device("cpu"))
    side = Side(kind, root, model, optimizer)
    times, saved_at, calls = [], [], []
    steps = args.every * (args.saves + 1)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        x = tokens[step % len(tokens)]
        model(x[:, :-1], x[:, 1:]).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.every == 0 and step < steps:
            call = time.perf_counter()
            side.save(step)
            calls.append(time.perf_counter() - call)
            saved_at.append(len(times))
        times.append(time.perf_counter() - start)
    side.drain()
    shutil.rmtree(root, ignore_errors=True)
    saving = set(saved_at)
    plain = statistics.median(t for i, t in enumerate(times) if i not in saving and i > 0)
    excess = []
    for i in saved_at:
        window = times[i : i + args.every]  # the save's step and the steps until the next
        excess.append(sum(t - plain for t in window))
    return {"step_s": plain, "stall_s": calls, "excess_s": excess}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    cfg = preset(
        args.preset,
        hidden_size=args.hidden,
        num_layers=args.layers,
        vocab_size=args.vocab,
        num_heads=8,
        max_positions=max(args.seq, 64),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    tokens = torch.randint(0, cfg.vocab_size, (16, args.batch, args.seq + 1))
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_async_ckpt_"))
    results: dict[str, dict[str, list]] = {
        s: {"step_s": [], "stall_s": [], "excess_s": []} for s in SIDES
    }
    for r in range(args.rounds):
        order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
        for kind in order:
            got = run_side(kind, cfg, args, scratch / f"{kind}_{r}", tokens)
            results[kind]["step_s"].append(got["step_s"])
            results[kind]["stall_s"] += got["stall_s"]
            results[kind]["excess_s"] += got["excess_s"]
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    n = params_count(cfg)
    print(
        f"{args.preset} h={args.hidden} layers={args.layers}: {n / 1e6:.1f} M parameters "
        f"({n * 12 / 2**20:.0f} MiB with AdamW moments); median over "
        f"{args.rounds * args.saves} saves per side"
    )
    print(
        f"{'side':<11}{'step s':>9}{'stall s':>9}{'excess s':>10}{'stall ÷ sync':>14}{'excess ÷ sync':>15}"
    )
    for kind in SIDES:
        m = med[kind]
        print(
            f"{kind:<11}{m['step_s']:>9.3f}{m['stall_s']:>9.3f}{m['excess_s']:>10.3f}"
            f"{m['stall_s'] / med['sync']['stall_s']:>14.2f}"
            f"{m['excess_s'] / med['sync']['excess_s']:>15.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"medians": med, "raw": results}, indent=1) + "\n")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
