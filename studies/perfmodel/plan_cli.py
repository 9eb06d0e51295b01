"""``tools/plan.py``: predict one layout, or search all layouts, of a GPT or Llama-family model
on a cluster spec."""

from __future__ import annotations

import argparse
import json
import math
import sys

from engine.pipeline.split import V_SCHEDULES
from engine.tool_args import ArgumentParser, positive_int
from studies.perfmodel.cluster_spec import ClusterSpec, cluster_names, load_cluster
from studies.perfmodel.family_table import DEFAULT_ARCH, display_name
from studies.perfmodel.memory_model import DP_SHARD
from studies.perfmodel.model import (
    OFFLOAD,
    Layout,
    Workload,
    layout_problems,
    predict,
    workload_problems,
)
from studies.perfmodel.pipeline import SCHEDULES
from studies.perfmodel.presets import preset_fields
from studies.perfmodel.search import MAX_GLOBAL_BATCH, best_per_split, divisors, search

MAX_GPUS = 1 << 20  # beyond any cluster; the search enumerates every layout of the count
MAX_SIZE = 1 << 24  # a model size (hidden, layers, heads, vocab, seq, ...) beyond any model


def _at_most(limit: int, words: str):
    """argparse type: an integer in [1, ``limit``] (``words``: the limit as people write it)."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value} must be <= {limit} ({words})")
        return value

    return parse


gpu_count = _at_most(MAX_GPUS, "2**20")
size = _at_most(MAX_SIZE, "2**24")
batch = _at_most(MAX_GLOBAL_BATCH, "2**24 sequences")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


# The sizes a workload needs, each a flag or else --model's preset: (flag and Workload field,
# help, the preset's key).
_PRESET_SIZES = (  # (flag, help): a preset's value unless given
    ("hidden", "hidden size h"),
    ("layers", "transformer layers l"),
    ("heads", "attention heads a"),
    ("vocab", "vocabulary V (padded to a multiple of 128·tp)"),
    ("seq", "sequence length s (default: the preset's max)"),
)


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model's sizes; with --model, the preset's values (its experts too) unless given."""
    p.add_argument("--model", help="configs/model preset (e.g. gpt_1.3b); flags below override it")
    for name, text in _PRESET_SIZES:
        p.add_argument(f"--{name}", type=size, help=text)
    p.add_argument("--ffn", type=size, help="MLP width (default 4h)")
    p.add_argument("--kv-heads", type=size, help="key/value heads (Llama; GQA)")
    p.add_argument("--head-dim", type=size, help="width of one head (default hidden ÷ heads)")
    p.add_argument("--experts", type=size, help="routed experts E per layer (MoE; Llama)")
    p.add_argument("--top-k", type=size, help="experts per token K (MoE; 1 or the preset's)")
    p.add_argument("--moe-ffn", type=size, help="one expert's MLP width F (default --ffn)")
    p.add_argument("--shared-experts", type=size, help="experts every token also passes (MoE)")
    p.add_argument("--cp", type=gpu_count, default=1, help="context-parallel size (ring attention)")
    p.add_argument("--ep", type=gpu_count, default=1, help="expert-parallel size, carved from dp")
    p.add_argument("--global-batch", type=batch, required=True, help="sequences per step")
    p.add_argument("--micro-batch", type=batch, help="sequences per forward (best if omitted)")
    p.add_argument("--gpus", type=gpu_count, required=True, help="ranks in total")
    p.add_argument("--cluster", default="dgx_h100", help=f"one of {cluster_names()} or a YAML path")
    p.add_argument("--compute-from", help="calibrated spec for what --cluster leaves null")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="default: the cluster's")
    p.add_argument("--unfused-attention", action="store_true", help="attention stores s×s scores")
    p.add_argument("--no-overlap", action="store_true", help="DP reduce waits for backward")
    p.add_argument("--overlap-param-gather", action="store_true", help="ZeRO-1 gather overlaps")
    p.add_argument("--tp-comm-overlap", action="store_true", help="TP comm hidden behind GEMMs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dp-shard", choices=DP_SHARD, help="what DP shards (search: all if omitted)")
    p.add_argument(
        "--zero1", action="store_true", help="the older spelling of --dp-shard optimizer"
    )
    p.add_argument(
        "--pp", type=gpu_count, help="pipeline stages (predict: 1; search: all if omitted)"
    )
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    p.add_argument(
        "--virtual-stages", type=size, help="layer chunks per rank (interleaved_1f1b, zero_bubble)"
    )
    p.add_argument(
        "--offload",
        choices=OFFLOAD,
        help="optimizer: the sharded modes' optimizer state on the host (predict: none; "
        "search: only where nothing fits on the device)",
    )


SEARCH_AXES = """\
Rank every layout that fits the GPUs' memory; say why the others do not. Per pp × tp × dp
split it varies: micro-batch, recompute, sequence parallelism, dp_shard
(none|optimizer|gradients|full), and

  schedule      (pp > 1) 1f1b, interleaved_1f1b (every chunk count dividing the stage),
                zero_bubble (v 1, ZB-H1), zbv and dualpipev (2 chunks a rank; zbv >= pp,
                dualpipev >= 2·pp micro-batches: the runtime's rules; the split-backward
                ones not under dp_shard=full, the V ones not with GPT's tied head under
                gradients)
  dp_replicate  HSDP (gradients/full): 1, and R = the nodes one DP group spans (shards
                gathered inside a node, the shard gradients all-reduced across nodes)
  offload       optimizer (sharded modes): priced only where a mode fits nowhere on the
                device: optimizer state on the host, gradients and parameters over the
                host link, Adam on the CPU (configs/cluster ``host`` section)

An option none of whose layouts can run is listed as rejected with the rule it breaks.
"""


def build_parser() -> argparse.ArgumentParser:
    """The two sub-commands and their flags."""
    parser = ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("predict", help="step time, throughput, MFU and memory of one layout")
    _model_flags(pr)
    pr.add_argument("--tp", type=gpu_count, default=1, help="tensor-parallel size")
    pr.add_argument("--dp", type=gpu_count, help="data-parallel size (default gpus ÷ (pp·tp))")
    pr.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    pr.add_argument("--sequence-parallel", action="store_true")
    pr.add_argument(
        "--dp-replicate", type=gpu_count, default=1, help="HSDP replicas (gradients/full; 1: none)"
    )
    se = sub.add_parser(
        "search",
        help="rank every layout that fits; say why others do not",
        description=SEARCH_AXES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_flags(se)
    se.add_argument(
        "--dp-replicate",
        type=gpu_count,
        help="pin the HSDP replicas (default: 1 and the nodes a DP group spans)",
    )
    se.add_argument(
        "--memory-gib", type=positive_float, help="memory per GPU (default: the cluster's)"
    )
    se.add_argument("--tp", type=gpu_count, help="pin the tensor-parallel size")
    se.add_argument(
        "--recompute", choices=("none", "selective", "full"), help="pin the recomputation"
    )
    se.add_argument("--top", type=positive_int, default=10, help="feasible layouts to list")
    return parser


def workload_from_args(args: argparse.Namespace, cluster: ClusterSpec) -> Workload:
    """Sizes from --model and the explicit flags (flags win)."""
    pre = preset_fields(args.model) if args.model else {}
    sizes = {name: getattr(args, name) or pre.get(name) for name, _ in _PRESET_SIZES}
    missing = [f"--{k}" for k, v in sizes.items() if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}: give them or --model PRESET")
    if not (args.experts or pre.get("experts")) and (
        args.top_k or args.moe_ffn or args.shared_experts
    ):
        raise ValueError("--top-k, --moe-ffn and --shared-experts need --experts E")
    w = Workload(
        **sizes,
        global_batch=args.global_batch,
        ffn=args.ffn or pre.get("ffn"),
        precision=args.precision or cluster.precision,
        family=pre.get("family", DEFAULT_ARCH),
        kv_heads=args.kv_heads or pre.get("kv_heads"),
        head_dim=args.head_dim or pre.get("head_dim"),
        experts=args.experts or pre.get("experts", 0),
        top_k=args.top_k or pre.get("top_k", 1),
        moe_ffn=args.moe_ffn or pre.get("moe_ffn"),
        shared_experts=args.shared_experts or pre.get("shared_experts", 0),
    )
    if problems := workload_problems(w, args.cp, args.ep):
        raise ValueError("; ".join(problems))
    return w


def dp_shard_of(args: argparse.Namespace) -> str | None:
    """--dp-shard, with --zero1 as the older spelling of ``optimizer``."""
    if args.zero1 and args.dp_shard not in (None, "optimizer"):
        raise ValueError(f"--zero1 means --dp-shard optimizer, not {args.dp_shard}: give one")
    return "optimizer" if args.zero1 else args.dp_shard


def _base_layout(args: argparse.Namespace) -> Layout:
    schedule = args.schedule or "1f1b"
    v = args.virtual_stages or (2 if schedule in ("interleaved_1f1b", *V_SCHEDULES) else 1)
    return Layout(
        tp=1,
        dp=1,
        micro_batch=1,
        schedule=schedule,
        virtual_stages=v,
        fused_attention=not args.unfused_attention,
        overlap_grad_reduce=not args.no_overlap,
        overlap_param_gather=args.overlap_param_gather,
        tp_comm_overlap=args.tp_comm_overlap,
        cp=args.cp,
        ep=args.ep,
    )


def _check_nodes(cluster: ClusterSpec, gpus: int) -> None:
    if cluster.max_nodes and gpus > cluster.max_nodes * cluster.gpus_per_node:
        raise ValueError(
            f"--gpus={gpus} exceeds cluster {cluster.name}'s {cluster.max_nodes} node(s) × "
            f"{cluster.gpus_per_node}; choose a multi-node cluster or fewer GPUs"
        )


def run_predict(args: argparse.Namespace, w: Workload, cluster: ClusterSpec) -> int:
    """Print one prediction; the best micro-batch when --micro-batch is omitted."""
    pp, cp = args.pp or 1, args.cp
    if args.dp is None and args.tp * pp * cp > args.gpus:  # no data-parallel rank left
        cps = f" × cp={cp}" if cp > 1 else ""
        raise ValueError(
            f"pp={pp}{cps} × tp={args.tp} = {pp * cp * args.tp} exceeds --gpus={args.gpus}"
        )
    dp = args.dp or args.gpus // (args.tp * pp * cp)
    base = _base_layout(args)
    lay = Layout(
        **{
            **base.__dict__,
            "pp": pp,
            "tp": args.tp,
            "dp": dp,
            "micro_batch": args.micro_batch or 1,
            "recompute": args.recompute,
            "sequence_parallel": args.sequence_parallel,
            "dp_shard": dp_shard_of(args) or "none",
            "dp_replicate": args.dp_replicate,
            "offload": args.offload or "none",
        }
    )
    problems = layout_problems(w, lay, args.gpus)
    if args.micro_batch is None and not problems:
        per_rank = w.global_batch // dp
        fits = divisors(per_rank)
        priced = [predict(w, Layout(**{**lay.__dict__, "micro_batch": m}), cluster) for m in fits]
        limit = cluster.rank_memory_bytes(args.gpus) / 2**30
        ok = [p for p in priced if p.memory_gib_per_gpu <= limit] or priced[:1]
        lay = Layout(
            **{**lay.__dict__, "micro_batch": min(ok, key=lambda p: p.step_time_s).micro_batch}
        )
    if problems:
        raise ValueError("; ".join(problems))
    p = predict(w, lay, cluster)
    if args.json:
        print(json.dumps(p.as_json(), indent=1))
        return 0
    b = p.breakdown
    pipeline = f" schedule={lay.schedule} v={lay.virtual_stages}" if lay.pp > 1 else ""
    pipeline += f" dp_replicate={lay.dp_replicate}" if lay.dp_replicate > 1 else ""
    pipeline += f" offload={lay.offload}" if lay.offload != "none" else ""
    pipeline += f" cp={lay.cp}" if lay.cp > 1 else ""
    pipeline += f" ep={lay.ep}" if lay.ep > 1 else ""
    print(
        f"{cluster.name}: pp={lay.pp} tp={lay.tp} dp={lay.dp} micro_batch={lay.micro_batch} "
        f"recompute={lay.recompute} sp={lay.sequence_parallel} dp_shard={lay.dp_shard}{pipeline}"
    )
    print(
        f"  step {p.step_time_s:.4g} s   {p.tokens_per_s:,.0f} tokens/s   model "
        f"{p.model_tflops_per_gpu:.4g} / hardware {p.hardware_tflops_per_gpu:.4g} TFLOP/s per GPU   "
        f"MFU {100 * p.mfu:.1f}%   memory {p.memory_gib_per_gpu:.1f} GiB/GPU"
    )
    times = {k[:-2]: v for k, v in b.items() if isinstance(v, float)}
    print("  time: " + "  ".join(f"{k} {v:.4g} s" for k, v in times.items()))
    print("  memory: " + "  ".join(f"{k} {v:.2f} GiB" for k, v in b["memory_gib"].items()))
    for note in prediction_notes(p, cluster, args.gpus):
        print(f"  note: {note}")
    return 0


def prediction_notes(p, cluster: ClusterSpec, gpus: int) -> list[str]:
    """What a prediction's numbers do not say by themselves: a layout of ``gpus`` ranks
    over the memory each has (predict prices any layout; search leaves such ones out), an
    MFU over 100 %."""
    notes = []
    if p.memory_gib_per_gpu > cluster.rank_memory_bytes(gpus) / 2**30:
        notes.append(
            f"does not fit: {p.memory_gib_per_gpu:.1f} GiB/GPU over {cluster.memory_words(gpus)}"
            "; plan.py search lists the layouts that fit (it varies dp, the micro-batch, "
            "recomputation and sharding; --tp and --pp pin those)"
        )
    if p.mfu > 1:
        notes.append(
            "MFU counts the full s² attention (the usual convention); a causal flash kernel "
            "runs half of it, so at long sequences MFU passes 100 %: the hardware TFLOP/s "
            "is the work done"
        )
    return notes


def run_search(args: argparse.Namespace, w: Workload, cluster: ClusterSpec) -> int:
    """Print the ranked feasible layouts (best per tp × dp first) and the rejected splits."""
    only: dict[str, tuple] = {}
    fixed = (args.tp or 1) * (args.pp or 1) * args.cp
    if fixed > 1 and args.gpus % fixed:
        pinned = " × ".join(
            f"--{k} {v}"
            for k, v in (("tp", args.tp), ("pp", args.pp), ("cp", args.cp))
            if v and v > 1
        )
        raise ValueError(f"{pinned} = {fixed} does not divide --gpus={args.gpus}")
    if shard := dp_shard_of(args):
        only["dp_shard"] = (shard,)
    if args.pp:
        only["pp"] = (args.pp,)
    if args.schedule:
        only["schedule"] = (args.schedule,)
    for key in ("virtual_stages", "dp_replicate", "offload", "tp", "recompute"):
        if getattr(args, key):
            only[key] = (getattr(args, key),)
    if cluster.memory_shared:  # host memory is the ranks' own: offloading frees none of it
        only["offload"] = ("none",)
    res = search(
        w,
        cluster,
        args.gpus,
        memory_gib=args.memory_gib,
        micro_batch=args.micro_batch,
        base=_base_layout(args),
        only=only,
    )
    best = best_per_split(res)
    if args.json:
        rows = [
            {
                "pp": c.layout.pp,
                "tp": c.layout.tp,
                "dp": c.layout.dp,
                "cp": c.layout.cp,
                "ep": c.layout.ep,
                "micro_batch": c.layout.micro_batch,
                "recompute": c.layout.recompute,
                "sequence_parallel": c.layout.sequence_parallel,
                "dp_shard": c.layout.dp_shard,
                "dp_replicate": c.layout.dp_replicate,
                "offload": c.layout.offload,
                "schedule": c.layout.schedule,
                "virtual_stages": c.layout.virtual_stages,
                "reason": c.reason,
                **c.prediction.as_json(),
            }
            for c in res.feasible[: args.top]
        ]
        rejected = [
            {
                "pp": r.pp,
                "tp": r.tp,
                "dp": r.dp,
                "dp_shard": r.dp_shard,
                "option": r.option,
                "reason": r.reason,
            }
            for r in res.rejected
        ]
        print(json.dumps({"feasible": rows, "rejected": rejected}, indent=1))
        return 0
    kv = f", kv={w.kv}" if w.gated else ""
    kv += f", d={w.hd}" if w.q_width != w.hidden else ""
    kv += f", E={w.experts} top-{w.top_k} F={w.expert_ffn}" if w.moe else ""
    kv += f", shared={w.shared_experts}" if w.shared_experts else ""
    print(
        f"{w.layers}×{w.hidden} {display_name(w.family)} (a={w.heads}{kv}, s={w.seq}, V={w.vocab}), global "
        f"batch {w.global_batch}, {args.gpus} GPUs of {cluster.name}"
        + (f", cp={args.cp}" if args.cp > 1 else "")
        + (f", ep={args.ep}" if args.ep > 1 else "")
    )
    print("best layout per pp × tp × dp, fastest first:")
    for i, c in enumerate(best[: args.top], 1):
        print(f" {i}. {_layout_text(c.layout)}: {_rate_text(c.prediction)}; {c.reason}")
    n = len(res.feasible)
    print(f"({n} feasible layout{'' if n == 1 else 's'} in all)")
    for r in res.rejected:
        mode = f" dp_shard={r.dp_shard}" if r.dp_shard else ""
        mode += f" {r.option}" if r.option else ""
        print(f" rejected pp={r.pp} tp={r.tp} dp={r.dp}{mode}: {r.reason}")
    return 0


def _layout_text(lay: Layout) -> str:
    pipeline = f" {lay.schedule}" + (f"×{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
    return (
        f"pp={lay.pp} tp={lay.tp} dp={lay.dp} mb={lay.micro_batch} recompute={lay.recompute} "
        f"sp={int(lay.sequence_parallel)} dp_shard={lay.dp_shard}"
        + (pipeline if lay.pp > 1 else "")
        + (f" dp_replicate={lay.dp_replicate}" if lay.dp_replicate > 1 else "")
        + (f" offload={lay.offload}" if lay.offload != "none" else "")
        + (f" cp={lay.cp}" if lay.cp > 1 else "")
        + (f" ep={lay.ep}" if lay.ep > 1 else "")
    )


def _rate_text(p) -> str:
    return f"{p.tokens_per_s:,.0f} tok/s, MFU {100 * p.mfu:.1f}%, step {p.step_time_s:.3g} s"


def _check_offload(cluster: ClusterSpec, offload: str | None) -> None:
    """--offload optimizer on a cluster whose ranks share the host's memory moves the state
    within the memory it is counted against: refused, as it would price a saving that is
    not there."""
    if offload and offload != "none" and cluster.memory_shared:
        raise ValueError(
            f"--offload {offload} moves optimizer state to host memory, which on "
            f"{cluster.name} is the memory its ranks already share (device.memory_shared); "
            "drop --offload"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point; config errors print one line and return 2."""
    args = build_parser().parse_args(argv)
    try:
        cluster = load_cluster(args.cluster, base=args.compute_from)
        _check_nodes(cluster, args.gpus)
        _check_offload(cluster, args.offload)
        w = workload_from_args(args, cluster)
        return (run_predict if args.command == "predict" else run_search)(args, w, cluster)
    except ValueError as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
