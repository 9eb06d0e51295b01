"""Predict one training step of a decoder (GPT, or a gated-MLP family such as Llama) at a
pp × dp × tp layout.

Step time = (micro-batches per rank) × (compute + exposed TP communication + pipeline
          hand-off of one micro-batch on the slowest stage) × (1 + bubble)
          + exposed DP communication + optimizer step (+ host overhead per operator).

Compute per micro-batch is the sum of its GEMMs (forward; backward costs two GEMMs of the
same shape per forward GEMM), the attention core, and the element-wise traffic; recompute
adds the forward of what it recomputes. TP all-reduces sit on the critical path. The DP
gradient all-reduce (or ZeRO-1's reduce-scatter) overlaps the last micro-batch's backward
bucket by bucket; what outlasts it is exposed. Under ZeRO-2/3 (``dp_shard`` gradients or
full) the gathers and reduce-scatters overlap compute layer by layer (FSDP2 prefetching);
under HSDP (``dp_replicate`` R > 1) they run within a replica's dp ÷ R ranks, and each
reduce-scatter is followed by an all-reduce of the 1/(dp ÷ R) shard across the R replicas.

Context parallelism (``cp``; ranks pp · dp · cp · tp) gives each rank s/cp tokens and 1/cp
of the causal attention work; its ring exchanges of K and V blocks overlap the block
compute, and the gradients reduce over dp × cp. Mixture of experts (``experts``, ``top_k``,
``moe_ffn``, ``shared_experts``; ``ep`` carved from dp) prices the active FLOPs, E/ep
experts' state per rank and the all-to-alls on the critical path. See docs/PERFMODEL.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.formulas import (
    fsdp_in_flight_bytes,
    gpt_flops_per_iteration,
    llama_flops_per_iteration,
    llama_layer_weights,
    pad_vocab,
    state_bytes_per_param,
)
from engine.pipeline.split import dp_rule, microbatch_rule, virtual_rule
from studies.perfmodel import comm_cost as comm
from studies.perfmodel import pipeline as pipe
from studies.perfmodel.cluster_spec import ClusterSpec, scale_for
from studies.perfmodel.compute import (
    gemm_pass_seconds,
    rank_speed,
    reduction_factor,
    stream_seconds,
)
from studies.perfmodel.family_table import DEFAULT_ARCH, FAMILIES, PLANNED
from studies.perfmodel.in_model import lookup, nearest, parameter_tensors, tp_collectives
from studies.perfmodel.memory_model import (
    DP_SHARD,
    MemoryTerms,
    activation_bytes,
)

RECOMPUTE = ("none", "selective", "full")
# Element-wise traffic per token and layer, forward, in elements of width h: two LayerNorms
# (read + write: 4), two dropout + residual adds (read 2, write 1: 6); the MLP's bias-GeLU
# reads and writes the f-wide activation (2·f/h). Backward moves about twice as much.
EW_H_ELEMS = 10
# Unfused attention core: scale-mask-softmax (read + write) and dropout (read, write, mask)
# over the a·s scores of each token.
EW_SCORE_ELEMS = 5
# Host-side operators per layer per micro-batch (forward ~20, backward ~40): they matter
# only where ``op_overhead_us`` is measured (CPU ranks, where every op is synchronous).
OPS_PER_LAYER = 60
# AdamW + gradient clipping, bytes moved per parameter updated (grads read twice, weights,
# master and both moments read and written).
OPTIMIZER_BYTES = {"fp32": 40, "bf16": 42}
# What ``parallel.offload`` may move to the host (the runtime's spelling).
OFFLOAD = ("none", "optimizer")
OFFLOADED_STATE_BYTES = 12  # fp32 master + Adam's two fp32 moments, per parameter


@dataclass(frozen=True)
class Workload:
    """The model and batch: sizes, global batch in sequences, precision, family.

    ``family`` is a ``model.arch`` (engine/models/families.py). A family with a gated MLP
    (``gated_mlp``: Llama's) is priced as that family's layers are built: SwiGLU MLP of
    width ``ffn`` (three matrices), ``kv_heads`` key/value heads (grouped-query attention),
    untied LM head, no biases, RMSNorm, rotary positions. The others: GPT-2's layers.
    """

    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    global_batch: int
    ffn: int | None = None
    precision: str = "bf16"  # "bf16"/"fp16" or "fp32"
    vocab_multiple: int = 128  # vocab padded to a multiple of tp × this
    family: str = DEFAULT_ARCH
    kv_heads: int | None = None  # gated families: key/value heads (None: as many as query heads)
    head_dim: int | None = None  # per head (None: hidden ÷ heads); heads × head_dim may ≠ hidden
    experts: int = 0  # routed experts E per MoE layer (0: a dense MLP); every layer is MoE
    top_k: int = 1  # experts K each token is routed to
    moe_ffn: int | None = None  # one expert's MLP width F (None: ffn)
    shared_experts: int = 0  # experts of width F every token passes through as well

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def gated(self) -> bool:
        """Whether the family's MLP is gated, so its layers are priced as Llama's (an
        arch the table lacks reads as GPT's, as the config reads it; layout_problems
        names it)."""
        fam = FAMILIES.get(self.family)
        return fam is not None and fam.gated_mlp

    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads

    @property
    def ffn_size(self) -> int:
        """MLP width, 4h by default."""
        return self.ffn or 4 * self.hidden

    @property
    def hd(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention output): heads × head_dim."""
        return self.heads * self.hd

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        """One expert's MLP width F."""
        return self.moe_ffn or self.ffn_size

    @property
    def active_ffn(self) -> int:
        """The MLP width one token passes through: K routed + the shared experts' F each
        under MoE, else ffn."""
        if self.moe:
            return (self.top_k + self.shared_experts) * self.expert_ffn
        return self.ffn_size

    def padded_vocab(self, tp: int) -> int:
        """Embedding rows at this TP size."""
        return pad_vocab(self.vocab, tp * self.vocab_multiple)


@dataclass(frozen=True)
class Layout:
    """How the work is split and which memory/communication options are on."""

    tp: int
    dp: int  # data-parallel ranks (cp's ranks come on top: gpus = pp · dp · cp · tp)
    micro_batch: int
    recompute: str = "none"
    sequence_parallel: bool = False
    dp_shard: str = "none"  # none | optimizer (ZeRO-1) | gradients (ZeRO-2) | full (ZeRO-3)
    dp_replicate: int = 1  # HSDP replicas (gradients/full): shards span dp ÷ dp_replicate
    offload: str = "none"  # none | optimizer (sharded modes: the optimizer state on the host)
    fused_attention: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    bucket_mb: float = 25.0
    threads: int | None = None  # CPU threads per rank; None: cores ÷ ranks, as the trainer sets
    pp: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    virtual_stages: int = 1  # layer chunks per rank (interleaved_1f1b)
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence (ring attention)
    ep: int = 1  # expert-parallel ranks, carved from dp: each holds E/ep experts

    @property
    def zero1(self) -> bool:
        """The older name of ``dp_shard="optimizer"``."""
        return self.dp_shard == "optimizer"

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same weights and reduce their gradients together: dp × cp."""
        return self.dp * self.cp

    @property
    def shard_dp(self) -> int:
        """The ranks one DP shard is split over: dp × cp, or one HSDP replica's share."""
        return self.dp_cp // self.dp_replicate

    @property
    def gpus(self) -> int:
        """Ranks of the layout."""
        return self.pp * self.dp * self.cp * self.tp


@dataclass
class Prediction:
    """The predicted step: times in seconds, throughputs, memory in GiB."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    memory_gib_per_gpu: float
    micro_batch: int
    breakdown: dict[str, float | dict[str, float]] = field(default_factory=dict)
    memory: MemoryTerms | None = None

    def as_json(self) -> dict:
        """What ``plan.py predict --json`` prints: every field in order but ``memory`` (the
        memory terms, which the search reads to say why no layout fits)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "memory"}


def layer_params_per_rank(w: Workload, tp: int) -> float:
    """Parameters of one layer on one TP rank: its weight shards plus replicated vectors;
    under MoE the dense part only (the router, the shared experts: expert_params_per_rank
    holds the routed experts)."""
    h, f = w.hidden, w.ffn_size
    if w.gated:  # KV heads split over TP, each held by t/kv ranks when TP exceeds them
        g = llama_layer_weights(h, f, w.kv * w.hd)
        g["q_out"] = 2 * h * w.q_width  # Q and the output projection: h × heads·head_dim
        if w.moe:  # shared experts split as the dense MLP is; the router replicated
            g["mlp"] = 3 * h * w.shared_experts * w.expert_ffn
            g["norms"] += h * w.experts
        return (g["q_out"] + g["mlp"]) / tp + g["kv"] / min(tp, w.kv) + g["norms"]
    return (4 * h * h + 2 * h * f + 3 * h + f) / tp + 6 * h  # row biases and LNs replicated


def expert_params_per_rank(w: Workload, tp: int, pp: int = 1, ep: int = 1) -> float:
    """Routed-expert parameters one rank holds: its stage's layers × E/ep experts × a SwiGLU
    of width F (3·h·F), each split over TP as the dense MLP is. 0 for a dense model."""
    if not w.moe:
        return 0.0
    per_layer = w.experts / ep * 3 * w.hidden * w.expert_ffn / tp
    return pipe.stage_layers(w.layers, pp) * per_layer


def vocab_params_per_rank(w: Workload, tp: int, pp: int = 1) -> float:
    """Embedding-side parameters of the rank holding the most: both ends at pp 1; under a
    pipeline the first stage's embedding (GPT: with positions) or the last stage's head
    (GPT keeps a tied copy there; its final LayerNorm)."""
    table = w.padded_vocab(tp) * w.hidden / tp
    if w.gated:
        return (2 if pp == 1 else 1) * table + w.hidden  # untied head; final RMSNorm
    return table + w.seq * w.hidden + 2 * w.hidden


def params_per_rank(w: Workload, tp: int, pp: int = 1, ep: int = 1) -> float:
    """Parameters one rank holds: its stage's layers (l/pp), embedding-side share and
    (MoE) its E/ep routed experts."""
    stage = pipe.stage_layers(w.layers, pp) * layer_params_per_rank(w, tp)
    return stage + vocab_params_per_rank(w, tp, pp) + expert_params_per_rank(w, tp, pp, ep)


def dense_params_per_rank(w: Workload, tp: int, pp: int = 1) -> float:
    """The parameters every dp × cp rank holds alike (all but the routed experts)."""
    return params_per_rank(w, tp, pp) - expert_params_per_rank(w, tp, pp)


def gemm_shapes(w: Workload, lay: Layout) -> list[tuple[int, int, int, int]]:
    """Forward GEMMs of one micro-batch on one rank: (m, n, k, count); layers then LM head.

    A cp rank holds s/cp tokens of each sequence. Under MoE each rank's E/ep experts
    receive, with balanced routing, the K·tokens rows its ep group routes to them: E/ep
    grouped GEMMs of K·tokens·ep/E rows each; the router is a (tokens, E, h) GEMM and the
    shared experts one MLP of width shared·F."""
    t, h, f, q = lay.tp, w.hidden, w.ffn_size, w.q_width
    tokens = lay.micro_batch * w.seq // lay.cp
    per_layer = [
        (tokens, 3 * q // t, h),
        (tokens, h, q // t),
        (tokens, f // t, h),
        (tokens, h, f // t),
    ]
    if w.gated:  # Q + the rank's KV heads; gate and up as one column-parallel GEMM
        kv_cols = 2 * w.kv * w.hd // min(t, w.kv)
        per_layer[0] = (tokens, q // t + kv_cols, h)
        per_layer[2] = (tokens, 2 * f // t, h)
    layers = pipe.stage_layers(w.layers, lay.pp)
    if w.moe:
        per_layer = per_layer[:2] + [(tokens, w.experts, h)]
        if w.shared_experts:
            shared = w.shared_experts * w.expert_ffn // t
            per_layer += [(tokens, 2 * shared, h), (tokens, h, shared)]
    shapes = [(m, n, k, layers) for m, n, k in per_layer]
    if w.moe:
        rows = max(1, round(w.top_k * tokens * lay.ep / w.experts))
        count = layers * w.experts // lay.ep
        shapes += [(rows, 2 * w.expert_ffn // t, h, count), (rows, h, w.expert_ffn // t, count)]
    return shapes + [(tokens, w.padded_vocab(t) // t, h, 1)]


def score_bytes(w: Workload, lay: Layout) -> float:
    """Forward element-wise bytes of an unfused attention core (scale-mask-softmax, dropout;
    cp 1 only: the layout check asks for fused attention under cp)."""
    heads = w.heads // lay.tp
    return EW_SCORE_ELEMS * lay.micro_batch * heads * w.seq * w.seq * w.act_bytes


def elementwise_bytes(w: Workload, lay: Layout) -> tuple[float, float]:
    """(one layer's forward element-wise bytes, the fp32 logits' forward + backward bytes)."""
    tokens = lay.micro_batch * w.seq / lay.cp
    rows = tokens / (lay.tp if lay.sequence_parallel else 1)
    mlp = 3 if w.gated else 2  # SwiGLU reads gate and up, writes the product; bias-GeLU 2
    elems = rows * w.hidden * EW_H_ELEMS + tokens * mlp * w.active_ffn / lay.tp
    logits = tokens * w.padded_vocab(lay.tp) / lay.tp
    return elems * w.act_bytes, 3 * 4 * logits * 4  # softmax and its gradient, fp32


def _attention_seconds(w: Workload, lay: Layout, cluster: ClusterSpec, speed: float) -> float:
    """Forward + backward of the attention core (QKᵀ, softmax, ·V) of one micro-batch."""
    b, s, t = lay.micro_batch, w.seq, lay.tp
    heads, d = w.heads // t, w.hd
    if lay.fused_attention:
        # Flash attention: a causal kernel skips the masked half of the tiles, and its
        # backward recomputes the scores (2.5× the forward's FLOPs instead of 2×). A query
        # tile's loop runs over the keys before its one epilogue, s/2 of them on average
        # under the causal mask: that is its reduction length. Under cp the load-balanced
        # split (each rank two mirrored chunks of s/2cp) leaves each rank 1/cp of the causal
        # work, run as blocks of s/cp keys (one kernel call per ring step).
        flops = 0.5 * 4 * b * s * s * w.q_width / t / lay.cp * 3.5
        keys = s / 2 if lay.cp == 1 else s / lay.cp
        eff = cluster.gemm_efficiency * reduction_factor(cluster, keys)
        return flops / (cluster.peak_flops * eff * speed)
    scores_f, scores_b = gemm_pass_seconds(cluster, s, s, d, w.act_bytes, speed)  # QKᵀ
    context_f, context_b = gemm_pass_seconds(cluster, s, d, s, w.act_bytes, speed)  # ·V
    softmax = stream_seconds(cluster, score_bytes(w, lay), speed)
    return b * heads * (scores_f + scores_b + context_f + context_b) + 3 * softmax


def _compute_seconds(w: Workload, lay: Layout, cluster: ClusterSpec, speed: float) -> dict:
    """GEMM, attention, element-wise and recompute seconds of one micro-batch on one rank."""
    passes = [
        (c, gemm_pass_seconds(cluster, m, n, k, w.act_bytes, speed))
        for m, n, k, c in gemm_shapes(w, lay)
    ]
    fwd_layers = sum(c * f for c, (f, _) in passes[:-1])
    gemm = sum(c * (f + b) for c, (f, b) in passes)
    gemm_backward = sum(c * b for c, (_, b) in passes)
    layers = pipe.stage_layers(w.layers, lay.pp)
    attention = layers * _attention_seconds(w, lay, cluster, speed)
    layer_bytes, logit_bytes = elementwise_bytes(w, lay)
    elementwise = stream_seconds(cluster, 3 * layers * layer_bytes + logit_bytes, speed)
    recompute = 0.0
    if lay.recompute == "full":
        recompute = fwd_layers + attention / 3 + elementwise / 3
    elif lay.recompute == "selective" and not lay.fused_attention:
        recompute = attention / 3
    overhead = OPS_PER_LAYER * layers * cluster.op_overhead_s
    parts = {
        "gemm": gemm,
        "attention": attention,
        "elementwise": elementwise,
        "recompute": recompute,
        "host_overhead": overhead,
        "total": gemm + attention + elementwise + recompute + overhead,
        "backward": gemm_backward + (attention + elementwise) * 2 / 3,
    }
    # The measured cost of running these ops in the trainer rather than alone (in_model.py).
    scale = scale_for(cluster.compute_scale, w.hidden)
    return {k: v * scale for k, v in parts.items()}


def _tp_comm_seconds(
    w: Workload,
    lay: Layout,
    cluster: ClusterSpec,
    link: comm.Link,
    ranks: int | None,
    compute_s: float,
) -> float:
    """TP collectives of one micro-batch, all on the critical path.

    Each layer all-reduces b·s·h activations twice forward and twice backward (under SP an
    all-gather + reduce-scatter pair of the same volume each); full recompute repeats the
    first forward one (in_model.tp_collectives). The vocab-parallel embedding (forward) and the LM head's input
    (backward) add one each; the cross-entropy adds two small fp32 all-reduces (b·s and 2·b·s values). Where the
    cluster has in-model measurements (CPU ranks, studies/perfmodel/in_model.py), TP costs
    what training steps were measured to lose to it: a time per collective plus a fraction
    of the micro-batch's compute (``compute_s``).
    """
    t = lay.tp
    if t <= 1:
        return 0.0
    count = tp_collectives(pipe.stage_layers(w.layers, lay.pp), lay.recompute)
    kind = "sp" if lay.sequence_parallel else "ar"
    rows = cluster.in_model.get("tp", ()) if ranks else ()  # None: TP spans nodes
    if measured := nearest(rows, (t, kind), ranks or 0):
        per_collective_us, fraction = measured[-2:]
        return count * per_collective_us * 1e-6 + fraction * compute_s
    tokens = lay.micro_batch * w.seq // lay.cp  # a cp rank's share of each sequence
    n, big = tokens * w.hidden * w.act_bytes, count - 2
    if lay.sequence_parallel:
        one = comm.ring_all_gather(n, t, link) + comm.ring_reduce_scatter(n, t, link)
    else:
        one = comm.all_reduce(n, t, link, cluster.collectives)
    # fp32 row max, then [sum of exp; target logit]
    small = sum(comm.all_reduce(k * tokens * 4, t, link, cluster.collectives) for k in (1, 2))
    return big * one + small


def cp_ring_bytes(w: Workload, lay: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one cp rank sends per layer and micro-batch in ring attention.

    Forward: cp − 1 exchanges of one K and one V block, s/cp tokens × the rank's KV heads
    (kv/tp, at least one) × head_dim each. Backward: the K, V blocks pass again and the dK,
    dV accumulated for them travel home: twice the forward bytes."""
    if lay.cp <= 1:
        return 0.0, 0.0
    kv_heads = max(1, w.kv // lay.tp) if w.gated else w.heads // lay.tp
    block = lay.micro_batch * w.seq / lay.cp * kv_heads * w.hd * w.act_bytes
    forward = (lay.cp - 1) * 2 * block
    return forward, 2 * forward


def cp_link(lay: Layout, cluster: ClusterSpec) -> comm.Link:
    """The link a cp group crosses: its ranks are tp apart (mesh order pp, dp, cp, tp), so it
    is placed as a DP group of cp ranks would be."""
    return comm.group_link(comm.place_groups(lay.tp, lay.cp, cluster.gpus_per_node)[1], cluster)


def _cp_comm_seconds(
    w: Workload, lay: Layout, cluster: ClusterSpec, attention_s: float
) -> tuple[float, float]:
    """(total, exposed) seconds of one micro-batch's ring exchanges over the stage's layers.

    Each step's send/receive (one message per ring step: latency + bytes/bandwidth) runs
    while the previous block computes; per layer and pass the part beyond ``overlap
    efficiency`` × that pass's attention compute (``attention_s``: one layer's forward +
    backward, 1 : 2.5) is exposed. Full recompute repeats the forward ring."""
    if lay.cp <= 1:
        return 0.0, 0.0
    link = cp_link(lay, cluster)
    fwd_bytes, bwd_bytes = cp_ring_bytes(w, lay)
    steps = lay.cp - 1
    fwd = steps * link.latency_s + fwd_bytes / link.bandwidth_Bps
    bwd = steps * link.latency_s + bwd_bytes / link.bandwidth_Bps
    eff = cluster.overlap_efficiency
    attn_f, attn_b = attention_s / 3.5, attention_s * 2.5 / 3.5
    passes = [(fwd, attn_f), (bwd, attn_b)] + ([(fwd, attn_f)] if lay.recompute == "full" else [])
    layers = pipe.stage_layers(w.layers, lay.pp)
    total = layers * sum(c for c, _ in passes)
    exposed = layers * sum(max(0.0, c - eff * a) for c, a in passes)
    return total, exposed


def a2a_bytes(w: Workload, lay: Layout) -> float:
    """Bytes one rank sends in one all-to-all of one MoE layer and micro-batch: its tokens
    (s/cp per sequence; /tp under sequence parallelism) × K copies × h × the activation
    width × (ep − 1)/ep (the share routed to the other ep ranks, balanced routing)."""
    if not w.moe or lay.ep <= 1:
        return 0.0
    tokens = lay.micro_batch * w.seq / lay.cp / (lay.tp if lay.sequence_parallel else 1)
    return tokens * w.top_k * w.hidden * w.act_bytes * (lay.ep - 1) / lay.ep


def ep_link(lay: Layout, cluster: ClusterSpec) -> comm.Link:
    """The link an ep group crosses: ep neighbouring dp ranks, tp × cp apart."""
    group = comm.place_groups(lay.tp * lay.cp, lay.ep, cluster.gpus_per_node)[1]
    return comm.group_link(group, cluster)


def _a2a_seconds(w: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """All-to-all seconds of one micro-batch, all on the critical path: per MoE layer the
    dispatch and the combine forward and their two transposes backward (4; 6 under full
    recompute), each (ep − 1) latencies + its bytes over the ep link."""
    n = a2a_bytes(w, lay)
    if not n:
        return 0.0
    link = ep_link(lay, cluster)
    one = (lay.ep - 1) * link.latency_s + n / link.bandwidth_Bps
    count = 6 if lay.recompute == "full" else 4
    return pipe.stage_layers(w.layers, lay.pp) * count * one


def _dp_comm_seconds(
    w: Workload,
    lay: Layout,
    cluster: ClusterSpec,
    link: comm.Link,
    passes: tuple[float, float],
    ranks: int,
) -> tuple[float, float]:
    """(total, exposed) seconds per step of the DP collectives, ``passes`` = (forward,
    backward) seconds of one micro-batch.

    none / optimizer: fp32 gradients are reduced in buckets during the last micro-batch's
    backward; the first bucket fills only after 1/buckets of it, and the last bucket's
    reduction always waits (ZeRO-1 then all-gathers the 16-bit parameters). Without overlap
    (or on a CPU whose cores are all computing) it is all exposed. On CPU ranks the
    measured in-model wait for the slowest rank is added (in_model.py) to both: a rank spends
    it inside the collective, which returns when the last rank has joined, so the exposed
    time never exceeds the total (as the runtime's step timer counts them).
    """
    d = lay.dp_cp  # cp ranks hold the same weights: the gradients reduce over dp × cp
    if d <= 1:
        return 0.0, 0.0
    wait = lookup(cluster.in_model.get("dp_wait_us", ()), (d,), ranks) or 0.0
    if lay.dp_shard in ("gradients", "full"):
        total, exposed = _fsdp_comm_seconds(w, lay, link, passes, cluster)
        return total + wait, exposed + wait
    # the dense parameters over dp × cp; each routed expert over the dp × cp ÷ ep ranks that
    # hold it (ranks tp · ep apart, placed as such a DP group)
    groups = [(dense_params_per_rank(w, lay.tp, lay.pp), d, link)]
    if w.moe:
        e_group = comm.place_groups(lay.tp * lay.ep, d // lay.ep, cluster.gpus_per_node)[1]
        e_params = expert_params_per_rank(w, lay.tp, lay.pp, lay.ep)
        groups.append((e_params, d // lay.ep, comm.group_link(e_group, cluster)))
    grad_bytes = sum(n for n, _, _ in groups) * 4
    buckets = max(1, round(grad_bytes / (lay.bucket_mb * 2**20)))
    reduce = gather = 0.0
    for n, size, lk in groups:
        if lay.zero1:
            reduce += comm.ring_reduce_scatter(n * 4, size, lk)
            gather += comm.ring_all_gather(n * w.act_bytes, size, lk)
        else:
            reduce += comm.all_reduce(n * 4, size, lk, cluster.collectives)
    exposed = reduce
    if lay.overlap_grad_reduce:
        window = passes[1] * (1 - 1 / buckets) * cluster.overlap_efficiency
        exposed = max(reduce / buckets, reduce - window)
    if lay.overlap_param_gather:  # gathered bucket by bucket ahead of the next forward
        exposed += gather / buckets
    else:
        exposed += gather
    return reduce + gather + wait, exposed + wait


def dp_traffic_bytes(
    params: float, act_bytes: int, d: int, dp_shard: str, micro_steps: int, replicate: int = 1
) -> float:
    """Bytes one rank sends per step in its DP collectives (ring volumes, (d−1)/d of each).

    none: an all-reduce of the fp32 gradients (2·4·P); optimizer: their reduce-scatter plus
    the parameters' all-gather (4P + aP, a the 16-bit width); gradients (ZeRO-2): the same,
    the gradients reduce-scattered every micro-batch; full (ZeRO-3): per micro-batch the
    parameters gathered for forward and again for backward and the gradients
    reduce-scattered (2·aP + 4P: 1.5× the all-reduce where a = 4).

    HSDP (``replicate`` R > 1, gradients or full): the same within a replica's s = d ÷ R
    ranks (ring (s−1)/s), plus per reduce-scatter a ring all-reduce of the 4P/s-byte
    gradient shard across the R replicas (2·(R−1)/R · 4P/s).
    """
    if replicate > 1:
        if dp_shard not in ("gradients", "full"):
            raise ValueError(f"dp_replicate={replicate} needs dp_shard gradients or full")
        s = d // replicate
        within = dp_traffic_bytes(params, act_bytes, s, dp_shard, micro_steps)
        across = 2 * (replicate - 1) / replicate * 4 * params / s
        return within + micro_steps * across
    ring = (d - 1) / d
    grads, gather = 4 * params, act_bytes * params
    per_mode = {
        "none": 2 * grads,
        "optimizer": grads + gather,
        "gradients": micro_steps * grads + gather,
        "full": micro_steps * (2 * gather + grads),
    }
    return ring * per_mode[dp_shard]


def _fsdp_comm_seconds(
    w: Workload, lay: Layout, link: comm.Link, passes: tuple[float, float], cluster: ClusterSpec
) -> tuple[float, float]:
    """(total, exposed) per step under FSDP2 (ZeRO-2/3), layer by layer with prefetching.

    Each layer's collective runs while the previous layer computes: per pass, the exposed
    part is the first layer's (nothing computes before it) or what outlasts the pass's
    compute, whichever is larger. ZeRO-3 gathers forward and backward and reduce-scatters
    every micro-batch; ZeRO-2 gathers once per step (the parameters stay whole) and
    reduce-scatters every micro-batch.
    """
    d, m = lay.shard_dp, w.global_batch // (lay.dp * lay.micro_batch)  # dense only (no MoE)
    params = params_per_rank(w, lay.tp, lay.pp)
    units = pipe.stage_layers(w.layers, lay.pp) + 1  # the layers and the embedding-side unit
    if lay.dp_replicate > 1:  # the shard group's link; its reduce-scatters then all-reduce
        link, across = hybrid_links(lay, cluster)
    gather = comm.ring_all_gather(params * w.act_bytes, d, link)
    reduce = comm.ring_reduce_scatter(params * 4, d, link)
    if lay.dp_replicate > 1:
        reduce += comm.all_reduce(params * 4 / d, lay.dp_replicate, across, cluster.collectives)
    eff = cluster.overlap_efficiency

    def exposed(t_comm: float, t_compute: float) -> float:
        return max(t_comm / units, t_comm - t_compute * eff)

    fwd, bwd = passes
    if lay.dp_shard == "full":
        total = m * (2 * gather + reduce)
        return total, m * (exposed(gather, fwd) + exposed(gather + reduce, bwd))
    return m * reduce + gather, m * exposed(reduce, bwd) + exposed(gather, fwd)


def hybrid_links(lay: Layout, cluster: ClusterSpec) -> tuple[comm.Link, comm.Link]:
    """(shard group, replicate group) links under HSDP: a replica is dp ÷ R neighbouring
    dp ranks (``tp`` apart, as a DP group), so the shard group is placed as a DP group of
    that size; the R ranks holding one shard are tp · dp ÷ R apart, each on its own node
    once that stride fills a node, and the tp · dp ÷ R replicate groups of a node share
    its network."""
    s, gpn = lay.shard_dp, cluster.gpus_per_node
    shard = comm.place_groups(lay.tp, s, gpn)[1]
    stride = lay.tp * s
    per_node = max(1, gpn // stride)
    nodes = max(1, -(-lay.dp_replicate // per_node))
    replicate = comm.GroupPlacement(lay.dp_replicate, nodes, min(stride, gpn))
    return comm.group_link(shard, cluster), comm.group_link(replicate, cluster)


def _optimizer_seconds(
    w: Workload, lay: Layout, cluster: ClusterSpec, speed: float, ranks: int
) -> float:
    """AdamW over this rank's parameters (its 1/d shard under ZeRO-1): memory-bound, plus
    on CPU ranks the measured rest of the optimizer phase (in_model.py)."""
    sharded = lay.dp_shard != "none"
    experts = expert_params_per_rank(w, lay.tp, lay.pp, lay.ep)
    dense = params_per_rank(w, lay.tp, lay.pp, lay.ep) - experts
    params = dense / (lay.shard_dp if sharded else 1) + experts / (
        lay.shard_dp // lay.ep if sharded else 1
    )
    if lay.offload == "optimizer":
        return offload_seconds(params, w.act_bytes, cluster)
    per_param = OPTIMIZER_BYTES["fp32" if w.precision == "fp32" else "bf16"]
    per_tensor = lookup(cluster.in_model.get("optimizer_us_per_tensor", ()), (), ranks) or 0.0
    extra = per_tensor * parameter_tensors(pipe.stage_layers(w.layers, lay.pp))
    return stream_seconds(cluster, params * per_param, speed) + extra


def offload_seconds(params: float, act_bytes: int, cluster: ClusterSpec) -> float:
    """The optimizer step of ``params`` (a rank's shard) under ``offload=optimizer``: its fp32
    gradients down and its updated compute-width parameters up the host link, and CPU Adam
    over the shard's fp32 master and two moments (12 bytes a parameter) at the cluster's
    host rate. None of it overlaps the backward (priced as the runtime steps: after it)."""
    copies = params * (4 + act_bytes) / cluster.host_link_Bps
    return copies + params * OFFLOADED_STATE_BYTES / cluster.host_adam_Bps


def memory_terms(w: Workload, lay: Layout) -> MemoryTerms:
    """Bytes per GPU by kind on the rank holding the most (before the fragmentation margin)."""
    experts = expert_params_per_rank(w, lay.tp, lay.pp, lay.ep)
    params = params_per_rank(w, lay.tp, lay.pp, lay.ep) - experts  # the dense part
    weights, grads, opt = state_bytes_per_param(w.precision, lay.dp_shard, lay.shard_dp)
    # each expert's state is sharded (ZeRO-1) over the dp × cp ÷ ep ranks holding it
    e_w, e_g, e_o = state_bytes_per_param(w.precision, lay.dp_shard, lay.shard_dp // lay.ep)
    in_flight = fsdp_in_flight_bytes(
        layer_params_per_rank(w, lay.tp),
        vocab_params_per_rank(w, lay.tp, lay.pp),
        w.precision,
        lay.dp_shard,
    )
    micro_steps = w.global_batch // (lay.dp * lay.micro_batch)
    acts = activation_bytes(
        w.seq // lay.cp,
        lay.micro_batch,
        w.hidden,
        w.heads,
        pipe.stage_layers(w.layers, lay.pp),
        w.padded_vocab(lay.tp),
        lay.tp,
        w.act_bytes,
        sp=lay.sequence_parallel,
        recompute=lay.recompute,
        fused_attention=lay.fused_attention,
        gated_ffn=w.active_ffn if w.gated else None,
        in_flight=pipe.in_flight_micro_batches(
            lay.pp, micro_steps, lay.schedule, lay.virtual_stages
        ),
        routed_copies=w.top_k if w.moe else 0,
    )
    on_device = 0.0 if lay.offload == "optimizer" else 1.0  # the state lives on the host
    return MemoryTerms(
        params * weights + experts * e_w + in_flight,
        params * grads + experts * e_g,
        (params * opt + experts * e_o) * on_device,
        acts,
    )


def model_flops(w: Workload, tp: int, *, recompute: bool = False) -> int:
    """Matmul FLOPs of one step (engine.formulas: the family's formula, padded vocabulary)."""
    args = (w.global_batch, w.seq, w.layers, w.hidden, w.padded_vocab(tp))
    if w.gated and (w.moe or w.q_width != w.hidden):
        return active_flops_per_iteration(w, tp, recompute=recompute)
    if w.gated:
        kv_width = w.kv * w.hd
        return llama_flops_per_iteration(
            *args, ffn_hidden=w.ffn_size, kv_width=kv_width, recompute=recompute
        )
    return gpt_flops_per_iteration(*args, recompute=recompute, ffn_hidden=w.ffn)


def active_flops_per_iteration(w: Workload, tp: int, *, recompute: bool = False) -> int:
    """Matmul FLOPs of one step of a gated model counted on its active parameters: per token
    and layer 2·(2·h·q + 2·h·kv_width + 3·h·F·(K + shared) + h·E) (q = heads · head_dim; the
    last term the router), the attention core 4·s·q per token (the full s², as
    ``llama_flops_per_iteration`` counts it), the LM head 2·h·V; ×3 forward + backward (×4
    for layers under full recompute). Equal to ``llama_flops_per_iteration`` for a dense
    model with q = h."""
    h, q, kv_width = w.hidden, w.q_width, w.kv * w.hd
    tokens = w.global_batch * w.seq
    projections = 2 * tokens * (2 * h * q + 2 * h * kv_width + 3 * h * w.active_ffn)
    router = 2 * tokens * h * w.experts
    attention = 4 * w.global_batch * w.seq * w.seq * q
    lm_head = 2 * tokens * h * w.padded_vocab(tp)
    return (4 if recompute else 3) * w.layers * (projections + router + attention) + 3 * lm_head


def skipped_attention_flops(w: Workload, lay: Layout) -> float:
    """The attention FLOPs a step's model count includes but a causal flash kernel never
    runs: half of the core's 4·s·q per token (the tiles above the diagonal), in each
    forward, backward and recomputed forward pass. Model FLOPs (and MFU, by convention)
    count the full s², so at long sequences MFU can pass 100 %; hardware FLOPs do not."""
    if not lay.fused_attention:
        return 0.0
    passes = 4 if lay.recompute == "full" else 3
    return passes * w.layers * 0.5 * 4 * w.global_batch * w.seq * w.seq * w.q_width


def _pipeline_seconds(
    w: Workload, lay: Layout, cluster: ClusterSpec, micro_steps: int
) -> tuple[float, float]:
    """(hand-off seconds per micro-batch on the critical path, bubble fraction)."""
    if lay.pp <= 1:
        return 0.0, 0.0
    n = pipe.p2p_bytes(
        lay.micro_batch, w.seq // lay.cp, w.hidden, w.act_bytes, lay.tp, sp=lay.sequence_parallel
    )
    link = pipe.p2p_link(lay.pp, lay.tp * lay.cp * lay.dp, cluster)
    p2p = pipe.p2p_seconds_per_micro_batch(n, lay.schedule, lay.virtual_stages, link, lay.pp)
    bubble = pipe.bubble_fraction(lay.pp, micro_steps, lay.schedule, lay.virtual_stages)
    return p2p, bubble


def predict(w: Workload, lay: Layout, cluster: ClusterSpec) -> Prediction:
    """Price one step of ``w`` at ``lay`` on ``cluster`` (the layout must divide; see search)."""
    gpus = lay.gpus
    micro_steps = w.global_batch // (lay.dp * lay.micro_batch)
    # CPU specs (cores set) describe one machine: every rank, of every emulated node, shares it
    ranks_here = gpus if cluster.cores else min(gpus, cluster.gpus_per_node)
    speed = rank_speed(cluster, ranks_here, lay.threads)
    # mesh order pp, dp, cp, tp: the gradient group (dp × cp ranks) is tp apart
    tp_group, dp_group = comm.place_groups(lay.tp, lay.dp_cp, cluster.gpus_per_node)
    c = _compute_seconds(w, lay, cluster, speed)
    tp_link = comm.group_link(tp_group, cluster)
    in_node = ranks_here if tp_group.nodes <= 1 else None  # in-model terms: one machine's
    tp = _tp_comm_seconds(w, lay, cluster, tp_link, in_node, c["total"])
    if lay.tp_comm_overlap:  # chunked GEMM/collective overlap hides TP comm behind GEMMs
        tp = max(0.0, tp - c["gemm"])
    layers = pipe.stage_layers(w.layers, lay.pp)
    cp_total, cp_exposed = _cp_comm_seconds(w, lay, cluster, c["attention"] / layers)
    a2a = _a2a_seconds(w, lay, cluster)
    passes = (c["total"] - c["backward"], c["backward"])
    dp_link = comm.group_link(dp_group, cluster)
    dp_total, dp_exposed = _dp_comm_seconds(w, lay, cluster, dp_link, passes, ranks_here)
    optimizer = _optimizer_seconds(w, lay, cluster, speed, ranks_here)
    p2p, bubble = _pipeline_seconds(w, lay, cluster, micro_steps)
    busy = micro_steps * (c["total"] + tp + cp_exposed + a2a + p2p)
    step = busy * (1 + bubble) + dp_exposed + optimizer
    model = model_flops(w, lay.tp)
    full = lay.recompute == "full"
    hardware = model_flops(w, lay.tp, recompute=True) if full else model
    hardware -= skipped_attention_flops(w, lay)
    mem = memory_terms(w, lay)
    breakdown = {
        "compute_s": micro_steps * c["total"],
        "tp_comm_s": micro_steps * tp,
        "cp_comm_exposed_s": micro_steps * cp_exposed,
        "cp_comm_total_s": micro_steps * cp_total,
        "ep_a2a_s": micro_steps * a2a,
        "pp_p2p_s": micro_steps * p2p,
        "pp_bubble_s": busy * bubble,
        "dp_comm_exposed_s": dp_exposed,
        "dp_comm_total_s": dp_total,
        "optimizer_s": optimizer,
        "compute_detail_s": {k: micro_steps * v for k, v in c.items() if k != "backward"},
        "memory_gib": mem.as_dict(),
    }
    return Prediction(
        step_time_s=step,
        tokens_per_s=w.global_batch * w.seq / step,
        model_tflops_per_gpu=model / step / gpus / 1e12,
        hardware_tflops_per_gpu=hardware / step / gpus / 1e12,
        mfu=model / step / gpus / cluster.peak_flops,
        memory_gib_per_gpu=(mem.total + cluster.reserved_bytes) / 2**30,
        micro_batch=lay.micro_batch,
        breakdown=breakdown,
        memory=mem,
    )


def layout_problems(w: Workload, lay: Layout, gpus: int) -> list[str]:
    """Why this layout cannot run (sizes that do not divide); empty when it can."""
    problems = []
    if lay.gpus != gpus:
        cp = f" × cp={lay.cp}" if lay.cp > 1 else ""
        problems.append(f"pp={lay.pp} × dp={lay.dp}{cp} × tp={lay.tp} != gpus={gpus}")
    problems += workload_problems(w, lay.cp, lay.ep)
    if lay.ep > 1 and lay.dp % lay.ep:
        problems.append(f"ep={lay.ep} does not divide dp={lay.dp} (ep is carved from dp)")
    if lay.cp > 1 and not lay.fused_attention:
        problems.append(f"cp={lay.cp} needs fused attention (ring attention is a flash kernel)")
    if w.moe and lay.dp_shard in ("gradients", "full"):
        problems.append(f"dp_shard={lay.dp_shard} with experts is not modelled (none/optimizer)")
    for name, value in (("heads", w.heads), ("ffn", w.ffn_size), ("hidden", w.hidden)):
        if value % lay.tp:
            problems.append(f"{name}={value} is not divisible by tp={lay.tp}")
    if w.gated and lay.tp % w.kv and w.kv % lay.tp:
        problems.append(f"kv_heads={w.kv} and tp={lay.tp}: one must divide the other")
    if lay.sequence_parallel and (w.seq // lay.cp) % lay.tp:
        problems.append(
            f"seq={w.seq} ÷ cp={lay.cp} is not divisible by tp={lay.tp} (sequence parallel)"
        )
    if w.global_batch % (lay.dp * lay.micro_batch):
        problems.append(
            f"global_batch={w.global_batch} is not divisible by dp={lay.dp} × "
            f"micro_batch={lay.micro_batch}"
        )
    if lay.recompute not in RECOMPUTE:
        problems.append(f"recompute={lay.recompute!r} is not one of {RECOMPUTE}")
    if lay.dp_shard not in DP_SHARD:
        problems.append(f"dp_shard={lay.dp_shard!r} is not one of {DP_SHARD}")
    if lay.dp_replicate < 1 or lay.dp % lay.dp_replicate:
        problems.append(f"dp_replicate={lay.dp_replicate} does not divide dp={lay.dp}")
    elif lay.dp_replicate > 1 and lay.dp_shard not in ("gradients", "full"):
        problems.append(f"dp_replicate={lay.dp_replicate} needs dp_shard gradients or full")
    if lay.offload not in OFFLOAD:
        problems.append(f"offload={lay.offload!r} is not one of {OFFLOAD}")
    elif lay.offload != "none" and lay.dp_shard == "none":
        problems.append(
            f"offload={lay.offload} needs a sharded dp_shard (optimizer, gradients or full)"
        )
    if w.family not in PLANNED:
        problems.append(f"family={w.family!r} is not one of {PLANNED}")
    return problems + pipeline_problems(w, lay)


def workload_problems(w: Workload, cp: int = 1, ep: int = 1) -> list[str]:
    """What stops the model's own sizes, and cp and ep, whatever the rest of the layout."""
    problems = []
    if cp < 1 or w.seq % (2 * cp) and cp > 1:
        problems.append(
            f"cp={cp} does not divide seq={w.seq} into 2·cp chunks (load-balanced causal split)"
        )
    if ep < 1:
        problems.append(f"ep={ep} must be >= 1")
    elif ep > 1 and not w.moe:
        problems.append(f"ep={ep} needs experts (--experts E)")
    if w.moe:
        if w.experts % ep:
            problems.append(f"ep={ep} does not divide experts={w.experts}")
        if not 1 <= w.top_k <= w.experts:
            problems.append(f"top_k={w.top_k} must be in [1, experts={w.experts}]")
        if not w.gated:
            problems.append(f"experts need a gated-MLP family (llama), not {w.family!r}")
    if w.experts < 0 or w.shared_experts < 0:
        problems.append("experts and shared_experts must be >= 0")
    if not w.head_dim and w.hidden % w.heads:  # the runtime's rule without a head width
        problems.append(
            f"hidden={w.hidden} is not divisible by heads={w.heads} (or give --head-dim)"
        )
    if w.head_dim and w.head_dim != w.hidden // w.heads and not w.gated:
        problems.append(f"head_dim={w.head_dim} != hidden/heads needs a gated-MLP family (llama)")
    return problems


def pipeline_problems(w: Workload, lay: Layout) -> list[str]:
    """Why the pipeline part of a layout cannot run, as the runtime's checks say it."""
    if lay.pp == 1:
        return []
    if lay.schedule not in pipe.SCHEDULES:
        return [f"schedule={lay.schedule!r} is not one of {pipe.SCHEDULES}"]
    chunks = lay.pp * pipe.stage_chunks(lay.schedule, lay.virtual_stages)
    problems = []
    if w.layers % chunks:
        problems.append(f"layers={w.layers} is not divisible by {chunks} stage chunks")
    m = w.global_batch // (lay.dp * lay.micro_batch)
    # the runtime's own rules (torch-free): engine/pipeline/split.py
    for rule in (
        virtual_rule(lay.schedule, lay.virtual_stages),
        microbatch_rule(lay.schedule, lay.pp, m),
        dp_rule(lay.schedule, lay.dp_shard, tied=not w.gated),  # GPT ties its head
    ):
        if rule:
            problems.append(rule)
    return problems
