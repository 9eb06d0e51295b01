"""Training state each rank holds under each DP mode: all-reduce, FSDP (ZeRO-3) over every
DP rank, hybrid sharding (HSDP: R replicas of dp ÷ R shards) and FSDP with the optimizer
offloaded, side by side on the same model at the same dp.

    python tools/bench_dp_memory.py                 # gpt_tiny, dp 4, HSDP R 2, fp32

Each layout runs on ``dp`` local gloo ranks (one thread each), builds the model, trains one
AdamW step on its own batch and counts, per rank, the bytes of what it keeps between steps:
its parameters (the local shard of a sharded one), their gradients, and its optimizer's
state on the device (``state_bytes``) and in host memory (``host_state_bytes``; offload).
Gathered units in flight during a forward or backward are not counted: they come and go
within a step. The expected numbers, per parameter in fp32: 16 whole (4 weight + 4
gradient + 8 Adam moments), 16 ÷ dp under FSDP, 16 ÷ (dp ÷ R) under HSDP; offloaded, the
moments (and under FSDP the parameter and gradient shards) move to host memory.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine.tool_args import ArgumentParser, positive_int

LAYOUTS = (  # (label, dp_shard, replicas, offload)
    ("all-reduce (dp_shard=none)", "none", 1, "none"),
    ("FSDP full over dp", "full", 1, "none"),
    ("HSDP full, R replicas", "full", "R", "none"),
    ("FSDP full, optimizer offloaded", "full", 1, "optimizer"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="bench_dp_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt_tiny", help="a model preset (configs/model)")
    p.add_argument("--dp", type=positive_int, default=4, help="data-parallel ranks (processes)")
    p.add_argument(
        "--replicas", type=positive_int, default=2, help="HSDP replicas R (divides --dp)"
    )
    args = p.parse_args(argv)
    if args.dp < 2 or args.replicas < 2 or args.dp % args.replicas:
        p.error(
            f"--dp {args.dp} --replicas {args.replicas}: need dp >= 2 and 2 <= R dividing dp; "
            "e.g. --dp 4 --replicas 2"
        )
    from engine.models import preset

    try:  # here, not in each of the ranks spawned per layout
        preset(args.model).validate(1)
    except ValueError as err:
        p.error(f"--model {args.model}: {err}")
    return args


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _rank(model_name: str, dp: int, mode: str, replicas: int, offload: str) -> dict:
    """One rank of one layout: the bytes it holds after one step (identical on every rank)."""
    import torch.distributed as dist

    from engine.bootstrap import bootstrap_rank
    from engine.config import Config, OptimConfig, ParallelConfig, parallel_dims
    from engine.data_parallel import build_data_parallel
    from engine.models import build_model, preset

    parallel = ParallelConfig(dp_shard=mode, dp_replicate=replicas, offload=offload)
    dims = parallel_dims(Config(tp_size=1, dp_size=dp, parallel=parallel), dp)
    with bootstrap_rank(dims, backend="gloo", split_cores=False) as ps:
        torch.set_num_threads(1)
        ps.seed(0)
        cfg = preset(model_name)
        model = build_model(cfg, ps)
        hybrid = (ps.group("fsdp_shard"), ps.group("fsdp_replicate")) if replicas > 1 else None
        dp_run = build_data_parallel(
            model,
            OptimConfig(lr=1e-3, weight_decay=0.0),
            grad_group=ps.group("grad"),
            tp_group=ps.tp_group,
            device=torch.device("cpu"),
            dp_shard=mode,
            hybrid_groups=hybrid or (None, None),
            offload=offload,
        )
        gen = torch.Generator().manual_seed(ps.rank)
        x = torch.randint(0, cfg.vocab_size, (2, 65), generator=gen)
        model(x[:, :-1], x[:, 1:]).mean().backward()
        dp_run.finish_grads()
        dp_run.step(lr=1e-3, max_norm=0.0, norm=dp_run.grad_norm())
        params = [p for p in model.parameters()]
        held = {
            "params": _local_bytes(params),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optim": dp_run.state_bytes(),
            "host": getattr(dp_run, "host_state_bytes", lambda: 0)(),
            "whole": sum(p.numel() for p in params),
        }
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, held)
        return {"rank0": held, "same_on_every_rank": all(h == held for h in every)}


def measure(args: argparse.Namespace) -> list[dict]:
    """One row per layout of :data:`LAYOUTS`."""
    from studies.verification.layouts import launch_local

    rows = []
    for label, mode, replicas, offload in LAYOUTS:
        r = args.replicas if replicas == "R" else replicas
        got = launch_local(_rank, args.dp, args.model, args.dp, mode, r, offload)
        rows.append({"layout": label.replace("R replicas", f"{r} replicas"), **got})
    return rows


def table(rows: list[dict], dp: int) -> list[str]:
    whole = rows[0]["rank0"]["whole"]
    fsdp = sum(rows[1]["rank0"][k] for k in ("params", "grads", "optim"))
    lines = [
        f"{whole:,} parameters, fp32, dp {dp}, per rank after one AdamW step",
        "| layout | parameters (B) | gradients (B) | optimizer state (B) | on the device (B) "
        "| per parameter | ÷ FSDP full | in host memory (B) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        h = row["rank0"]
        device, host = h["params"] + h["grads"] + h["optim"], h["host"]
        if host:  # CPUOffloadPolicy: the parameter and gradient shards are host tensors too
            device, host = h["optim"], h["params"] + h["grads"] + host
        lines.append(
            f"| {row['layout']} | {h['params']:,} | {h['grads']:,} | {h['optim']:,} | "
            f"{device:,} | {device / whole:.1f} | {device / fsdp:.2f}x | {host:,} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    if not all(row["same_on_every_rank"] for row in rows):
        print("error: the ranks hold different amounts (an uneven shard)", file=sys.stderr)
    print("\n".join(table(rows, args.dp)))
    return 0
