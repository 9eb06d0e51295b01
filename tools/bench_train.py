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
    torchrun --nproc-per-node 2 tools/bench_train.py --dp 2 --zero1 ...  # ZeRO-1 ÷ all-reduce

``--zero1`` adds meshtron with ZeRO-1 (same model, seed and layout) as a second loop in
the same rotation, and prints ZeRO-1's step time over the all-reduce path's.

``--profile N`` then profiles N steps of each loop and prints where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallel_state  # noqa: E402
from engine import flops  # noqa: E402
from engine.cli import ArgumentParser, non_negative_int, positive_int  # noqa: E402
from engine.config import OptimConfig  # noqa: E402
from engine.data_parallel import DataParallel, build_data_parallel  # noqa: E402
from engine.models import ModelConfig, ParallelModel, build_model, preset  # noqa: E402
from engine.verification.layouts import VerifySpec  # noqa: E402
from engine.verification.layouts import make_batch as verify_batch  # noqa: E402

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
REFERENCES = ("eager", "compile", "mcore")
# fp32 losses of the two loops agree to summation order (~1e-7 relative per op; a few
# layers stay far below 1e-4). A larger gap means the two loops compute different models.
LOSS_RTOL = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt_tiny", help="engine.models preset name")
    for name in ("hidden", "layers", "heads", "ffn", "vocab", "max-positions"):
        p.add_argument(f"--{name}", type=positive_int, default=None, help="override the preset")
    p.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument(
        "--micro-batch", type=positive_int, default=8, help="sequences per rank per step"
    )
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--dp", type=positive_int, default=1)
    p.add_argument("--precision", choices=["auto", *PRECISIONS], default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")  # fmt: skip
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps of each loop")
    p.add_argument(
        "--blocks", type=positive_int, default=6, help="alternating timed blocks per loop"
    )
    p.add_argument("--steps-per-block", type=positive_int, default=4)
    p.add_argument("--references", default="eager",
                   help=f"comma list of {', '.join(REFERENCES)} (empty: meshtron only)")  # fmt: skip
    p.add_argument("--no-reference", action="store_true", help="time meshtron only")
    p.add_argument(
        "--zero1",
        action="store_true",
        help="also time ZeRO-1 at the same layout, side by side with the all-reduce",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DP bucket size in MiB (trainer.grad_bucket_mb)")  # fmt: skip
    p.add_argument("--profile", type=non_negative_int, default=0, metavar="N",
                   help="profile N steps of each loop afterwards")  # fmt: skip
    p.add_argument("--out", default=None, help="write results: .json, else CSV")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's); 1 is steadiest on a shared CPU")  # fmt: skip
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
    if not args.bucket_mb > 0:
        raise UsageError(f"--bucket-mb must be > 0, got {args.bucket_mb}")


def model_config(args: argparse.Namespace) -> ModelConfig:
    overrides = {
        "hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
        "ffn_hidden_size": args.ffn, "vocab_size": args.vocab,
        "max_positions": args.max_positions or max(args.seq, 1),
        "hidden_dropout": args.dropout, "attention_dropout": args.dropout,
    }  # fmt: skip
    try:
        cfg = preset(args.preset, **{k: v for k, v in overrides.items() if v is not None})
        if args.seq > cfg.max_positions:
            raise UsageError(f"--seq {args.seq} exceeds max_positions {cfg.max_positions}")
        cfg.validate(args.tp)
    except (KeyError, ValueError) as err:
        raise UsageError(str(err).strip("'\"")) from None
    return cfg


# ---------------------------------------------------------------------------------------
# The plain PyTorch reference: GPT-2 layout, batch-first, nothing of meshtron's.


class RefBlock(nn.Module):
    """Pre-LN transformer layer; QKV rows ordered (heads, three, d) like meshtron's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layernorm_eps
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.p_attn, self.p_hidden = cfg.attention_dropout, cfg.hidden_dropout
        self.approximate = {"gelu": "none", "gelu_tanh": "tanh"}[cfg.activation]
        self.ln1, self.ln2 = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, cfg.ffn_size), nn.Linear(cfg.ffn_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # 3 × (b, heads, s, d)
        p = self.p_attn if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        att = att.transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(att), self.p_hidden, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate))
        return x + F.dropout(mlp, self.p_hidden, self.training)


class RefGPT(nn.Module):
    """GPT-2: token + position embeddings, pre-LN layers, final LayerNorm, tied LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, cfg.layernorm_eps)
        self.p_hidden = cfg.hidden_dropout

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]  # (b, s, h)
        x = F.dropout(x, self.p_hidden, self.training)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (b, s, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


_REF_NAMES = {
    "embedding.word.weight": "wte.weight", "embedding.position": "wpe.weight",
    "final_norm": "ln_f", "attention_norm": "ln1", "mlp_norm": "ln2",
    "attention.qkv": "qkv", "attention.dense": "proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2",
    "layers.": "blocks.",
}  # fmt: skip


def load_reference(ref: RefGPT, model: ParallelModel) -> None:
    """Copy meshtron's full weights into the reference (one rename per module path)."""
    state = {}
    for name, tensor in model.full_state_dict().items():
        for old, new in _REF_NAMES.items():
            name = name.replace(old, new)
        state[name] = tensor
    ref.load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------
# The two training steps.


@dataclass
class Loop:
    """A named training step and its measured step times (seconds): wall and process CPU.

    ``settle`` ends a block: what the last step left in flight (ZeRO-1's all-gathers) is
    waited for inside that step's time, so it never runs into another loop's block.
    """

    name: str
    step: Callable[[], None]
    settle: Callable[[], None] = lambda: None
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def meshtron_step(model, dp: DataParallel, batch, ocfg, device, dtype):
    """One step as engine.trainer.Trainer.train_step runs it (one micro-batch per step)."""

    def step() -> None:
        with _autocast(device, dtype):
            loss = model.loss(batch)
        loss.backward()
        dp.finish_grads()
        dp.step(lr=ocfg.lr, max_norm=ocfg.clip_grad, norm=dp.grad_norm())
        dp.zero_grad()

    return step


def reference_step(forward, params, optimizer, batch, ocfg, device, dtype):
    """The textbook PyTorch step: forward (eager or compiled), backward, clip_grad_norm_, AdamW."""
    ids, labels, params = batch["input_ids"], batch["labels"], list(params)

    def step() -> None:
        with _autocast(device, dtype):
            loss = forward(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ocfg.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def reference_optimizer(ref: RefGPT, ocfg: OptimConfig, device: torch.device):
    """AdamW with engine.optim's settings: decay on matrices only, same lr/betas/eps."""
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": ocfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type == "cuda" or None  # what build_optimizer picks with impl="auto"
    return torch.optim.AdamW(
        groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=fused
    )


def make_batch(cfg: ModelConfig, args, ps, device) -> dict[str, torch.Tensor]:
    """A fixed random micro-batch for this DP rank (the verifier's GPT/BERT batches)."""
    spec = VerifySpec(
        model=cfg.arch, vocab_size=cfg.vocab_size, seq_len=args.seq,
        batch_size=args.micro_batch, seed=args.seed + ps.dp_rank,
    )  # fmt: skip
    return {k: v.to(device) for k, v in verify_batch(spec).items()}


def check_same_function(model: ParallelModel, ref: Callable, batch) -> float:
    """Relative gap between the two losses in eval mode (fp32); raises above LOSS_RTOL."""
    model.eval()
    ref.eval()
    with torch.no_grad():
        ours = model.loss(batch).item()
        theirs = ref(batch["input_ids"], batch["labels"]).item()
    model.train()
    ref.train()  # a compiled module passes train()/eval() to the one it wraps
    gap = abs(ours - theirs) / abs(theirs)
    if not gap <= LOSS_RTOL:
        raise SystemExit(
            f"meshtron loss {ours:.6f} vs reference {theirs:.6f} (rel {gap:.2e} > {LOSS_RTOL}): "
            "the reference no longer computes meshtron's model"
        )
    return gap


# ---------------------------------------------------------------------------------------
# Timing.


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run_interleaved(loops: list[Loop], args, device: torch.device) -> None:
    """Warm up every loop, then rotate timed blocks (forward, then reversed order), recording
    step times."""
    for loop in loops:
        for _ in range(args.warmup):
            loop.step()
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


def matmul_ceiling(device: torch.device, dtype: torch.dtype | None, reps: int = 5) -> float:
    """Measured FLOP/s of a square matmul: the practical ceiling a step is held against."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype or torch.float32)
    a @ a  # warm up
    times = []
    for _ in range(reps):
        start = _now(device)
        a @ a
        times.append(_now(device) - start)
    return 2 * n**3 / statistics.median(times)


def profile_loops(loops: list[Loop], steps: int, console: Console) -> None:
    """Print each loop's top ops by self CPU time (and CUDA time on GPUs) over ``steps``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    for loop in loops:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                loop.step()
        console.print(f"\n[bold]{loop.name}[/]: {steps} steps, top ops by {sort}")
        console.print(
            prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60)
        )


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
    for zero1 in (False, True) if args.zero1 else (False,):
        torch.manual_seed(args.seed)
        m = build_model(cfg, tp_group=ps.tp_group, device=ps.device)
        dp = build_data_parallel(
            m, OptimConfig(distributed=zero1), dp_group=ps.dp_group, tp_group=ps.tp_group,
            device=ps.device, bucket_size_mb=args.bucket_mb,
            low_precision=torch.bfloat16 if dtype == torch.bfloat16 else None,
        )  # fmt: skip
        name = f"meshtron{' ZeRO-1' if zero1 else ''} tp={ps.tp_size} dp={ps.dp_size}"
        loops.append(Loop(name, meshtron_step(m, dp, batch, ocfg, ps.device, dtype),
                          settle=dp.wait_params))  # fmt: skip
        model = model or m
    info: dict = {"vocab": {lp.name: cfg.padded_vocab_size(ps.tp_size) for lp in loops}}
    if args.zero1:
        return loops, info  # ZeRO-1 ÷ all-reduce only
    if not args.references or ps.world_size > 1 or cfg.arch != "gpt":
        return loops, info  # the references are one process and GPT only
    info["loss_rel_gap"] = {}
    for kind in args.references:
        if kind == "mcore":
            note = "not importable" if importlib.util.find_spec("megatron") is None else (
                "importable, but its loop is not implemented in this tool")  # fmt: skip
            print(f"note: Megatron-Core reference skipped: {kind} {note}")
            continue
        ref = RefGPT(cfg).to(ps.device)
        load_reference(ref, model)
        forward = torch.compile(ref) if kind == "compile" else ref
        name = f"pytorch {kind}"
        info["loss_rel_gap"][name] = check_same_function(model, forward, batch)
        ref_opt = reference_optimizer(ref, ocfg, ps.device)
        step = reference_step(forward, ref.parameters(), ref_opt, batch, ocfg, ps.device, dtype)
        loops.append(Loop(name, step))
        info["vocab"][name] = cfg.vocab_size
    return loops, info


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(loop: Loop, vocab: int, cfg: ModelConfig, args, ps, peak, ceiling) -> dict:
    """One result row: step time statistics, tokens/s, model TFLOP/s, MFU."""
    step_s = statistics.median(loop.times)
    batch = args.micro_batch * ps.dp_size  # global sequences per step
    count = {"gpt": flops.gpt_flops_per_iteration, "bert": flops.bert_flops_per_iteration}
    model_flops = count[cfg.arch](
        batch, args.seq, cfg.num_layers, cfg.hidden_size, vocab, ffn_hidden=cfg.ffn_size
    )
    flops_per_s = model_flops / step_s
    utilization = flops.mfu(flops_per_s, peak, ps.world_size)
    return {
        "loop": loop.name, "tp": ps.tp_size, "dp": ps.dp_size, "steps": len(loop.times),
        "step_ms_median": 1e3 * step_s, "step_ms_p10": 1e3 * _percentile(loop.times, 0.1),
        "step_ms_p90": 1e3 * _percentile(loop.times, 0.9),
        "cpu_ms_median": 1e3 * statistics.median(loop.cpu_times),
        "tokens_per_s": batch * args.seq / step_s, "model_flops_per_step": model_flops,
        "model_tflops_per_s": flops_per_s / 1e12,
        "pct_of_matmul_ceiling": 100 * flops_per_s / (ceiling * ps.world_size),
        "mfu_pct": None if utilization is None else 100 * utilization,
    }  # fmt: skip


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
    for col in ("loop", "step ms (median)", "p10–p90 ms", "CPU ms (median)", "tokens/s",
                "model TFLOP/s", "% matmul ceiling", "MFU", "ratio"):  # fmt: skip
        table.add_column(col, justify="left" if col == "loop" else "right")
    for r in rows:
        table.add_row(
            r["loop"], f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_p10']:.1f}–{r['step_ms_p90']:.1f}", f"{r['cpu_ms_median']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['model_tflops_per_s']:.4f}", f"{r['pct_of_matmul_ceiling']:.1f}%",
            "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}%",
            "" if r.get("ratio") is None else f"{r['ratio']:.3f}×",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"model: {meta['model']}  seq={meta['seq']} micro_batch={meta['micro_batch']}  "
        f"matmul ceiling {meta['matmul_ceiling_tflops']:.4f} TFLOP/s ({meta['ceiling_shape']})"
    )
    for name, c in meta.get("comparisons", {}).items():
        if "loss_rel_gap" not in c:  # ZeRO-1 ÷ all-reduce: the same model on both sides
            console.print(
                f"{name} = {c['ratio']:.3f} (medians); per block pair median "
                f"{c['paired_ratio_median']:.3f}, range {min(c['paired_ratios']):.3f}–"
                f"{max(c['paired_ratios']):.3f}; p10 step times {c['p10_ratio']:.3f}; "
                f"process CPU time {c['cpu_ratio']:.3f}; load average {meta['load_avg_1min']}"
            )
            continue
        console.print(
            f"meshtron / {name} = {c['ratio']:.3f} (medians); per block pair "
            f"median {c['paired_ratio_median']:.3f}, range "
            f"{min(c['paired_ratios']):.3f}–{max(c['paired_ratios']):.3f}; p10 step "
            f"times {c['p10_ratio']:.3f}; process CPU time {c['cpu_ratio']:.3f}. "
            f"Loss agreement before timing: rel {c['loss_rel_gap']:.1e}"
        )


def write(path: str, rows: list[dict], meta: dict) -> None:
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        return
    flat = [
        {**r, **{k: v for k, v in meta.items() if not isinstance(v, (list, dict))}} for r in rows
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)


def compare(rows: list[dict], loops: list[Loop], info: dict, args) -> dict[str, dict]:
    """meshtron against each reference: ratios of medians, p10s, CPU time, block pairs."""
    out = {}
    if args.zero1:
        return {"ZeRO-1 ÷ all-reduce": zero1_ratio(rows, loops, args)}
    for i in range(1, len(loops)):
        ratio = rows[0]["step_ms_median"] / rows[i]["step_ms_median"]
        rows[i]["ratio"] = ratio
        pairs = paired_ratios(loops, i, args)
        out[loops[i].name] = dict(
            ratio=ratio, cpu_ratio=rows[0]["cpu_ms_median"] / rows[i]["cpu_ms_median"],
            p10_ratio=rows[0]["step_ms_p10"] / rows[i]["step_ms_p10"], paired_ratios=pairs,
            paired_ratio_median=statistics.median(pairs),
            loss_rel_gap=info["loss_rel_gap"][loops[i].name],
        )  # fmt: skip
    return out


def zero1_ratio(rows: list[dict], loops: list[Loop], args) -> dict:
    """ZeRO-1's step time over the all-reduce path's: medians, p10s, per block pair."""
    k = args.steps_per_block
    plain, zero = loops[0].times, loops[1].times
    pairs = [statistics.median(zero[i : i + k]) / statistics.median(plain[i : i + k])
             for i in range(0, len(zero), k)]  # fmt: skip
    rows[1]["ratio"] = rows[1]["step_ms_median"] / rows[0]["step_ms_median"]
    return {"ratio": rows[1]["ratio"], "p10_ratio": rows[1]["step_ms_p10"] / rows[0]["step_ms_p10"],
            "cpu_ratio": rows[1]["cpu_ms_median"] / rows[0]["cpu_ms_median"],
            "paired_ratios": pairs, "paired_ratio_median": statistics.median(pairs)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg = model_config(args)
    except UsageError as err:
        print(f"bench_train.py: error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    ps = parallel_state.initialize(args.tp, args.dp)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    try:
        precision = args.precision
        if precision == "auto":
            precision = "bf16" if ps.device.type == "cuda" else "fp32"
        dtype = PRECISIONS[precision]
        loops, info = build_loops(cfg, args, ps, dtype)
        if ps.rank == 0:
            console.print(f"timing {', '.join(loop.name for loop in loops)} on {ps.device} ...")
        run_interleaved(loops, args, ps.device)
        ceiling = matmul_ceiling(ps.device, dtype)
        peak = flops.peak_flops(ps.device, dtype or torch.float32)
        rows = [summarize(lp, info["vocab"][lp.name], cfg, args, ps, peak, ceiling) for lp in loops]
        meta = _meta(cfg, args, ps, precision, ceiling, peak)
        meta["comparisons"] = compare(rows, loops, info, args)
        if ps.rank == 0:
            render(rows, meta, console)
            if args.out:
                write(args.out, rows, meta)
                console.print(f"wrote {args.out}")
        if args.profile and ps.rank == 0:
            profile_loops(loops, args.profile, console)
    finally:
        parallel_state.destroy()
    return 0


def _meta(cfg: ModelConfig, args, ps, precision: str, ceiling: float, peak) -> dict:
    device_name = (
        torch.cuda.get_device_name(ps.device) if ps.device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    )  # fmt: skip
    n = 8192 if ps.device.type == "cuda" else 1024
    return {
        "date": time.strftime("%Y-%m-%d"), "device_name": device_name,
        "torch": torch.__version__, "precision": precision, "command": " ".join(sys.argv),
        "model": (f"{cfg.arch} l={cfg.num_layers} h={cfg.hidden_size} a={cfg.num_heads} "
                  f"ffn={cfg.ffn_size} V={cfg.vocab_size} dropout={cfg.hidden_dropout}"),
        "seq": args.seq, "micro_batch": args.micro_batch, "world_size": ps.world_size,
        "params": flops.params_count(cfg), "matmul_ceiling_tflops": ceiling / 1e12,
        "ceiling_shape": f"{n}³ {precision}", "peak_tflops": None if peak is None else peak / 1e12,
        "steps_per_loop": args.blocks * args.steps_per_block, "warmup": args.warmup,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
