"""Checkpoint save and load time of meshtron against PyTorch's own formats, side by side.

One process builds a model of ``--preset`` (tp=1, dp=1, fp32) and an AdamW state for
every parameter (``exp_avg``, ``exp_avg_sq``: the state a training run saves), then, in
rounds whose order alternates, saves and loads the same tensors with:

- ``meshtron``: ``engine.checkpoint.save_checkpoint`` / ``load_checkpoint`` (atomic step
  directory, index, per-file integrity hash written on save and verified on every load);
- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` (no process group; loads in
  place into the given tensors);
- ``torch.save``: one file of the flat {name: tensor} dict, then ``torch.load`` and a copy
  into the model and optimizer tensors;
- ``safetensors``: ``safetensors.torch.save_file`` / ``load_file`` and the same copy.

Every save is made durable (the last two fsync their file; DCP and meshtron do it
themselves), and each starts from the same filesystem state: the side's previous output is
removed and the filesystem synced before its timer starts (``_clear``). Loads read from the page cache (the files were just written), as a resume on
the same node does. Each side's median over the rounds and meshtron's ratio to the others
are printed.

    python tools/bench_checkpoint.py --preset gpt_125m --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.models import build_model, preset, preset_names
from engine.tool_args import ArgumentParser, output_dir, output_file, positive_int

SIDES = ("meshtron", "dcp", "torch.save", "safetensors")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt_125m", choices=preset_names(), help="model size")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed save+load rounds")
    p.add_argument(
        "--dir", type=output_dir, default=None, help="scratch directory (default: a new temp dir)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the model and optimizer state live (cuda: saves copy from the GPU)",
    )
    p.add_argument(
        "--out", type=output_file, default=None, help="also write the medians and ratios as JSON"
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu")
    problem = _room_problem(args)
    if problem:  # before minutes of allocation, swapping or a full disk
        p.error(problem)
    return args


# Bytes per parameter: fp32 weights, a gradient and Adam's two moments in memory; each of
# the four sides writes the weights and moments (12), all four on disk at once at most.
MEMORY_BYTES, DISK_BYTES = 16, 4 * 12


def _room_problem(args: argparse.Namespace) -> str | None:
    """Why this machine cannot hold the preset's model and optimizer state, or the four
    sides' checkpoints on the scratch directory's disk, else None."""
    from engine.flops import params_count
    from engine.preflight import models_fit_problem

    cfg = preset(args.preset)
    problem = models_fit_problem(cfg, on_gpu=args.device == "cuda", bytes_per_param=MEMORY_BYTES)
    if problem:
        return f"--preset {args.preset}: {problem}"
    n, gib = params_count(cfg), 2**30
    scratch = Path(args.dir or tempfile.gettempdir())
    while not scratch.exists():
        scratch = scratch.parent
    free = shutil.disk_usage(scratch).free
    if n * DISK_BYTES > free:
        return (
            f"--preset {args.preset}: the four checkpoints take about "
            f"{n * DISK_BYTES / gib:.1f} GiB and {scratch} has {free / gib:.1f} GiB free; "
            "give --dir on a larger disk or a smaller --preset"
        )
    return None


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _flat(model, optimizer) -> dict[str, torch.Tensor]:
    """{name: tensor} of every parameter and its AdamW moments (the tensors, not copies)."""
    flat = {}
    for name, p in model.named_parameters():
        flat[f"model/{name}"] = p.data
        for key, value in optimizer.state[p].items():
            if torch.is_tensor(value) and value.dim() > 0:
                flat[f"optim/{name}/{key}"] = value
    return flat


@torch.no_grad()
def _copy_into(flat: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    for name, tensor in flat.items():
        tensor.copy_(loaded[name])


def _sides(model, optimizer, scratch: Path) -> dict[str, tuple[Callable, Callable, Path]]:
    """{side: (save, load, what the save writes)}; each save writes scratch/side anew."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    flat = _flat(model, optimizer)
    mesh_dir, dcp_dir = scratch / "meshtron", scratch / "dcp"
    pt_file, st_file = scratch / "state.pt", scratch / "state.safetensors"

    def mesh_save():
        save_checkpoint(mesh_dir, 1, model=model, optimizer=optimizer, ps=None, state={})

    def mesh_load():
        load_checkpoint(mesh_dir, model=model, optimizer=optimizer, ps=None, log=lambda m: None)

    def pt_save():
        torch.save(flat, pt_file)
        _fsync(pt_file)

    def st_save():
        save_file(flat, str(st_file))
        _fsync(st_file)

    return {
        "meshtron": (mesh_save, mesh_load, mesh_dir),
        "dcp": (
            lambda: dcp.save(flat, checkpoint_id=dcp_dir),
            lambda: dcp.load(flat, checkpoint_id=dcp_dir),
            dcp_dir,
        ),
        "torch.save": (
            pt_save,
            lambda: _copy_into(flat, torch.load(pt_file, weights_only=True)),
            pt_file,
        ),
        "safetensors": (st_save, lambda: _copy_into(flat, load_file(str(st_file))), st_file),
    }


def _clear(path: Path) -> None:
    """Remove a side's previous save and let the filesystem finish with it (os.sync), so
    the next save starts from the same state for every side: else freeing the old file's
    blocks, which a filesystem may defer past an in-place overwrite, lands on whichever
    side writes next (measured here: meshtron's save 0.85 s after its own load, 3.3 s
    right after DCP's save, DCP's 1.1-1.3 s either way)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()


def _model_and_optimizer(name: str, device: str = "cpu"):
    model = build_model(preset(name, hidden_dropout=0.0, attention_dropout=0.0), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # creates the moments, as a training step does
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, dict[str, list[float]]]:
    """{side: {"save": [s...], "load": [s...]}} over ``args.rounds`` rounds (plus a warmup)."""
    model, optimizer = _model_and_optimizer(args.preset, args.device)
    sides = _sides(model, optimizer, scratch)
    # DCP warns that it runs without a process group and overwrites its last save: both meant.
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    times = {side: {"save": [], "load": []} for side in SIDES}
    for r in range(args.rounds + 1):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            save, load, written = sides[side]
            _clear(written)
            for op, fn in (("save", save), ("load", load)):
                start = time.perf_counter()
                fn()
                if r > 0:  # round 0 warms caches and imports
                    times[side][op].append(time.perf_counter() - start)
    return times


def report(times: dict, gigabytes: float, load: str) -> str:
    lines = [
        f"checkpoint of {gigabytes:.2f} GB; medians over {len(times['dcp']['save'])} rounds; {load}"
    ]
    lines.append(f"{'side':<12} {'save s':>8} {'load s':>8}  meshtron/side save  load")
    mesh = {op: statistics.median(times["meshtron"][op]) for op in ("save", "load")}
    for side in SIDES:
        save, load_ = (statistics.median(times[side][op]) for op in ("save", "load"))
        ratios = (
            ""
            if side == "meshtron"
            else f"  {mesh['save'] / save:17.2f}x {mesh['load'] / load_:5.2f}x"
        )
        lines.append(f"{side:<12} {save:8.2f} {load_:8.2f}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.dir:  # output_dir checked it can be made
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench_ckpt-", dir=args.dir))
    try:
        times = measure(args, scratch)
        model_bytes = sum(f.stat().st_size for f in (scratch / "meshtron").rglob("*.safetensors"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(report(times, model_bytes / 1e9, load))
    if args.out:
        write_json(args.out, times, model_bytes / 1e9, args)
    return 0


def write_json(path: str, times: dict, gigabytes: float, args: argparse.Namespace) -> None:
    """Each side's median save and load seconds, and meshtron's time over each side's."""
    medians = {
        side: {op: statistics.median(times[side][op]) for op in ("save", "load")} for side in SIDES
    }
    mesh = medians["meshtron"]
    ratios = {
        side: {op: mesh[op] / medians[side][op] for op in ("save", "load")}
        for side in SIDES
        if side != "meshtron"
    }
    doc = {
        "preset": args.preset,
        "device": args.device,
        "gigabytes": gigabytes,
        "rounds": args.rounds,
        "median_s": medians,
        "meshtron_over": ratios,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
