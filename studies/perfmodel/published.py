"""Published Megatron-LM throughputs with tensor + data parallelism only, and our predictions.

Sources (read from the Megatron-LM repository's README tables):

- A100: Megatron-LM README, April 2021 (image ``images/cases_april2021.png``, commit
  50a4b5fa02), the runs of Narayanan et al. 2021 on Selene (DGX A100 80GB nodes), vocab
  51,200, sequence 2,048. Rows with model-parallel size ≤ 8 are pure TP (no pipeline).
  The table gives no head count: a = h/128 is assumed (it only sizes the softmax traffic).
  The software of the time recomputed activations, used a fused (not flash) softmax and
  all-reduced gradients after backward; the FLOP/s it reports count the recomputation.
- H100: Megatron-Core README (``images/model_table.png``, commit d98e8a6), vocab 131,072,
  sequence 4,096, rows with pipeline size 1, reported as model FLOP/s (MFU × 989). The
  README lists DP and TP communication overlap; we also take flash attention, sequence
  parallelism and the distributed optimizer (which that DP overlap presumes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from studies.perfmodel.cluster_spec import load_cluster
from studies.perfmodel.family_table import FAMILIES
from studies.perfmodel.model import Layout, Prediction, Workload, model_flops, predict
from studies.perfmodel.search import search


@dataclass(frozen=True)
class PublishedRow:
    """One published measurement: sizes, layout, GPUs and per-GPU TFLOP/s."""

    label: str
    cluster: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    tp: int
    gpus: int
    global_batch: int
    tflops: float
    hardware_flops: bool  # True: the figure counts recomputation
    fitted: bool = False  # the row the H100's per-tile GEMM cost k0 was fitted to (not validation)
    pp: int = 1  # pipeline stages


_MACHINES = {
    "A100": dict(cluster="dgx_a100_80gb", vocab=51200, seq=2048, hardware_flops=True),
    "H100": dict(cluster="dgx_h100", vocab=131072, seq=4096, hardware_flops=False),
}
# The rows of the two README tables, one a line. The rows with pipeline parallelism (PP > 1)
# are read from the same two images. The 2021 table gives only the model-parallel size: TP 8
# (one node) × PP = size ÷ 8 is the split of the paper's Table 1 that the README's sizes
# allow (every layer count divides by it); the schedule (1F1B or interleaved with 2 chunks)
# and micro-batch are the planner's best.
_README_TABLE = """
run          | GPU  | hidden | layers | heads | TP | PP | GPUs | global batch | TFLOP/s | fitted
1.7B (2021)  | A100 |   2304 |     24 |    18 |  1 |  1 |   32 |          512 |   137   |
3.6B (2021)  | A100 |   3072 |     30 |    24 |  2 |  1 |   64 |          512 |   138   |
7.5B (2021)  | A100 |   4096 |     36 |    32 |  4 |  1 |  128 |          512 |   142   |
18.4B (2021) | A100 |   6144 |     40 |    48 |  8 |  1 |  256 |         1024 |   135   |
39B (2021)   | A100 |   8192 |     48 |    64 |  8 |  2 |  512 |         1536 |   138   |
76B (2021)   | A100 |  10240 |     60 |    80 |  8 |  4 | 1024 |         1792 |   140   |
145B (2021)  | A100 |  12288 |     80 |    96 |  8 |  8 | 1536 |         2304 |   148   |
310B (2021)  | A100 |  16384 |     96 |   128 |  8 | 16 | 1920 |         2160 |   155   |
530B (2021)  | A100 |  20480 |    105 |   160 |  8 | 35 | 2520 |         2520 |   163   |
1T (2021)    | A100 |  25600 |    128 |   200 |  8 | 64 | 3072 |         3072 |   163   |
1.7B (Core)  | H100 |   2048 |     24 |    16 |  1 |  1 |   48 |          192 |   408.8 | yes
7.1B (Core)  | H100 |   4096 |     30 |    32 |  2 |  1 |   96 |          192 |   465.9 |
16B (Core)   | H100 |   6144 |     32 |    48 |  4 |  1 |  192 |          192 |   489.1 |
32B (Core)   | H100 |   7168 |     48 |    56 |  8 |  1 |  384 |          192 |   459.6 |
70B (Core)   | H100 |   8192 |     84 |    64 |  8 |  2 |  768 |          384 |   419.7 |
119B (Core)  | H100 |  10240 |     92 |    80 |  8 |  4 | 1536 |          768 |   420.5 |
177B (Core)  | H100 |  12288 |     96 |    96 |  8 |  6 | 2304 |         1152 |   432.8 |
314B (Core)  | H100 |  16384 |     96 |   128 |  8 |  8 | 3072 |         1536 |   474.4 |
462B (Core)  | H100 |  18432 |    112 |   144 |  8 | 16 | 6144 |         3072 |   459.9 |
"""


def _read_table(text: str) -> tuple[PublishedRow, ...]:
    """The rows of ``_README_TABLE``, each with its GPU's cluster, vocabulary, sequence and
    FLOP count. The figures are stated as text, one row a line, so that each is written once
    and the table reads as a table (not as nineteen keyword calls)."""
    size_fields = ("hidden", "layers", "heads", "tp", "pp", "gpus", "global_batch")
    rows = []
    for line in text.strip().splitlines()[1:]:
        label, gpu, *sizes, tflops, fitted = (cell.strip() for cell in line.split("|"))
        row = dict(zip(size_fields, map(int, sizes), strict=True)) | _MACHINES[gpu]
        rows.append(PublishedRow(label, tflops=float(tflops), fitted=fitted == "yes", **row))
    return tuple(rows)


_README_ROWS = _read_table(_README_TABLE)
ROWS = tuple(r for r in _README_ROWS if r.pp == 1)
PIPELINE_ROWS = tuple(r for r in _README_ROWS if r.pp > 1)


def _software(row: PublishedRow) -> tuple[Layout, dict]:
    """The code's fixed options (base layout) and the searched options it allows."""
    if row.hardware_flops:  # 2021: recompute on, fused softmax, reduce after backward
        base = Layout(1, 1, 1, fused_attention=False, overlap_grad_reduce=False)
        return base, {
            "recompute": ("full",),
            "sequence_parallel": (False,),
            "dp_shard": ("none",),
            "pp": (row.pp,),
        }
    base = Layout(1, 1, 1, overlap_param_gather=True, tp_comm_overlap=True)
    return base, {"sequence_parallel": (True,), "dp_shard": ("optimizer",), "pp": (row.pp,)}


@dataclass
class RowResult:
    """Prediction for one published row at its TP, and the planner's own best TP."""

    row: PublishedRow
    predicted: float
    micro_batch: int
    recompute: str
    best_tp: int
    schedule: str = "-"

    @property
    def error(self) -> float:
        """Relative error of the prediction (+ means we predict faster)."""
        return self.predicted / self.row.tflops - 1


def evaluate(row: PublishedRow) -> RowResult:
    """Search the row's GPU count at its pipeline size; take the best layout at its TP."""
    cluster = load_cluster(row.cluster)
    w = Workload(row.hidden, row.layers, row.heads, row.vocab, row.seq, row.global_batch)
    base, only = _software(row)
    result = search(w, cluster, row.gpus, base=base, only=only)
    at_tp = [c for c in result.feasible if c.layout.tp == row.tp]
    if not at_tp:
        raise ValueError(f"{row.label}: no feasible layout at tp={row.tp}")
    best = at_tp[0]
    p = best.prediction
    value = p.hardware_tflops_per_gpu if row.hardware_flops else p.model_tflops_per_gpu
    lay = best.layout
    schedule = "-" if lay.pp == 1 else lay.schedule
    if lay.schedule == "interleaved_1f1b":
        schedule += f" v={lay.virtual_stages}"
    return RowResult(
        row, value, lay.micro_batch, lay.recompute, result.feasible[0].layout.tp, schedule
    )


def evaluate_all(rows: tuple[PublishedRow, ...] = ROWS) -> list[RowResult]:
    """Every published row."""
    return [evaluate(r) for r in rows]


def summary(results: list[RowResult]) -> tuple[float, float, int]:
    """(max |error|, median |error| over the rows not fitted to, rows where the planner's best
    TP is the published one)."""
    errors = [abs(r.error) for r in results if not r.row.fitted]
    agree = sum(r.best_tp == r.row.tp for r in results)
    return max(errors), statistics.median(errors), agree


def markdown_table(results: list[RowResult]) -> str:
    """The validation table for docs/PERFMODEL.md (the pipeline rows add PP and schedule)."""
    piped = any(r.row.pp > 1 for r in results)
    head = "| run | GPUs | TP | " + ("PP | schedule | " if piped else "")
    head += "published TFLOP/s | predicted | error | mb, recompute | planner's TP |"
    body = []
    for r in results:
        pipe_cells = f"{r.row.pp} | {r.schedule} | " if piped else ""
        body.append(
            f"| {r.row.label}{' (fitted)' if r.row.fitted else ''} | {r.row.gpus} | {r.row.tp} | "
            f"{pipe_cells}{r.row.tflops:g} | {r.predicted:.1f} | {100 * r.error:+.1f}% | "
            f"{r.micro_batch}, {r.recompute} | {r.best_tp} |"
        )
    return _markdown(head, body)


def _markdown(head: str, body: list[str]) -> str:
    """A markdown table: the head row, the rule under it (``|---`` a column), the body rows."""
    return "\n".join([head, "|---" * (head.count("|") - 1) + "|", *body])


# Context parallelism: Llama 3 405B pre-training on H100s (Llama Team, AI @ Meta, "The
# Llama 3 Herd of Models", arXiv:2407.21783, 2024, Table 4 "Scaling configurations and
# MFU for each stage of Llama 3 405B pre-training"). Model (the paper's Table 3): 126
# layers, hidden 16,384, FFN 53,248, 128 heads, 8 KV heads, vocabulary 128,256 (128K).
# Each row: GPUs, TP, CP, PP, DP, sequence, batch per DP group, TFLOP/s per GPU, MFU.
# 126 layers over 16 stages is uneven (the paper trims a layer from the first and last
# stage); the planner prices the busiest stage's ceil(126/16) = 8 layers and is asked
# directly (predict), the layout check's ``layers % pp`` aside.
@dataclass(frozen=True)
class CpRow:
    """One Table 4 row of the Llama 3 paper."""

    label: str
    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq: int
    batch_per_dp: int
    tflops: float
    mfu: float


# The family the Llama 3 and Qwen3 rows are priced as: the table's first with a gated MLP
# (SwiGLU, grouped-query attention, untied head), asked of the table, not named.
GATED_ARCH = next(arch for arch, fam in FAMILIES.items() if fam.gated_mlp)
LLAMA3_CITATION = "Llama 3 Herd of Models (arXiv:2407.21783), Table 4"
LLAMA3_405B = dict(hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248, vocab=128256)
CP_ROWS = (
    CpRow("405B 8k, 8,192 GPUs", 8192, 8, 1, 16, 64, 8192, 32, 430, 0.43),
    CpRow("405B 8k, 16,384 GPUs", 16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
    CpRow("405B 128k, CP 16", 16384, 8, 16, 16, 8, 131072, 16, 380, 0.38),
)


class _BothCounts:
    """The relative errors of a prediction against a published figure (+ means we predict
    faster), under both attention counts: the full s² (Megatron's, as everywhere here) and
    the causal one, whose error is the step time's error in the publication's units. The
    subclass's ``_figures`` gives (full, causal, published)."""

    def _figures(self) -> tuple[float, float, float]:
        raise NotImplementedError

    @property
    def error(self) -> float:
        """Relative error of the full-s² count."""
        full, _, published = self._figures()
        return full / published - 1

    @property
    def error_causal(self) -> float:
        """Relative error of the causal count."""
        _, causal, published = self._figures()
        return causal / published - 1


@dataclass
class CpResult(_BothCounts):
    """Our best layout at a row's TP × CP × PP × DP, and its MFU under both attention counts."""

    row: CpRow
    layout: Layout
    mfu: float  # model FLOPs with the full s² attention (Megatron's count, as everywhere here)
    mfu_causal: float  # the same step with the attention FLOPs halved (the causal work)
    memory_gib: float
    cp_exposed_s: float

    def _figures(self) -> tuple[float, float, float]:
        return self.mfu, self.mfu_causal, self.row.mfu


def evaluate_cp(row: CpRow) -> CpResult:
    """The fastest fitting layout at the row's split: micro-batch 1, sequence parallelism,
    TP communication overlap, the distributed optimizer or ZeRO-2 (the paper's FSDP keeps
    the parameters gathered), 1F1B or interleaved 1F1B with 2, 4 or 8 chunks, no or full
    recompute."""
    from dataclasses import replace

    cluster = load_cluster("dgx_h100")
    w = Workload(**LLAMA3_405B, seq=row.seq, global_batch=row.dp * row.batch_per_dp)
    w = replace(w, family=GATED_ARCH)
    schedules = [("1f1b", 1)] + [("interleaved_1f1b", v) for v in (2, 4, 8)]
    layouts = [
        _large_run_layout(row, recompute, shard, schedule, v, cp=row.cp)
        for shard in ("optimizer", "gradients")
        for schedule, v in schedules
        for recompute in ("none", "full")
    ]
    lay, p, fits = _fastest(w, layouts, cluster)
    if not fits:
        raise ValueError(f"{row.label}: no layout fits {cluster.memory_bytes / 2**30:.0f} GiB")
    attention = _attention_flops(w)
    causal = p.mfu * (1 - 0.5 * attention / (p.mfu * p.step_time_s * lay.gpus * cluster.peak_flops))
    return CpResult(row, lay, p.mfu, causal, p.memory_gib_per_gpu, p.breakdown["cp_comm_exposed_s"])


def _large_run_layout(
    row: CpRow | MoeRow, recompute: str, dp_shard: str, schedule: str, virtual: int, **split
) -> Layout:
    """A layout of the row's TP × DP × PP as the large published runs train: micro-batch 1,
    sequence parallelism, the parameter all-gather and the TP collectives overlapped;
    ``split`` adds the row's CP or EP."""
    return Layout(
        row.tp,
        row.dp,
        1,
        recompute,
        sequence_parallel=True,
        dp_shard=dp_shard,
        overlap_param_gather=True,
        tp_comm_overlap=True,
        pp=row.pp,
        schedule=schedule,
        virtual_stages=virtual,
        **split,
    )


def _fastest(w: Workload, layouts: list[Layout], cluster) -> tuple[Layout, Prediction, bool]:
    """The fastest of ``layouts`` that fits the cluster's memory (the first of equals), else
    the fastest of all; and whether it fits."""
    limit = cluster.memory_bytes / 2**30
    priced = [(lay, predict(w, lay, cluster)) for lay in layouts]
    fits = [(lay, p) for lay, p in priced if p.memory_gib_per_gpu <= limit]
    lay, p = min(fits or priced, key=lambda o: o[1].step_time_s)
    return lay, p, bool(fits)


def _attention_flops(w: Workload) -> float:
    """The model FLOPs of the full s² attention scores and values in a step (forward and
    backward): the term the causal counts halve."""
    return 3 * w.layers * 4 * w.global_batch * w.seq * w.seq * w.q_width


def cp_markdown_table(results: list[CpResult]) -> str:
    """The Llama 3 comparison table for docs/PERFMODEL.md."""
    head = (
        "| row | TP × CP × PP × DP | seq | published MFU | predicted MFU (full s²) | error | "
        "predicted MFU (causal) | error | layout | GiB/GPU | CP exposed s |"
    )
    body = []
    for r in results:
        lay, row = r.layout, r.row
        sched = "1f1b" if lay.schedule == "1f1b" else f"interleaved v={lay.virtual_stages}"
        body.append(
            f"| {row.label} | {row.tp}×{row.cp}×{row.pp}×{row.dp} | {row.seq} | "
            f"{100 * row.mfu:.0f}% | {100 * r.mfu:.1f}% | {100 * r.error:+.1f}% | "
            f"{100 * r.mfu_causal:.1f}% | {100 * r.error_causal:+.1f}% | "
            f"{sched}, {lay.dp_shard}, recompute {lay.recompute} | {r.memory_gib:.1f} | "
            f"{r.cp_exposed_s:.3g} |"
        )
    return _markdown(head, body)


# Mixture of experts: Qwen3-235B-A22B on 256 H100s, read from the Megatron-Core MoE model
# zoo (github.com/yanring/Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md at commit
# c1ad0b5c89): the rows whose expert-parallel group lies within the DP ranks (EP 8 | DP 8)
# and whose CP is 1 — the planner carves ep from dp. "Per GPU TF" are model TFLOP/s. The
# zoo's experts are not TP-split (ETP 1); the planner splits them over TP as the dense
# MLP is (same FLOPs and bytes per rank, other GEMM shapes). Model (its Hugging Face
# config, from memory): 94 layers, hidden 4096, 64 heads of 128 (q 8192 ≠ h), 4 KV heads,
# 128 experts, top-8, expert width 1536, no shared expert, vocabulary 151,936.
_QWEN3_DENSE = dict(hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128, vocab=151936)
QWEN3_235B = _QWEN3_DENSE | dict(experts=128, top_k=8, moe_ffn=1536, family=GATED_ARCH)
MOE_CITATION = "Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (c1ad0b5c89)"


@dataclass(frozen=True)
class MoeRow:
    """One Qwen3-235B row of the model zoo."""

    label: str
    gpus: int
    tp: int
    ep: int
    pp: int
    vpp: int
    dp: int
    seq: int
    global_batch: int
    tflops: float


MOE_ROWS = (
    # "Intra-node EP strategy", DeepEP, no recompute: 29.0 s a step
    MoeRow("Qwen3-235B s4096", 256, 4, 8, 8, 4, 8, 4096, 2048, 167),
    # "Long Context", CP 1: 295 with forced load balance (the planner's balanced routing),
    # 237 dropless; selective recompute of norms and MoE
    MoeRow("Qwen3-235B s16384 (forced balance)", 256, 4, 8, 8, 4, 8, 16384, 256, 295),
)


@dataclass
class MoeResult(_BothCounts):
    """Our best layout at a row's split and its model TFLOP/s."""

    row: MoeRow
    layout: Layout
    predicted: float  # model TFLOP/s with the full s² attention (as everywhere here)
    predicted_causal: float  # the same step, the attention FLOPs halved (the zoo's count)
    a2a_s: float
    step_s: float
    memory_gib: float

    def _figures(self) -> tuple[float, float, float]:
        return self.predicted, self.predicted_causal, self.row.tflops


def evaluate_moe(row: MoeRow) -> MoeResult:
    """The fastest fitting layout at the row's split (micro-batch 1, sequence parallelism,
    the distributed optimizer, TP overlap, the row's interleaving, no or full recompute);
    94 layers over 8 stages are priced as the busiest stage's 12, as for Llama 3."""
    w = Workload(**QWEN3_235B, seq=row.seq, global_batch=row.global_batch)
    schedule = "interleaved_1f1b" if row.vpp > 1 else "1f1b"
    layouts = [
        _large_run_layout(row, recompute, "optimizer", schedule, row.vpp, ep=row.ep)
        for recompute in ("none", "full")
    ]
    lay, p, _ = _fastest(w, layouts, load_cluster("dgx_h100"))
    attention = _attention_flops(w)
    causal = (model_flops(w, lay.tp) - attention / 2) / p.step_time_s / lay.gpus / 1e12
    return MoeResult(
        row,
        lay,
        p.model_tflops_per_gpu,
        causal,
        p.breakdown["ep_a2a_s"],
        p.step_time_s,
        p.memory_gib_per_gpu,
    )


def moe_markdown_table(results: list[MoeResult]) -> str:
    """The Qwen3 comparison table for docs/PERFMODEL.md."""
    head = (
        "| row | TP × EP × PP (v) × DP | published TFLOP/s | predicted (causal) | error | "
        "predicted (full s²) | error | step s | all-to-all s | recompute | GiB/GPU |"
    )
    body = []
    for r in results:
        row = r.row
        body.append(
            f"| {row.label} | {row.tp}×{row.ep}×{row.pp} ({row.vpp})×{row.dp} | {row.tflops:g} | "
            f"{r.predicted_causal:.1f} | {100 * r.error_causal:+.1f}% | "
            f"{r.predicted:.1f} | {100 * r.error:+.1f}% | {r.step_s:.3g} | {r.a2a_s:.3g} | "
            f"{r.layout.recompute} | {r.memory_gib:.1f} |"
        )
    return _markdown(head, body)
