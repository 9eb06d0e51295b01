"""Context parallelism's memory claim, measured: the peak activation memory of one rank for
one forward + backward of a causal model on one long sequence, at cp 1 (one process, the
whole sequence) and at cp N (N local gloo ranks, ring attention, each rank 1/N of it).

Only activations are counted. Each rank builds the model, runs one untimed forward +
backward (so the gradient buffers and torch's lazily built state exist), zeroes the
gradients in place, and only then resets the kernel's peak resident counter (``5`` to
``/proc/self/clear_refs``); the measured pass's growth is ``VmHWM`` after it minus
``VmRSS`` before it. glibc would keep freed tensor buffers below its (rising) mmap
threshold, so resident memory would count what torch has already freed; pinning the
threshold at 64 KiB (``mallopt(M_MMAP_THRESHOLD)``) maps every large buffer on its own and
returns it on free, so resident memory follows the tensors alive. Linux only.

Reported: each layout's largest per-rank growth, and ``ratio`` = cp N ÷ (cp 1 ÷ N): 1.0 is
a perfect 1/N share; above it, what each rank holds besides its share (the ring's
in-flight key/value blocks, the whole-sequence buffers some layers keep).

    python -m studies.bench.cp_memory --seq-len 16384 --cp 4
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from engine.tool_args import ArgumentParser, output_file, positive_int

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(prog="cp_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_tiny", help="model preset (a causal model)")
    p.add_argument("--seq-len", type=positive_int, default=16384, help="tokens in the sequence")
    p.add_argument("--cp", type=positive_int, default=4, help="context-parallel size to compare")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--json", type=output_file, metavar="PATH", help="also write the results as JSON"
    )
    args = p.parse_args(argv)
    if args.seq_len % (2 * args.cp):
        p.error(f"--seq-len {args.seq_len} must be a multiple of 2 × --cp = {2 * args.cp}")
    return args


def _status_bytes(key: str) -> int:
    """One ``/proc/self/status`` field (reported in kB) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset the kernel's peak resident counter; the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def rank_growth(args: argparse.Namespace) -> dict:
    """This rank's peak activation memory (bytes) for one forward + backward of
    ``args.model`` on an ``args.seq_len``-token sequence split over every rank (the module
    docstring's method), every rank's in rank order, and the loss."""
    import torch.distributed as dist

    from engine.bootstrap import bootstrap_rank
    from engine.config import Config, parallel_dims
    from engine.models import build_model
    from engine.models.config import preset
    from engine.runner.local import model_inputs

    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 64 * 1024)

    def cp_layout(world: int):
        return parallel_dims(Config(tp_size=1, dp_size=1, cp_size=world), world)

    with bootstrap_rank(cp_layout, backend="gloo") as ps:
        cfg = preset(args.model, max_positions=args.seq_len)
        torch.manual_seed(0)
        model = build_model(cfg, ps, dtype=DTYPES[args.dtype])
        windows = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1))
        local = model_inputs(model, ps)(windows)
        losses = []
        for measured in (False, True):
            dist.barrier()
            if measured:
                before = _reset_peak()
            loss = model.loss(local)
            loss.backward()
            losses.append(loss.item())
            for p in model.parameters():
                p.grad.zero_()
        growth = [0] * dist.get_world_size()
        dist.all_gather_object(growth, _status_bytes("VmHWM") - before)
        return {"growth": growth, "loss": losses[-1]}


def measure(args: argparse.Namespace, launch: Callable | None = None) -> dict:
    """cp 1 and cp ``args.cp``: per-rank peak activation growth and their ratio. ``launch(fn,
    world, args)`` runs ``fn(args)`` on ``world`` fresh processes and returns rank 0's result
    (default: torch's elastic launcher); cp 1 runs in a fresh process too, so both start alike."""
    if launch is None:
        from studies.verification.layouts import launch_local as launch
    whole = max(launch(rank_growth, 1, args)["growth"])
    ranks = [whole] if args.cp == 1 else launch(rank_growth, args.cp, args)["growth"]
    split = max(ranks)
    share = whole / args.cp
    return {
        "model": args.model,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "cp": args.cp,
        "cp1_bytes": whole,
        "cpN_bytes_per_rank": ranks,
        "cpN_bytes": split,
        "share_bytes": share,
        "ratio": split / share,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, print one table, optionally write JSON."""
    args = parse_args(argv)
    r = measure(args)
    mib = 2**20
    print(f"{r['model']} {r['seq_len']} tokens {r['dtype']}, one forward + backward:")
    print(f"  cp 1: {r['cp1_bytes'] / mib:9.1f} MiB")
    per_rank = ", ".join(f"{b / mib:.1f}" for b in r["cpN_bytes_per_rank"])
    print(f"  cp {r['cp']}: {r['cpN_bytes'] / mib:9.1f} MiB on the largest rank ({per_rank})")
    print(f"  1/{r['cp']} share of cp 1: {r['share_bytes'] / mib:.1f} MiB; ratio {r['ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
