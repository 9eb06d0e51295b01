"""One command for a GPU window: everything the CPU cannot measure, in priority order,
inside a wall-clock budget it enforces, written as it goes.

    python3 tools/gpu_check.py                       # on the GPU machine: $OUT or --out
    python tools/gpu_check.py --rehearse --out DIR   # anywhere: the same paths, toy sizes

Each item runs as its own subprocess (the benchmarks under ``tools/``), with a time limit
of the smaller of its cap and what is left of ``--budget``; an item that cannot start in
what is left is recorded as skipped, one that overruns is killed (its whole process group)
and recorded as timed out, one that fails keeps the tail of its log. After every item the
results are rewritten, so whatever stops the run, what it measured is on disk:

* ``gpu_check.json``: the environment (device, driver, torch, triton, Python, commit,
  date), every item's status and seconds, and its result rows;
* ``gpu_check.md``: the same as a markdown section ready for docs/BENCHMARKS.md;
* ``gpu_check.log``: every item's command and output.

Nothing is installed and nothing is fetched: the items need what the project needs (on the
lent machines, hydra-core, omegaconf, antlr4, blake3 and zstandard travel as wheels; the
README shows the command). ``--rehearse`` runs every item's code path at toy sizes on CPU
(compilation through the ``aot_eager`` backend, kernels through the Triton interpreter),
so the script cannot rot between GPU windows; it is a test in the suite.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

from engine.tool_args import ArgumentParser, output_dir, positive_int
from studies.bench import step_profile

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET_S = 480  # a call with a 540 s limit always returns, with its files
RESERVE_S = 8  # kept back for writing the results after the last item


@dataclasses.dataclass
class Context:
    """What every item's command is built from."""

    rehearse: bool
    scratch: Path
    gpus: int
    cap_s: int | None = None  # overrides every item's own cap

    @property
    def cuda(self) -> bool:
        return self.gpus > 0 and not self.rehearse


@dataclasses.dataclass(frozen=True)
class Plan:
    """An item's subprocess and how its results become rows; or, with ``reason``, why it
    does not run on this machine."""

    argv: list[str] | None = None
    parse: Callable[[], list[dict]] | None = None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    what: str
    cap_s: int  # the most it is given on a GPU (its rehearsal takes far less)
    plan: Callable[[Context], Plan]
    default: bool = True  # False: run only when --items names it


def _tool(name: str) -> list[str]:
    return [sys.executable, str(ROOT / "tools" / name)]


def _row(item: str, case: str, value: str, ratio: str = "", note: str = "") -> dict:
    return {"item": item, "case": case, "value": value, "ratio": ratio, "note": note}


# ---------------------------------------------------------------------------------------
# The items.


def _gpu_test_files() -> list[str]:
    """The test files holding a ``@pytest.mark.gpu`` test (collecting only these keeps
    modules that need packages the GPU image lacks out of the run)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )


def plan_tests(ctx: Context) -> Plan:
    xml = ctx.scratch / "tests.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    argv += [f"--junitxml={xml}", *_gpu_test_files()]

    def parse() -> list[dict]:
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = [
            f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        value = (
            f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
            f"{counts['skipped']} skipped"
        )
        return [_row("tests", "pytest -m gpu", value, note="; ".join(failed[:6]))]

    return Plan(argv, parse)


def plan_kernels(ctx: Context) -> Plan:
    out = ctx.scratch / "kernels"
    argv = _tool("bench_kernels.py") + ["--out", str(out)]
    argv += ["--smoke"] if ctx.rehearse else ["--tokens", "16384", "--hidden", "2048", "--tp", "1"]

    def parse() -> list[dict]:
        with open(out / "kernels.csv") as f:
            rows = list(csv.DictReader(f))
        by_case: dict[tuple[str, str], dict[str, dict]] = {}
        for r in rows:
            by_case.setdefault((r["op"], r["shape"]), {})[r["impl"]] = r
        result = []
        for (op, shape), impls in by_case.items():
            ours = impls.get("triton")
            if ours is None:
                continue
            ms = float(ours["fwd+bwd_ms"])
            ratios = [  # how many times faster ours runs than each other implementation
                f"{label} {float(impls[name]['fwd+bwd_ms']) / ms:.2f}x"
                for name, label in KERNEL_BASELINES
                if name in impls
            ]
            note = f"max err vs torch {float(ours['max_err_vs_torch']):.1e}"
            note += f"; {float(ours['fwd+bwd_pct_copy']):.0f} % of copy bandwidth"
            result.append(
                _row("kernels", f"{op} {shape}", f"{ms:.3f} ms fwd+bwd", ", ".join(ratios), note)
            )
        return result

    return Plan(argv, parse)


KERNEL_BASELINES = (("torch", "vs eager"), ("compile", "vs compile"), ("liger", "vs Liger"))
KERNEL_BASELINES += (("apex", "vs apex"),)

TRAIN_SIZES = {  # preset: (seq, micro-batch) on a GPU; the rehearsal shrinks the model
    "gpt_1.3b": (2048, 4),
    "gpt_350m": (1024, 8),
    "llama_1b": (2048, 4),
    "moe_tiny": (1024, 8),  # grown by MOE_SIZE
}
# The mixture-of-experts item's model: moe_tiny's parts (Llama, SwiGLU experts, top-2) at
# about 365M parameters (8 layers of h 1024, 8 experts of width 1408: 90M active).
MOE_SIZE = ["--hidden", "1024", "--layers", "8", "--heads", "16", "--kv-heads", "4"]
MOE_SIZE += ["--experts", "8", "--moe-ffn", "1408", "--vocab", "32000"]
# One layer: the rehearsal checks that each path runs, and a second block runs the same code
# again while doubling what aot_eager traces (about 5 s of CPU per rehearsal).
TOY = ["--hidden", "64", "--layers", "1", "--heads", "4", "--vocab", "512", "--threads", "1"]


def _train_rows(item: str, path: Path) -> list[dict]:
    """One row per timed loop: tokens/s and MFU, and its speed over the compiled plain
    PyTorch reference (or over the first loop where no reference was built)."""
    doc = json.loads(path.read_text())
    rows, comparisons = doc["rows"], doc["meta"].get("comparisons", {})
    anchor = next((r for r in rows if r["loop"] == "pytorch compile"), rows[0])
    anchor_name = anchor["loop"].split(" tp=")[0]
    result = []
    for r in rows:
        mfu = "" if r.get("mfu_pct") is None else f", MFU {r['mfu_pct']:.1f} %"
        note = f"step {r['step_ms_median']:.1f} ms; warm-up {r.get('warmup_s', 0):.0f} s"
        gap = comparisons.get(r["loop"], {}).get("loss_rel_gap")
        note += "" if gap is None else f"; first-step loss gap to the first loop {gap:.1e}"
        speed = r["tokens_per_s"] / anchor["tokens_per_s"]
        result.append(
            _row(
                item,
                r["loop"].split(" tp=")[0],
                f"{r['tokens_per_s']:,.0f} tokens/s{mfu}",
                "" if r is anchor else f"{speed:.2f}x {anchor_name}'s tokens/s",
                note,
            )
        )
    steps = {r["loop"]: r["step_ms_median"] for r in rows}
    return result + _profile_rows(item, doc["meta"].get("profile", {}), anchor["loop"], steps)


def _profile_rows(
    item: str, profile: dict[str, dict], anchor: str, step_ms: dict[str, float]
) -> list[dict]:
    """One row per profiled loop: its time per step by kind of work, and each kind's
    difference to the anchor loop's (where a gap between two loops lies). On a GPU the
    note also gives the kernels' share of the timed step: what is left is the GPU waiting
    for the host (launch and Python overhead)."""
    rows, base = [], profile.get(anchor, {}).get("ms_per_step")
    vs = anchor.split(" tp=")[0]
    for loop, entry in profile.items():
        times = entry["ms_per_step"]
        note = f"{entry['clock'].upper()} time per step, profiled"
        if entry["clock"] == "gpu" and step_ms.get(loop):
            busy = times["total"] / step_ms[loop]
            note += f"; GPU busy {busy:.0%} of the timed {step_ms[loop]:.1f} ms step"
        rows.append(
            _row(
                item,
                f"{loop.split(' tp=')[0]}: time by kind",
                step_profile.kinds_line(times),
                ""
                if loop == anchor or base is None
                else f"vs {vs}: " + step_profile.difference_line(times, base),
                note,
            )
        )
    return rows


REHEARSAL_PRESET = {
    "gpt_1.3b": "gpt_tiny",
    "gpt_350m": "gpt_tiny",
    "llama_1b": "llama_tiny",
    "moe_tiny": "moe_tiny",
}


# The loops a training item can time beside meshtron compiled, as bench_train flags.
TRAIN_LOOPS = {
    "eager": ["--also-eager"],  # meshtron eager, model.kernels as the preset has it
    "torch_kernels": ["--also-torch-kernels"],  # meshtron eager with model.kernels=torch
    "reference": ["--references", "compile"],  # the compiled plain PyTorch GPT
    "references": ["--references", "compile,eager"],  # and the eager one (host overhead)
    "cuda_graphs": ["--also-cuda-graphs"],  # the compiled step replayed as CUDA graphs
}
PROFILED_STEPS = 2  # steps of each loop under torch.profiler, where an item asks for it


def train_plan(
    preset: str,
    *loops: str,
    profile: bool = False,
    compiled: bool = True,
    name: str = "",
    size: tuple[str, ...] = (),
) -> Callable[[Context], Plan]:
    """meshtron compiled (eager with ``compiled=False``) beside ``loops`` (keys of
    ``TRAIN_LOOPS``; the plain GPT where it builds the model: GPT-2's parts), timed side by
    side in one process; ``profile``: then each loop's top GPU kernels over
    ``PROFILED_STEPS`` steps, into the log. ``name``: the item's, train_<preset> by default;
    ``size``: bench_train's preset overrides on a GPU. The rehearsal runs 350M's path (every
    loop flag) and the MoE's (its own model path), and leaves the others to 350M's."""
    name = name or f"train_{preset}"

    def plan(ctx: Context) -> Plan:
        out = ctx.scratch / f"{name}.json"
        argv = _tool("bench_train.py") + ["--out", str(out), "--dropout", "0"]
        argv += ["--compile"] if compiled else []
        argv += [] if {"reference", "references"} & set(loops) else ["--no-reference"]
        if ctx.rehearse:
            if name not in ("train_gpt_350m", "train_moe"):  # 350M's takes every flag
                return Plan(reason="rehearsed by train_gpt_350m: the same path at toy size")
            # 350M's: every flag but CUDA graphs (they replay on a GPU only); the MoE's own
            skip = ("cuda_graphs", "reference")  # a GPU's; a subset of "references"
            mine = TRAIN_LOOPS if name == "train_gpt_350m" else loops
            argv += [f for key in mine if key not in skip for f in TRAIN_LOOPS[key]]
            argv += ["--preset", REHEARSAL_PRESET[preset], *TOY, "--seq", "32", "--profile", "1"]
            argv += ["--micro-batch", "2", "--compile-backend", "aot_eager"]
            argv += ["--warmup", "1", "--blocks", "1", "--steps-per-block", "1"]
            return Plan(argv, lambda: _train_rows(name, out))
        seq, micro = TRAIN_SIZES[preset]
        argv += [flag for loop in loops for flag in TRAIN_LOOPS[loop]]
        argv += ["--profile", str(PROFILED_STEPS)] if profile else []
        argv += ["--preset", preset, *size, "--seq", str(seq), "--micro-batch", str(micro)]
        argv += ["--warmup", "2", "--blocks", "2", "--steps-per-block", "3", "--precision", "bf16"]
        return Plan(argv, lambda: _train_rows(name, out))

    return plan


def plan_fsdp(ctx: Context) -> Plan:
    out = ctx.scratch / "fsdp.json"
    argv = _tool("bench_train.py") + ["--out", str(out), "--dp-shard", "full", "--dropout", "0"]
    argv += ["--compile", "--also-eager"]  # model.compile=auto keeps FSDP2 eager: is it right?
    if ctx.rehearse:
        argv += ["--preset", "gpt_tiny", *TOY, "--seq", "32", "--micro-batch", "2"]
        argv += ["--compile-backend", "aot_eager"]
        argv += ["--warmup", "1", "--blocks", "1", "--steps-per-block", "1"]
    else:
        argv += ["--preset", "gpt_350m", "--seq", "1024", "--micro-batch", "8"]
        argv += ["--warmup", "2", "--blocks", "2", "--steps-per-block", "3"]
    return Plan(argv, lambda: _train_rows("fsdp_full", out))


def plan_two_gpus(ctx: Context) -> Plan:
    if ctx.gpus < 2:
        seen = "no GPU" if ctx.gpus == 0 else "1 GPU"
        return Plan(
            reason=f"needs 2 GPUs ({seen} visible): NCCL takes one GPU per rank, so the "
            "two-rank NCCL run and pp 2 are not measured on this machine"
        )
    out = ctx.scratch / "dp2.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    argv += [str(ROOT / "tools" / "bench_train.py"), "--dp", "2", "--preset", "gpt_350m"]
    argv += ["--seq", "1024", "--micro-batch", "8", "--dropout", "0", "--out", str(out)]
    argv += ["--warmup", "2", "--blocks", "2", "--steps-per-block", "3", "--no-reference"]
    return Plan(argv, lambda: _train_rows("two_gpus", out))


def plan_checkpoint(ctx: Context) -> Plan:
    out = ctx.scratch / "checkpoint.json"
    argv = _tool("bench_checkpoint.py") + ["--out", str(out), "--dir", str(ctx.scratch)]
    if ctx.rehearse:
        argv += ["--preset", "gpt_tiny", "--rounds", "1", "--device", "cpu"]
    else:
        argv += ["--preset", "gpt_125m", "--rounds", "2", "--device", "cuda"]

    def parse() -> list[dict]:
        doc = json.loads(out.read_text())
        rows = []
        for side, ratio in doc["meshtron_over"].items():
            med = doc["median_s"][side]
            rows.append(
                _row(
                    "checkpoint",
                    f"meshtron against {side} ({doc['gigabytes']:.2f} GB from {doc['device']})",
                    f"save {doc['median_s']['meshtron']['save']:.2f} s, "
                    f"load {doc['median_s']['meshtron']['load']:.2f} s",
                    f"time ÷ {side}'s: save {ratio['save']:.2f}, load {ratio['load']:.2f}",
                    f"{side}: save {med['save']:.2f} s, load {med['load']:.2f} s",
                )
            )
        return rows

    return Plan(argv, parse)


# In priority order. Each training item is one process whose loops are timed side by side.
# Compilation is most of an item (H200: 30-40 s per compiled model). The H200 window of
# 2026-11-27 21:22 (147bf0f) took kernels 48 s, tests 21, 1.3B 137 (two loops, profiled),
# kernels_1.3b 43, llama_1b 76, then ran out at 146 s into 350M with five loops (95 s a
# second time, its compilations cached), so checkpoint (42 s) and FSDP (16) came only in a
# second call. Two questions are settled by two windows each and leave the default run:
# the fused kernels inside an eager 1.3B step (1.09x on the H100, 1.10x on the H200:
# kernels_1.3b, run when named) and the eager plain GPT at 350M (meshtron's eager step was
# 1.16x it, the GPU busy 93 %). The H200 window of 2026-11-28 03:53 (1bfd923) still ran out
# 72 s into 350M: kernels 49, tests 25, 1.3B 160, llama_1b 91, checkpoint 53, FSDP 22 (350M
# took 120 s in a second call). Checkpoint (load 1.9x DCP's time, save 0.9x) and FSDP on
# one GPU (0.44x to 0.66x the all-reduce path) now agree across three windows, so they run
# when named, after two_gpus. The rest is about 49 + 25 + 160 + 91 = 325 s before 350M,
# whose four loops (about 120 s) end the 480 s default; the CUDA-graph loop stays in it,
# the only run of model.cuda_graphs on a GPU.
ITEMS: tuple[Item, ...] = (
    Item(
        "kernels",
        "every fused kernel fwd+bwd against torch eager and torch.compile",
        100,
        plan_kernels,
    ),
    Item("tests", "the suite's CUDA tests (pytest -m gpu)", 60, plan_tests),
    Item(
        "train_gpt_1.3b",
        "GPT 1.3B bf16 steps: meshtron compiled, plain PyTorch compiled; each loop's top "
        "kernels and its GPU time by kind of work profiled",
        200,
        train_plan("gpt_1.3b", "reference", profile=True),
    ),
    Item(
        "train_llama_1b",
        "llama_1b bf16 steps: meshtron compiled and eager",
        120,
        train_plan("llama_1b", "eager"),
    ),
    Item(
        "train_gpt_350m",
        "GPT 350M bf16 steps: meshtron compiled, eager and as CUDA graphs, plain compiled, "
        "each profiled by kind of work (the GPU's busy share: host overhead)",
        180,
        train_plan("gpt_350m", "eager", "reference", "cuda_graphs", profile=True),
    ),
    Item("two_gpus", "a two-rank NCCL run and pp 2", 90, plan_two_gpus),
    Item(
        "checkpoint",
        "checkpoint save and load against DCP, torch.save, safetensors",
        90,
        plan_checkpoint,
        default=False,
    ),
    Item(
        "fsdp_full",
        "FSDP2 dp_shard=full on one GPU against the all-reduce path, compiled and eager",
        120,
        plan_fsdp,
        default=False,
    ),
    Item(
        "train_moe",
        "MoE bf16 steps (moe_tiny's parts at 365M, 8 experts, top-2): meshtron compiled and "
        "eager (model.compile=auto compiles it, about 14 graphs a layer)",
        180,
        train_plan("moe_tiny", "eager", name="train_moe", size=tuple(MOE_SIZE)),
        default=False,
    ),
    Item(
        "kernels_1.3b",
        "GPT 1.3B bf16 eager steps: meshtron with the fused kernels (kernels=auto) and with "
        "torch's ops, each profiled by kind of work",
        60,
        train_plan("gpt_1.3b", "torch_kernels", compiled=False, name="kernels_1.3b", profile=True),
        default=False,
    ),
)


# ---------------------------------------------------------------------------------------
# The environment, the runner and the outputs.


def _command_output(argv: list[str]) -> str:
    """``argv``'s first output line, or "" where it is missing or fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else ""


def environment(commit: str | None) -> dict:
    """Device, driver, library versions, commit and date of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    git = ["git", "rev-parse", "--short", "HEAD"]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": props.name if props else f"CPU ({platform.processor() or platform.machine()})",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu_gib": round(props.total_memory / 2**30, 1) if props else 0.0,
        "driver": (_command_output(query) or "unknown") if cuda else "none",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit or os.environ.get("MESHTRON_COMMIT") or _command_output(git) or "unknown",
    }


@dataclasses.dataclass
class Result:
    name: str
    what: str
    status: str  # ok, failed, timed out, skipped, not run here
    seconds: float = 0.0
    note: str = ""
    rows: list[dict] = dataclasses.field(default_factory=list)


def _run_subprocess(argv: list[str], limit: float, log) -> tuple[int | None, float]:
    """Run ``argv`` in its own process group with output to ``log``; kill the group at
    ``limit`` seconds. Returns (exit code or None when killed, seconds)."""
    start = time.monotonic()
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    return code, time.monotonic() - start


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    return " / ".join(line.strip() for line in text[-lines:])[-400:]


def run_item(item: Item, ctx: Context, left: float, log_path: Path) -> Result:
    """Run one item within ``left`` seconds (and its cap)."""
    plan = item.plan(ctx)
    if plan.reason:
        return Result(item.name, item.what, "not run here", note=plan.reason)
    limit = left if ctx.rehearse else min(ctx.cap_s or item.cap_s, left)
    item_log = ctx.scratch / f"{item.name}.log"
    with open(item_log, "w") as log:
        code, seconds = _run_subprocess(plan.argv, limit, log)
    with open(log_path, "a") as log:
        log.write(f"\n===== {item.name} (exit {code}, {seconds:.0f} s)\n")
        log.write(item_log.read_text(errors="replace"))
    if code is None:
        return Result(item.name, item.what, "timed out", seconds, f"killed at {limit:.0f} s")
    if code != 0:
        return Result(item.name, item.what, "failed", seconds, f"exit {code}: {_tail(item_log)}")
    try:
        rows = plan.parse()
    except (OSError, ValueError, KeyError, StopIteration, ET.ParseError) as err:
        return Result(item.name, item.what, "failed", seconds, f"results unreadable: {err}")
    return Result(item.name, item.what, "ok", seconds, rows=rows)


def render_markdown(env: dict, results: list[Result], budget: float, used: float) -> str:
    """The section for docs/BENCHMARKS.md."""
    lines = [
        f"Measured {env['date']} on {env['device']} ({env['gpu_gib']} GiB, {env['gpus']} "
        f"visible), driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, "
        f"Python {env['python']}, commit {env['commit']}; `tools/gpu_check.py`, "
        f"{used:.0f} s of a {budget:.0f} s budget.",
        "",
        "| item | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.note} |")
    lines += ["", "| item | case | value | ratio | note |", "|---|---|---|---|---|"]
    for r in results:
        for row in r.rows:
            cells = (row[k] for k in ("item", "case", "value", "ratio", "note"))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, env: dict, results: list[Result], budget: float, used: float):
    """gpu_check.json and gpu_check.md, each written whole and then renamed into place."""
    doc = {
        "environment": env,
        "budget_s": budget,
        "used_s": round(used, 1),
        "items": [dataclasses.asdict(r) for r in results],
    }
    for name, text in (
        ("gpu_check.json", json.dumps(doc, indent=2)),
        ("gpu_check.md", render_markdown(env, results, budget, used)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def _items_help() -> str:
    lines = ["items, in the order they run (cap on a GPU; * only when --items names it):"]
    lines += [f"{' ' if i.default else '*'} {i.name:<15} {i.what} ({i.cap_s} s)" for i in ITEMS]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=_items_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--budget",
        type=positive_int,
        default=DEFAULT_BUDGET_S,
        help=f"wall-clock seconds for everything (default {DEFAULT_BUDGET_S}: a 540 s call "
        "returns); before each item the time left is checked, an item is killed at its cap "
        "or at the budget, and an item that cannot start is recorded as skipped",
    )
    p.add_argument(
        "--out",
        type=output_dir,
        default=None,
        help="directory for gpu_check.json, .md and .log (default: $OUT, else outputs/gpu_check)",
    )
    p.add_argument(
        "--items",
        default=None,
        help="comma list of items to run, in this order (default: all but the starred ones "
        "below, in priority order; with --rehearse all of them)",
    )
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="the items at toy sizes on CPU (aot_eager compilation, the Triton "
        "interpreter), the starred ones too: the check that the script still runs",
    )
    p.add_argument(
        "--cap",
        type=positive_int,
        default=None,
        help="seconds any one item may run (default: each item's own cap, listed below)",
    )
    p.add_argument(
        "--commit", default=None, help="the commit measured (default: git, else $MESHTRON_COMMIT)"
    )
    args = p.parse_args(argv)
    if args.items is None:  # a rehearsal keeps every item runnable, the starred ones too
        args.items = ",".join(i.name for i in ITEMS if i.default or args.rehearse)
    names = [n.strip() for n in args.items.split(",") if n.strip()]
    known = {i.name: i for i in ITEMS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(
            f"--items: unknown {unknown[0] if unknown else '(none)'!r}; choose from {', '.join(known)}"
        )
    args.items = [known[n] for n in dict.fromkeys(names)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.rehearse and not torch.cuda.is_available():
        print(
            "gpu_check.py: error: no CUDA device is visible: run it on the GPU machine, or "
            "--rehearse here",
            file=sys.stderr,
        )
        return 2
    start = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or "outputs/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.commit)
    if args.rehearse:
        env["device"] += ", rehearsal: toy sizes, timings are not measurements"
    log_path = out / "gpu_check.log"
    log_path.write_text(json.dumps(env) + "\n")
    print(
        f"gpu_check: {env['device']}, torch {env['torch']}, commit {env['commit']}; "
        f"budget {args.budget} s; writing {out}",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    gpus = 0 if args.rehearse else env["gpus"]
    ctx = Context(args.rehearse, scratch, gpus, args.cap)
    results: list[Result] = []
    try:
        for item in args.items:
            left = args.budget - (time.monotonic() - start) - RESERVE_S
            if left < 1:
                result = Result(
                    item.name, item.what, "skipped", note=f"budget spent ({args.budget} s)"
                )
            else:
                print(
                    f"[{time.monotonic() - start:5.0f} s] {item.name}: {item.what} ...", flush=True
                )
                result = run_item(item, ctx, left, log_path)
            results.append(result)
            print(
                f"[{time.monotonic() - start:5.0f} s] {item.name}: {result.status} "
                f"{result.note}".rstrip(),
                flush=True,
            )
            write_outputs(out, env, results, args.budget, time.monotonic() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(render_markdown(env, results, args.budget, time.monotonic() - start))
    return 0 if all(r.status in ("ok", "not run here", "skipped") for r in results) else 1
