"""Gloo all-reduce sweep over message sizes: the achieved bandwidth and latency of a link.

Run under torchrun, or with its rank variables set (RANK, WORLD_SIZE, MASTER_ADDR, ...: the
study starts it so, without torchrun's agents); one rank per node measures the links between
nodes: ``torchrun ... -m studies.scaling.linkbench --out link.json``. For each size the median of
``--repeats`` timed all-reduces (after one warm-up) is kept, with

- ``algbw`` = bytes / time, and
- ``busbw`` = algbw × 2(p − 1)/p: the bytes each rank sends per second in a ring
  all-reduce of p ranks, the figure comparable with a link's configured rate.

The smallest message's time is the latency figure (one all-reduce round across the link).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

DEFAULT_SIZES = (8, 1024, 65536, 1 << 20, 4 << 20, 16 << 20)


def sweep(sizes: list[int], repeats: int) -> list[dict[str, float]]:
    """Time an fp32 all-reduce of each size (bytes) on the default group."""
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32)
        dist.all_reduce(x)  # warm-up: connections and buffers
        times = []
        for _ in range(repeats if size > 65536 else max(repeats, 20)):  # small: noisier
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        algbw = x.numel() * 4 / t
        rows.append(
            {
                "bytes": x.numel() * 4,
                "time_s": t,
                "algbw_Gbps": algbw * 8 / 1e9,
                "busbw_Gbps": algbw * 2 * (world - 1) / world * 8 / 1e9,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="gloo all-reduce bandwidth/latency sweep")
    parser.add_argument("--out", required=True, help="JSON written by rank 0")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="bytes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        rows = sweep([int(s) for s in args.sizes.split(",")], args.repeats)
        if dist.get_rank() == 0:
            tmp = f"{args.out}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"world_size": dist.get_world_size(), "rows": rows}, f, indent=1)
            os.replace(tmp, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
