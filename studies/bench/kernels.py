"""Benchmark the fused kernels of ``layers.kernels`` against torch eager, torch.compile,
Liger-Kernel and apex (each when importable).

    python tools/bench_kernels.py --out outputs/bench_kernels            # on a CUDA machine
    python tools/bench_kernels.py --smoke --out outputs/bench_smoke      # anywhere: tiny shapes

For every op, shape and implementation it times forward, forward+backward and their
difference (backward: some backward passes, like the fused cross-entropy's, consume their
buffers and cannot be re-run alone), measures peak memory of forward+backward, and turns
times into GB/s over the op's minimal memory traffic, as a % of the device-to-device copy
bandwidth measured in the same run. Writes ``kernels.csv``, ``kernels.md`` and
``kernels.png`` to ``--out``.

``--smoke`` runs tiny fp32 shapes, on CPU through the Triton interpreter when there is no
GPU (timed with time.perf_counter: a correctness run, not performance), checks every
output and gradient against torch, and still writes the three files.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys
import time
from collections.abc import Callable

import torch

from engine.tool_args import ArgumentParser, output_dir, positive_int
from studies.bench.kernel_cases import Case, build_cases, check_against_torch

MODES = ("fwd", "bwd", "fwd+bwd")
GOALS = (  # issue 16's
    "LayerNorm fwd+bwd >= 70% of copy bandwidth and >= 1.0x Liger",
    "bias-GeLU and bias-dropout-add fwd+bwd >= 1.2x torch eager and >= 1.0x torch.compile",
    "fused cross-entropy fwd+bwd >= 1.0x torch.compile, peak memory <= 0.5x "
    "F.cross_entropy on fp32-upcast logits",
    "RMSNorm and SwiGLU (issue 26): no goal; their figures decide MODEL_AUTO (torch until then)",
)


def make_timer(device: torch.device, reps: int) -> Callable[[Callable[[], object], list], float]:
    """The one timing harness: ms per call of ``fn`` (grads of ``leaves`` reset between calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn, leaves: do_bench(fn, grad_to_none=leaves, return_mode="median")

    def cpu_time(fn, leaves):
        best = float("inf")
        for _ in range(reps):
            for x in leaves:
                x.grad = None
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    return cpu_time


def copy_bandwidth(device: torch.device, timer) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = (1 << 28) if device.type == "cuda" else (1 << 22)  # 1 GiB / 16 MiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), [])
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def measure(case: Case, name: str, fn: Callable, timer, device) -> dict[str, float]:
    """Times of every mode and peak memory of fwd+bwd for one implementation."""
    inputs = case.make_inputs()
    leaves = [x for x in inputs if x.requires_grad]
    grad = torch.ones_like(fn(*inputs))

    def fwd_bwd():
        fn(*inputs).backward(grad)

    fwd_bwd()  # warm up: JIT compilation, torch.compile, autotuning
    out = {"fwd": timer(lambda: fn(*inputs), leaves), "fwd+bwd": timer(fwd_bwd, leaves)}
    out["bwd"] = max(out["fwd+bwd"] - out["fwd"], 0.0)
    out["peak_mb"] = float("nan")
    if device.type == "cuda":
        for x in leaves:
            x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out


def _speedup(by: dict, row: dict, other: str) -> float:
    """``other``'s fwd+bwd time over ``row``'s at the same op and shape; nan (never "met")
    when ``other`` did not run."""
    key = (row["op"], row["shape"], other)
    return by[key]["fwd+bwd_ms"] / row["fwd+bwd_ms"] if key in by else float("nan")


def goal_lines(rows: list[dict]) -> list[str]:
    """One line per goal and shape: the measured figure and whether the goal is met."""
    if rows[0]["device"].startswith("cpu"):
        return [f"- {g}: not measured (no GPU in this run)" for g in GOALS]
    by = {(r["op"], r["shape"], r["impl"]): r for r in rows}
    lines = []
    for (op, shape, impl), r in by.items():
        if impl != "triton":
            continue
        vs = functools.partial(_speedup, by, r)
        if op == "layer_norm":
            vs_liger = vs("liger")
            ok = r["fwd+bwd_pct_copy"] >= 70 and not vs_liger < 1.0
            fig = f"{r['fwd+bwd_pct_copy']:.0f}% of copy, {vs_liger:.2f}x Liger"
        elif op in ("bias_gelu", "bias_dropout_add"):
            ok = r["speedup_vs_torch"] >= 1.2 and vs("compile") >= 1.0
            fig = f"{r['speedup_vs_torch']:.2f}x torch eager, {vs('compile'):.2f}x torch.compile"
        elif op in ("rms_norm", "swiglu"):
            lines.append(
                f"- {op} {shape}: {r['fwd+bwd_pct_copy']:.0f}% of copy, "
                f"{r['speedup_vs_torch']:.2f}x torch eager, {vs('compile'):.2f}x torch.compile, "
                f"{vs('liger'):.2f}x Liger: reported (no goal)"
            )
            continue
        else:
            ratio = r["peak_mb"] / by[(op, shape, "torch")]["peak_mb"]
            ok = ratio <= 0.5 and vs("compile") >= 1.0
            fig = f"peak memory {ratio:.2f}x F.cross_entropy(fp32), {vs('compile'):.2f}x torch.compile"
        lines.append(f"- {op} {shape}: {fig}: {'met' if ok else 'NOT met'}")
    return lines


def write_outputs(rows: list[dict], out_dir: str, header: str) -> None:
    """kernels.csv, kernels.md (a table per op) and kernels.png (fwd+bwd GB/s)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernels.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [header, "", "Goals:", "", *goal_lines(rows), ""]
    for op in dict.fromkeys(r["op"] for r in rows):
        lines += [
            f"### {op}",
            "",
            "| shape | impl | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd GB/s "
            "| % copy | peak MB | vs torch eager | max err vs torch |",
            "|" + "---|" * 10,
        ]
        for r in (r for r in rows if r["op"] == op):
            lines.append(
                f"| {r['shape']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
                f"{r['fwd+bwd_ms']:.3f} | {r['fwd+bwd_GBps']:.1f} | {r['fwd+bwd_pct_copy']:.0f} | "
                f"{r['peak_mb']:.0f} | {r['speedup_vs_torch']:.2f}x | {r['max_err_vs_torch']:.1e} |"
            )
        lines.append("")
    with open(os.path.join(out_dir, "kernels.md"), "w") as f:
        f.write("\n".join(lines))
    _plot(rows, os.path.join(out_dir, "kernels.png"), header.splitlines()[0])


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(len(ops), 1, figsize=(10, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        sub = [r for r in rows if r["op"] == op]
        shapes, impls = (
            list(dict.fromkeys(r["shape"] for r in sub)),
            list(dict.fromkeys(r["impl"] for r in sub)),
        )
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = {r["shape"]: r["fwd+bwd_GBps"] for r in sub if r["impl"] == impl}
            ax.bar(
                [j + i * width for j in range(len(shapes))],
                [vals.get(s, 0) for s in shapes],
                width,
                label=impl,
            )
        ax.axhline(sub[0]["copy_GBps"], color="k", ls="--", lw=1, label="copy")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=7)
        ax.set_ylabel("fwd+bwd GB/s")
        if sub[0]["device"].startswith("cpu"):
            ax.set_yscale("log")  # interpreter vs torch spans orders of magnitude
        ax.set_title(op, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark every case; returns the rows written."""
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (by a kernel)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    if args.smoke:  # awkward, tiny sizes: the interpreter runs Python per program
        sweep = dict(tokens_list=[13], hidden_list=[257], vocab_list=[300])
    else:
        sweep = dict(
            tokens_list=args.tokens,
            hidden_list=args.hidden,
            vocab_list=[args.vocab // tp for tp in args.tp],
        )
    cases = build_cases(
        **sweep, dtype=dtype, device=device, compile_torch=cuda and not args.no_compile
    )
    timer = make_timer(device, reps=args.reps)
    copy = copy_bandwidth(device, timer)
    rows = []
    for case in cases:
        err = check_against_torch(case)
        times = {name: measure(case, name, fn, timer, device) for name, fn in case.impls.items()}
        for name, t in times.items():
            row = {
                "device": torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)",
                "op": case.op,
                "shape": case.shape,
                "dtype": str(dtype).removeprefix("torch."),
                "impl": name,
                "copy_GBps": copy,
                "peak_mb": t["peak_mb"],
                "max_err_vs_torch": err,
            }
            for mode in MODES:
                gbps = case.bytes[mode] / (t[mode] * 1e-3) / 1e9 if t[mode] > 0 else float("nan")
                row[f"{mode}_ms"], row[f"{mode}_GBps"] = t[mode], gbps
                row[f"{mode}_pct_copy"] = 100 * gbps / copy
            row["speedup_vs_torch"] = times["torch"]["fwd+bwd"] / t["fwd+bwd"]
            rows.append(row)
        print(
            f"{case.op:>17} {case.shape:<28} "
            + "  ".join(f"{n}={t['fwd+bwd']:.3f}ms" for n, t in times.items()),
            flush=True,
        )
    return rows


class UsageError(ValueError):
    """A bad command-line value; main prints it as one line and exits 2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=output_dir, default="outputs/bench_kernels", help="directory for csv/md/png"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes; CPU interpreter without GPU")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is present")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--hidden", type=positive_int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument(
        "--vocab", type=positive_int, default=50304, help="full vocabulary; shards are vocab/tp"
    )
    p.add_argument("--tp", type=positive_int, nargs="+", default=[1, 2, 8])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--reps", type=positive_int, default=3, help="CPU timing repetitions (best of)")
    args = p.parse_args(argv)
    bad_tp = [tp for tp in args.tp if args.vocab // tp < 1]
    if bad_tp:
        raise UsageError(f"--tp {bad_tp[0]} leaves no vocabulary per shard of --vocab {args.vocab}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"bench_kernels.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if not args.smoke and (args.cpu or not torch.cuda.is_available()):
        # The full sweep through the Triton interpreter runs for hours and prints nothing.
        print(
            "bench_kernels.py: error: no CUDA device (or --cpu): the full sweep needs a GPU; "
            "run with --smoke for the CPU correctness run",
            file=sys.stderr,
        )
        raise SystemExit(2)
    rows = run(args)
    cuda = rows[0]["device"] != "cpu (triton interpreter)"
    if cuda:
        header = f"Kernels on {rows[0]['device']}, {rows[0]['dtype']}; copy {rows[0]['copy_GBps']:.0f} GB/s"
    else:
        header = (
            "CPU Triton-interpreter correctness run: timings are NOT performance figures "
            "and GPU figures were not measured"
        )
    write_outputs(rows, args.out, header)
    print(f"wrote {args.out}/kernels.csv, kernels.md, kernels.png")
    if not cuda:
        print(
            "NOTE: no CUDA device: GPU figures were NOT measured; the CPU numbers above time "
            "the Triton interpreter and only show that every kernel runs and matches torch."
        )
    return rows
