"""Training throughput: tokens/s, model TFLOP/s and MFU of meshtron, against plain PyTorch.

One process measures meshtron (tp=1, dp=1) and the references named by ``--references``
(a comma list) side by side: ``eager``, a plain PyTorch loop of the same model and math
(nn.Embedding, nn.Linear, nn.LayerNorm, F.scaled_dot_product_attention, F.cross_entropy,
torch.optim.AdamW; same sizes, dropout, precision and optimizer settings); ``compile``, the
same plain model under ``torch.compile``; ``mcore``, Megatron-Core, which is skipped with
a note (the comparison is not implemented here, and it is not a dependency). After a
warmup, blocks of steps rotate through the loops (forward and reversed order in turn, so
none always runs first after another), and the step-time medians give the ratios. Before
timing, each reference is loaded with meshtron's weights and the losses must agree, so
the loops are known to compute the same function.

Model FLOPs come from ``engine.flops`` (no recomputation counted, padded vocabulary); MFU
is printed only where ``engine.flops.peak_flops`` knows the device (never on CPU).

    python tools/bench_train.py --preset gpt_tiny --hidden 256 --layers 4 --heads 4 \\
        --seq 128 --micro-batch 8 --vocab 8192 --threads 1 --out bench_train.csv
    torchrun --nproc-per-node 4 tools/bench_train.py --tp 2 --dp 2 ...   # meshtron only
    torchrun --nproc-per-node 2 tools/bench_train.py --dp 2 --dp-shard optimizer,full ...

``--dp-shard optimizer,gradients,full`` adds meshtron under each DP sharding mode (ZeRO-1;
FSDP2's ZeRO-2 and ZeRO-3; same model, seed and layout) as further loops in the same
rotation, and prints each one's step time over the all-reduce path's (``--zero1`` is
``--dp-shard optimizer``).

``--profile N`` then profiles N steps of each loop and prints where the time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time

import torch
from rich.console import Console

from engine import flops
from engine.bootstrap import bootstrap_rank
from engine.config import OptimConfig, sized_dims
from engine.data_parallel import DataParallel, build_data_parallel
from engine.models import ModelConfig, build_model, preset
from engine.preflight import models_fit_problem
from engine.tool_args import (
    ArgumentParser,
    add_preset_overrides,
    non_negative_int,
    output_file,
    positive_int,
    preset_overrides,
)
from parallel_state.launcher import detect_launch
from studies.bench import step_profile
from studies.bench.reference_gpt import (
    RefGPT,
    autocast_context,
    builds,
    check_same_function,
    load_reference,
    reference_optimizer,
    reference_step,
)
from studies.bench.train_report import (
    CEILING_REPS,
    Loop,
    compare,
    render,
    run_meta,
    summarize,
    write,
)
from studies.verification.layouts import VerifySpec
from studies.verification.layouts import make_batch as verify_batch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


REFERENCES = ("eager", "compile", "mcore")
SHARDED_MODES = ("optimizer", "gradients", "full")  # parallel.dp_shard's modes beyond none
MODE_NAMES = {"optimizer": " ZeRO-1", "gradients": " ZeRO-2", "full": " ZeRO-3"}


def _add_model_args(p: ArgumentParser) -> None:
    """What model runs: the preset, its overrides, kernels and compilation."""
    p.add_argument("--preset", default="gpt_tiny", help="engine.models preset name")
    add_preset_overrides(p, ("hidden", "layers", "heads", "ffn", "vocab", "max_positions"))
    add_preset_overrides(p, ("kv_heads", "experts", "moe_ffn"))
    p.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout")
    p.add_argument(
        "--kernels",
        choices=["auto", "triton", "torch", "apex"],
        default=None,
        help="meshtron's element-wise ops (model.kernels; default: the preset's)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile meshtron's whole forward and loss (model.compile=true)",
    )
    p.add_argument(
        "--also-eager",
        action="store_true",
        help="with --compile, also time meshtron eager (same model and layout) in the rotation, "
        "and with --dp-shard each sharding mode eager too",
    )
    p.add_argument(
        "--also-torch-kernels",
        action="store_true",
        help="also time meshtron eager with model.kernels=torch (torch's element-wise ops in "
        "place of the fused kernels) in the rotation: the kernels' gain in a whole step",
    )
    p.add_argument(
        "--also-cuda-graphs",
        action="store_true",
        help="with --compile on CUDA and --dropout 0, also time the compiled step replayed as "
        "CUDA graphs (model.cuda_graphs=true) in the rotation",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for --compile and the compile reference (aot_eager: "
        "the same graphs without code generation, for CPU rehearsals)",
    )


def _add_layout_args(p: ArgumentParser) -> None:
    """The batch, the parallel layout and the precision."""
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument(
        "--micro-batch", type=positive_int, default=8, help="sequences per rank per step"
    )
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--dp", type=positive_int, default=1)
    p.add_argument(
        "--precision",
        choices=["auto", *PRECISIONS],
        default="auto",
        help="auto: bf16 autocast on CUDA, fp32 on CPU",
    )


def _add_timing_args(p: ArgumentParser) -> None:
    """How the loops are timed, and which references run beside meshtron."""
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps of each loop")
    p.add_argument(
        "--blocks", type=positive_int, default=6, help="alternating timed blocks per loop"
    )
    p.add_argument("--steps-per-block", type=positive_int, default=4)
    p.add_argument(
        "--references",
        default="eager",
        help=f"comma list of {', '.join(REFERENCES)} (empty: meshtron only)",
    )
    p.add_argument("--no-reference", action="store_true", help="time meshtron only")


def _add_data_parallel_args(p: ArgumentParser) -> None:
    """The DP sharding modes to time, and the gradient bucket size."""
    p.add_argument(
        "--dp-shard",
        default="",
        metavar="MODES",
        help="comma list of optimizer, gradients, full: also time these DP sharding modes "
        "(ZeRO-1, FSDP2 ZeRO-2, ZeRO-3) at the same layout, side by side with the all-reduce",
    )
    p.add_argument("--zero1", action="store_true", help="the same as --dp-shard optimizer")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="DP bucket size in MiB (trainer.grad_bucket_mb)",
    )


def _add_run_args(p: ArgumentParser) -> None:
    """Profiling, the results file, the seed and the CPU threads."""
    p.add_argument(
        "--profile",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="profile N steps of each loop afterwards",
    )
    p.add_argument("--out", type=output_file, default=None, help="write results: .json, else CSV")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is steadiest on a shared CPU",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (UsageError names the first bad value)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_model_args(p)
    _add_layout_args(p)
    _add_timing_args(p)
    _add_data_parallel_args(p)
    _add_run_args(p)
    args = p.parse_args(argv)
    _check_args(args)
    return args


class UsageError(ValueError):
    """A bad command-line value; main prints it as one line and exits 2."""


def _check_args(args: argparse.Namespace) -> None:
    """Raise UsageError naming the first bad value and what would be valid."""
    names = (
        [] if args.no_reference else [n.strip() for n in args.references.split(",") if n.strip()]
    )
    unknown = [n for n in names if n not in REFERENCES]
    if unknown:
        raise UsageError(
            f"--references: unknown {unknown[0]!r}; choose from {', '.join(REFERENCES)}"
        )
    args.references = list(dict.fromkeys(names))
    modes = [m.strip() for m in args.dp_shard.split(",") if m.strip()]
    modes += ["optimizer"] if args.zero1 else []
    bad = [m for m in modes if m not in SHARDED_MODES]
    if bad:
        raise UsageError(f"--dp-shard: unknown {bad[0]!r}; choose from {', '.join(SHARDED_MODES)}")
    args.dp_shard = list(dict.fromkeys(modes))
    if args.also_eager and not args.compile:
        raise UsageError("--also-eager compares against --compile: give --compile too")
    if args.also_cuda_graphs and (not args.compile or args.dp_shard):
        raise UsageError(
            "--also-cuda-graphs compares against --compile: give it, without --dp-shard"
        )
    if args.also_torch_kernels and (args.dp_shard or args.kernels == "torch"):
        raise UsageError(
            "--also-torch-kernels compares the kernels with torch's ops: give it without "
            "--dp-shard and without --kernels torch"
        )
    if args.also_cuda_graphs and not torch.cuda.is_available():
        raise UsageError("--also-cuda-graphs replays CUDA graphs, but no CUDA device is visible")
    if not args.bucket_mb > 0:
        raise UsageError(f"--bucket-mb must be > 0, got {args.bucket_mb}")


def model_config(args: argparse.Namespace) -> ModelConfig:
    overrides = {
        **preset_overrides(args),
        "max_positions": args.max_positions or max(args.seq, 1),
        "hidden_dropout": args.dropout,
        "attention_dropout": args.dropout,
        "kernels": args.kernels,
        "compile": args.compile or None,
        "compile_backend": args.compile_backend if args.compile else None,
    }
    try:
        cfg = preset(args.preset, **{k: v for k, v in overrides.items() if v is not None})
        moe_flags = [f"--{n.replace('_', '-')}" for n in ("experts", "moe_ffn") if getattr(args, n)]
        if moe_flags and cfg.mlp != "moe":
            raise UsageError(
                f"{moe_flags[0]}: --preset {args.preset} has no experts (model.mlp="
                f"{cfg.mlp}); pick a preset with mlp: moe, such as moe_tiny"
            )
        if args.seq > cfg.max_positions:
            raise UsageError(f"--seq {args.seq} exceeds max_positions {cfg.max_positions}")
        cfg.validate(args.tp)
        if args.also_cuda_graphs:
            dataclasses.replace(cfg, cuda_graphs=True).validate(args.tp)
    except (KeyError, ValueError) as err:
        raise UsageError(str(err).strip("'\"")) from None
    return cfg


# ---------------------------------------------------------------------------------------
# The plain PyTorch reference: GPT-2 layout, batch-first, nothing of meshtron's.


def meshtron_step(model, dp: DataParallel, batch, ocfg, device, dtype):
    """One step as engine.trainer.Trainer.train_step runs it (one micro-batch per step)."""

    def step() -> torch.Tensor:
        with autocast_context(device, dtype):
            loss = model.loss(batch)
        loss.backward()
        dp.finish_grads()
        dp.step(lr=ocfg.lr, max_norm=ocfg.clip_grad, norm=dp.grad_norm())
        dp.zero_grad()
        return loss.detach()

    return step


def make_batch(cfg: ModelConfig, args, ps, device) -> dict[str, torch.Tensor]:
    """A fixed random micro-batch for this DP rank (the verifier's GPT/BERT batches)."""
    spec = VerifySpec(
        model=cfg.arch,
        vocab_size=cfg.vocab_size,
        seq_len=args.seq,
        batch_size=args.micro_batch,
        seed=args.seed + ps.dp_rank,
    )
    return {k: v.to(device) for k, v in verify_batch(spec).items()}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run_interleaved(loops: list[Loop], args, device: torch.device) -> None:
    """Warm up every loop, then rotate timed blocks (forward, then reversed order), recording
    step times. Each loop's first loss is kept (``Loop.first_loss``): every loop starts
    from the same weights on the same batch, so their first losses compare the loops at
    the timed precision, and the check compiles nothing the warm-up would not."""
    for loop in loops:
        start = _now(device)
        for i in range(args.warmup):
            loss = loop.step()
            if i == 0:  # read before the next step (a CUDA-graph replay) overwrites it
                loop.first_loss = float(loss)
        loop.warmup_s = _now(device) - start
        if getattr(args, "show_progress", True):
            print(f"  warm-up of {loop.name}: {loop.warmup_s:.1f} s", flush=True)
    for block in range(args.blocks):
        order = loops if block % 2 == 0 else loops[::-1]
        for loop in order:
            for i in range(args.steps_per_block):
                start, cpu_start = _now(device), time.process_time()
                loop.step()
                if i == args.steps_per_block - 1:
                    loop.settle()
                loop.times.append(_now(device) - start)
                loop.cpu_times.append(time.process_time() - cpu_start)


def matmul_ceiling(
    device: torch.device, dtype: torch.dtype | None, reps: int = CEILING_REPS
) -> float:
    """Measured FLOP/s of a square matmul, the fastest of ``reps``: the practical ceiling a
    step is held against. The fastest, not the median: on a shared machine a median of a
    few matmuls timed the other jobs, and a step that ran in a quieter moment beat its
    "ceiling" (141 % of it)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype or torch.float32)
    a @ a  # warm up
    times = []
    for _ in range(reps):
        start = _now(device)
        a @ a
        times.append(_now(device) - start)
    return 2 * n**3 / min(times)


def profile_loops(
    loops: list[Loop], steps: int, console: Console, *, show: bool
) -> dict[str, dict]:
    """Print each loop's top ops by self CPU time (and CUDA time on GPUs) over ``steps``,
    then every loop's time per step by kind of work (``studies.bench.step_profile``), side
    by side; return ``{loop: {"clock": "gpu" or "cpu", "ms_per_step": {kind: ms}}}``.
    Every rank runs the steps (their collectives need all of them); ``show``: this rank
    prints its tables."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    kinds = {}
    for loop in loops:
        if "cuda-graphs" in loop.name:  # its kernels replay inside one graph launch
            if show:
                console.print(f"\n{loop.name}: not profiled (a CUDA graph replays as one launch)")
            continue
        with profile(activities=activities) as prof:
            for _ in range(steps):
                loop.step()
        averages = prof.key_averages()
        clock, times = step_profile.kind_times(averages, steps)
        kinds[loop.name] = {"clock": clock, "ms_per_step": times}
        if show:
            console.print(f"\n[bold]{loop.name}[/]: {steps} steps, top ops by {sort}")
            console.print(averages.table(sort_by=sort, row_limit=20, max_name_column_width=60))
    if show:
        console.print(step_profile.kinds_table(kinds))
    return kinds


# ---------------------------------------------------------------------------------------
# Setup, summary, output.


def build_loops(cfg: ModelConfig, args, ps, dtype) -> tuple[list[Loop], dict]:
    """meshtron's step on this rank, and the reference's where it is comparable."""
    torch.manual_seed(args.seed)
    ps.seed(args.seed)
    ocfg = OptimConfig()  # the engine's defaults; the reference copies them
    batch = make_batch(cfg, args, ps, ps.device)
    model = None
    loops = []
    variants = [("none", cfg)] + [(mode, cfg) for mode in args.dp_shard]
    if args.also_cuda_graphs:
        variants.append(("none", dataclasses.replace(cfg, cuda_graphs=True)))
    if args.also_eager:  # each mode eager too, after the compiled ones
        eager = dataclasses.replace(cfg, compile=False)
        variants += [("none", eager)] + [(mode, eager) for mode in args.dp_shard]
    if args.also_torch_kernels:
        variants.append(("none", dataclasses.replace(cfg, compile=False, kernels="torch")))
        if ps.device.type != "cuda" and cfg.kernels == "auto" and ps.rank == 0:
            print(
                "note: off CUDA kernels=auto already runs torch's ops, so --also-torch-kernels "
                "times the same ops twice; pass --kernels triton to compare the kernels"
            )
    info: dict = {"vocab": {}, "shard_label": [], "shard_base": []}
    for mode, mcfg in variants:
        # With --dp-shard: each loop's label, and the all-reduce loop it is timed against
        # (the one compiled as it is; None for that loop itself).
        label = MODE_NAMES.get(mode, " all-reduce").strip()
        label += (" compiled" if mcfg.compile else " eager") if args.also_eager else ""
        info["shard_label"].append(label)
        twin = next(i for i, (m, c) in enumerate(variants) if m == "none" and c == mcfg)
        info["shard_base"].append(None if mode == "none" else twin)
        torch.manual_seed(args.seed)
        m = build_model(mcfg, ps, device=ps.device)
        dp = build_data_parallel(
            m,
            OptimConfig(),
            grad_group=ps.group("grad"),
            tp_group=ps.tp_group,
            device=ps.device,
            bucket_size_mb=args.bucket_mb,
            low_precision=torch.bfloat16 if dtype == torch.bfloat16 else None,
            dp_shard=mode,
            compile_backend=mcfg.compile_backend if mcfg.compile else None,
        )
        compiled = " compiled" if mcfg.compile else ""
        graphs = " cuda-graphs" if mcfg.cuda_graphs else ""
        graphs += " torch-kernels" if mcfg.kernels != cfg.kernels else ""
        name = (
            f"meshtron{MODE_NAMES.get(mode, '')}{compiled}{graphs} tp={ps.tp_size} dp={ps.dp_size}"
        )
        loops.append(
            Loop(name, meshtron_step(m, dp, batch, ocfg, ps.device, dtype), settle=dp.wait_params)
        )
        info["vocab"][name] = cfg.padded_vocab_size(ps.tp_size)
        model = model or m
    if args.dp_shard:
        return loops, info  # the sharded modes ÷ the all-reduce only
    if not args.references:
        return loops, info
    if ps.world_size > 1 or not builds(cfg):  # said once, not skipped without a word
        if ps.rank == 0:
            why = (
                f"it runs in one process ({ps.world_size} ranks here)"
                if ps.world_size > 1
                else "it builds GPT-2's parts only (LayerNorm, learned positions, GeLU, "
                "biases, a tied head, one KV head per query head)"
            )
            print(f"note: no plain PyTorch reference: {why}; timing meshtron alone")
        return loops, info
    for kind in args.references:
        if kind == "mcore":
            note = (
                "not importable"
                if importlib.util.find_spec("megatron") is None
                else ("importable, but its loop is not implemented in this tool")
            )
            print(f"note: Megatron-Core reference skipped: {kind} {note}")
            continue
        ref = RefGPT(cfg).to(ps.device)
        load_reference(ref, model)
        forward = torch.compile(ref, backend=args.compile_backend) if kind == "compile" else ref
        name = f"pytorch {kind}"
        check_same_function(model, forward, batch)
        ref_opt = reference_optimizer(ref, ocfg, ps.device)
        step = reference_step(forward, ref.parameters(), ref_opt, batch, ocfg, ps.device, dtype)
        loops.append(Loop(name, step))
        info["vocab"][name] = cfg.vocab_size
    return loops, info


def first_loss_gaps(loops: list[Loop]) -> dict[str, float | None]:
    """Each later loop's |first loss - the first loop's| / |the first loop's|: the loops
    run the same model on the same batch from the same weights; None without warm-up."""
    base = loops[0].first_loss
    return {
        lp.name: None
        if base is None or lp.first_loss is None
        else abs(lp.first_loss - base) / abs(base)
        for lp in loops[1:]
    }


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg = model_config(args)
    except UsageError as err:
        print(f"bench_train.py: error: {err}", file=sys.stderr)
        return 2
    launch = detect_launch()
    world = launch.world_size if launch.launcher != "none" else 1
    if args.tp * args.dp != world:  # it does not start its own ranks
        n = args.tp * args.dp
        print(
            f"bench_train.py: error: --tp {args.tp} × --dp {args.dp} = {n} ranks, and "
            f"{world} process{'es' * (world > 1)} run this: start it as torchrun "
            f"--nproc-per-node {n} tools/bench_train.py ...",
            file=sys.stderr,
        )
        return 2
    # ... and the machine: every loop trains a copy of the model (activations aside)
    copies = 1 + len(args.references) + args.also_torch_kernels + args.also_cuda_graphs
    copies += (1 + args.also_eager) * (1 + len(args.dp_shard)) - 1
    on_gpu = torch.cuda.is_available()
    problem = models_fit_problem(cfg, copies=copies, tp=args.tp, dp=args.dp, on_gpu=on_gpu)
    if problem:
        print(f"bench_train.py: error: --preset {args.preset}: {problem}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    mesh = bootstrap_rank(lambda world: sized_dims(args.tp, args.dp, world), split_cores=False)
    with mesh as ps:
        precision = args.precision
        if precision == "auto":
            precision = "bf16" if ps.device.type == "cuda" else "fp32"
        dtype = PRECISIONS[precision]
        built = time.perf_counter()
        loops, info = build_loops(cfg, args, ps, dtype)
        args.show_progress = ps.rank == 0
        if ps.rank == 0:
            print(f"built {len(loops)} loops in {time.perf_counter() - built:.1f} s", flush=True)
        if ps.rank == 0:
            console.print(f"timing {', '.join(loop.name for loop in loops)} on {ps.device} ...")
        run_interleaved(loops, args, ps.device)
        info["loss_rel_gap"] = first_loss_gaps(loops)
        ceiling = matmul_ceiling(ps.device, dtype)
        peak = flops.peak_flops(ps.device, dtype or torch.float32)
        rows = [summarize(lp, info["vocab"][lp.name], cfg, args, ps, peak, ceiling) for lp in loops]
        meta = run_meta(cfg, args, ps, precision, ceiling, peak)
        meta["comparisons"] = compare(rows, loops, info, args)
        save = ps.rank == 0 and args.out
        if ps.rank == 0:
            render(rows, meta, console)
        if save:  # the timings are kept even if profiling fails
            write(args.out, rows, meta)
        if args.profile:
            meta["profile"] = profile_loops(loops, args.profile, console, show=ps.rank == 0)
            if save:  # again, with each loop's time by kind
                write(args.out, rows, meta)
        if save:
            console.print(f"wrote {args.out}")
    return 0
