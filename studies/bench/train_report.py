"""tools/bench_train.py's results: per-loop summaries, ratios, the table and the files."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from engine import flops
from engine.data.fsutil import atomic_output
from engine.models import ModelConfig, family


@dataclass
class Loop:
    """A named training step and its measured step times (seconds): wall and process CPU.

    ``settle`` ends a block: what the last step left in flight (ZeRO-1's all-gathers) is
    waited for inside that step's time, so it never runs into another loop's block.
    """

    name: str
    step: Callable[[], torch.Tensor]  # one training step; returns its loss
    settle: Callable[[], None] = lambda: None
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    warmup_s: float = 0.0  # the untimed first steps: compilation and CUDA-graph capture
    first_loss: float | None = None  # the first warm-up step's loss (None: no warm-up)


CEILING_REPS = 10  # matmuls timed for the ceiling; the fastest counts


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(loop: Loop, vocab: int, cfg: ModelConfig, args, ps, peak, ceiling) -> dict:
    """One result row: step time statistics, tokens/s, model TFLOP/s, MFU."""
    step_s = statistics.median(loop.times)
    batch = args.micro_batch * ps.dp_size  # global sequences per step
    model_flops = family(cfg.arch).costs.model_flops(cfg, batch, args.seq, vocab=vocab)
    flops_per_s = model_flops / step_s
    utilization = flops.mfu(flops_per_s, peak, ps.world_size)
    return {
        "loop": loop.name,
        "tp": ps.tp_size,
        "dp": ps.dp_size,
        "steps": len(loop.times),
        "step_ms_median": 1e3 * step_s,
        "step_ms_p10": 1e3 * _percentile(loop.times, 0.1),
        "step_ms_p90": 1e3 * _percentile(loop.times, 0.9),
        "cpu_ms_median": 1e3 * statistics.median(loop.cpu_times),
        "tokens_per_s": batch * args.seq / step_s,
        "model_flops_per_step": model_flops,
        "model_tflops_per_s": flops_per_s / 1e12,
        "pct_of_matmul_ceiling": 100 * flops_per_s / (ceiling * ps.world_size),
        "mfu_pct": None if utilization is None else 100 * utilization,
        "warmup_s": loop.warmup_s,
    }


def ceiling_cell(pct: float) -> str:
    """A loop's share of the matmul ceiling; above 100 % the ceiling read low (marked)."""
    return f"{pct:.1f}%" if pct <= 100 else f"{pct:.1f}% *"


def paired_ratios(loops: list[Loop], reference: int, args) -> list[float]:
    """meshtron ÷ reference median per block pair: near in time, so load drift cancels."""
    k = args.steps_per_block
    ours, theirs = loops[0].times, loops[reference].times
    return [
        statistics.median(ours[i : i + k]) / statistics.median(theirs[i : i + k])
        for i in range(0, len(ours), k)
    ]


def render(rows: list[dict], meta: dict, console: Console) -> None:
    table = Table(title=f"Training throughput — {meta['device_name']}, {meta['precision']}")
    # The step-time ratio a row holds (``compare``): meshtron's over a reference's, or a
    # DP sharding mode's over the all-reduce path's (the first row, or with eager loops
    # too the all-reduce loop compiled as the row is).
    sharded = [name for name in meta.get("comparisons", {}) if "÷ all-reduce" in name]
    ratio = f"{rows[0]['loop']} step ÷ this"
    if sharded:
        eager = any(name.endswith(" eager") for name in sharded)
        ratio = "step ÷ the all-reduce's, compiled alike" if eager else f"step ÷ {rows[0]['loop']}"
    load = meta.get("load_avg_1min")
    load = "n/a" if load is None else f"{load:.2f}"
    for col in (
        "loop",
        "step ms (median)",
        "p10–p90 ms",
        "CPU ms (median)",
        "tokens/s",
        "model TFLOP/s",
        "% matmul ceiling",
        "MFU",
        ratio,
    ):
        table.add_column(col, justify="left" if col == "loop" else "right")
    for r in rows:
        table.add_row(
            r["loop"],
            f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_p10']:.1f}–{r['step_ms_p90']:.1f}",
            f"{r['cpu_ms_median']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['model_tflops_per_s']:.4f}",
            ceiling_cell(r["pct_of_matmul_ceiling"]),
            "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}%",
            "" if r.get("ratio") is None else f"{r['ratio']:.3f}×",
        )
    console.print(table)
    console.print(
        f"model: {meta['model']}  seq={meta['seq']} micro_batch={meta['micro_batch']}  "
        f"matmul ceiling {meta['matmul_ceiling_tflops']:.4f} TFLOP/s ({meta['ceiling_shape']})"
    )
    if any(r["pct_of_matmul_ceiling"] > 100 for r in rows):
        console.print(
            "* above 100 %: the ceiling was timed low (load average "
            f"{load}), so it bounds nothing in this run; compare the loops' "
            "ratio instead"
        )
    for name, c in meta.get("comparisons", {}).items():
        if "loss_rel_gap" not in c:  # ZeRO-1 ÷ all-reduce: the same model on both sides
            console.print(
                f"{name} = {c['ratio']:.3f} (medians); per block pair median "
                f"{c['paired_ratio_median']:.3f}, range {min(c['paired_ratios']):.3f}–"
                f"{max(c['paired_ratios']):.3f}; p10 step times {c['p10_ratio']:.3f}; "
                f"process CPU time {c['cpu_ratio']:.3f}; load average {load}"
            )
            continue
        console.print(
            f"meshtron / {name} = {c['ratio']:.3f} (medians); per block pair "
            f"median {c['paired_ratio_median']:.3f}, range "
            f"{min(c['paired_ratios']):.3f}–{max(c['paired_ratios']):.3f}; p10 step "
            f"times {c['p10_ratio']:.3f}; process CPU time {c['cpu_ratio']:.3f}. "
            + (
                "No warm-up step: no first-loss agreement"
                if c["loss_rel_gap"] is None
                else f"First-step loss agreement: rel {c['loss_rel_gap']:.1e}"
            )
        )
        console.print(f"  tokens/s: meshtron ÷ {name} = {1 / c['ratio']:.3f}×; load average {load}")


def write(path: str, rows: list[dict], meta: dict) -> None:
    """The rows and their metadata as JSON (a ``.json`` path) or CSV, replacing ``path``
    whole (a temp file renamed over it: a killed run leaves the previous file)."""
    with atomic_output(path) as tmp, open(tmp, "w", newline="") as f:
        if path.endswith(".json"):
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
            return
        flat = [
            {**r, **{k: v for k, v in meta.items() if not isinstance(v, (list, dict))}}
            for r in rows
        ]
        # Every key of every row: the reference rows add a ratio column meshtron's lacks.
        fields = list(dict.fromkeys(k for row in flat for k in row))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(flat)


def compare(rows: list[dict], loops: list[Loop], info: dict, args) -> dict[str, dict]:
    """meshtron against each reference: ratios of medians, p10s, CPU time, block pairs."""
    out = {}
    if args.dp_shard:
        label, base = info["shard_label"], info["shard_base"]
        return {
            f"{label[i]} ÷ {label[base[i]]}": sharded_ratio(rows, loops, i, base[i], args)
            for i in range(len(loops))
            if base[i] is not None
        }
    for i in range(1, len(loops)):
        ratio = rows[0]["step_ms_median"] / rows[i]["step_ms_median"]
        rows[i]["ratio"] = ratio
        pairs = paired_ratios(loops, i, args)
        out[loops[i].name] = dict(
            ratio=ratio,
            cpu_ratio=rows[0]["cpu_ms_median"] / rows[i]["cpu_ms_median"],
            p10_ratio=rows[0]["step_ms_p10"] / rows[i]["step_ms_p10"],
            paired_ratios=pairs,
            paired_ratio_median=statistics.median(pairs),
            loss_rel_gap=info["loss_rel_gap"][loops[i].name],
        )
    return out


def sharded_ratio(rows: list[dict], loops: list[Loop], i: int, b: int, args) -> dict:
    """Loop ``i``'s (a DP sharding mode's) step time over the all-reduce path's (loop
    ``b``, compiled as loop ``i`` is): medians, p10s, per block pair."""
    k = args.steps_per_block
    plain, zero = loops[b].times, loops[i].times
    pairs = [
        statistics.median(zero[j : j + k]) / statistics.median(plain[j : j + k])
        for j in range(0, len(zero), k)
    ]
    rows[i]["ratio"] = rows[i]["step_ms_median"] / rows[b]["step_ms_median"]
    return {
        "ratio": rows[i]["ratio"],
        "p10_ratio": rows[i]["step_ms_p10"] / rows[b]["step_ms_p10"],
        "cpu_ratio": rows[i]["cpu_ms_median"] / rows[b]["cpu_ms_median"],
        "paired_ratios": pairs,
        "paired_ratio_median": statistics.median(pairs),
    }


def run_meta(cfg: ModelConfig, args, ps, precision: str, ceiling: float, peak) -> dict:
    device_name = (
        torch.cuda.get_device_name(ps.device)
        if ps.device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    )
    n = 8192 if ps.device.type == "cuda" else 1024
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device_name": device_name,
        "torch": torch.__version__,
        "precision": precision,
        "command": " ".join(sys.argv),
        "model": (
            f"{cfg.arch} l={cfg.num_layers} h={cfg.hidden_size} a={cfg.num_heads} "
            + (f"kv={cfg.kv_heads} " if cfg.kv_heads != cfg.num_heads else "")
            + f"ffn={cfg.ffn_size} V={cfg.vocab_size} dropout={cfg.hidden_dropout}"
            + (
                f" experts={cfg.moe_num_experts} top-{cfg.moe_top_k} "
                f"expert_ffn={cfg.moe_ffn_hidden_size}"
                if cfg.mlp == "moe"
                else ""
            )
        ),
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "world_size": ps.world_size,
        "params": flops.params_count(cfg),
        "matmul_ceiling_tflops": ceiling / 1e12,
        "ceiling_shape": f"{n}³ {precision}, fastest of {CEILING_REPS}",
        "peak_tflops": None if peak is None else peak / 1e12,
        "steps_per_loop": args.blocks * args.steps_per_block,
        "warmup": args.warmup,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
