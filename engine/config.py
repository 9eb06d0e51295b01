"""Typed configuration: the Hydra schemas (dataclasses) and their validation.

The YAML files under ``configs/`` only choose values; the types, defaults and one-line
docs live here and are registered in Hydra's ConfigStore, so a value of the wrong type is
rejected by Hydra before anything runs (an unknown key is caught earlier, by
engine/config_cli.py, which names the nearest real one). ``validate`` then checks what
types cannot express (ranges, finiteness, 64-bit bounds, divisibility, batch arithmetic,
paths) and returns one line per problem, naming the key and the numbers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from engine.data.fsutil import MISSING, file_problem
from engine.data.weights import normalized, split_fractions
from engine.models.config import ModelConfig
from engine.models.families import FAMILIES, family
from engine.pipeline.split import (
    SCHEDULES,
    compile_rule,
    dp_rule,
    layer_split,
    microbatch_rule,
    virtual_rule,
)
from parallel_state.dims import LayoutError, ParallelDims


@dataclass
class DataConfig:
    """Where the tokens come from."""

    prefixes: list[str] = field(default_factory=list)  # PREFIX of .bin/.idx; empty: stdlib corpus
    weights: list[float] = field(default_factory=list)  # blending weights, one per prefix
    tokenizer: str | None = None  # tokenizer.json; default PREFIX.tokenizer.json of the first
    split: str = "949,50,1"  # train,valid,test document split weights
    seq_len: int = 128  # tokens per training sequence
    default_vocab_size: int = 8192  # BPE vocabulary of the embedded stdlib corpus
    default_max_bytes: int = 4_000_000  # stdlib source bytes taken into the embedded corpus
    cache_dir: str | None = None  # embedded corpus cache; default $MESHTRON_CACHE or ~/.cache
    seed: int = 1234  # shuffling and masking seed
    document_mask: bool = False  # GPT/Llama: attention and positions stay within documents


@dataclass
class OptimConfig:
    """AdamW (or Muon on the transformer layers' matrices) with linear warmup and cosine decay."""

    algorithm: str = "adamw"  # "adamw", or "muon": Muon on the layers' matrices, AdamW on the rest
    lr: float = 6e-4  # peak learning rate
    min_lr: float = 6e-5  # learning rate at the end of the cosine decay
    warmup_steps: int = 20  # linear warmup from 0 to lr
    decay_steps: int | None = None  # cosine length after warmup; None: max_steps - warmup
    weight_decay: float = 0.1  # decoupled weight decay (not on biases and norms)
    beta1: float = 0.9  # Adam β1
    beta2: float = 0.95  # Adam β2
    eps: float = 1e-8  # Adam ε
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    impl: str = "auto"  # "auto" (fused torch on CUDA), "torch", or "apex" (FusedAdam)
    distributed: bool = False  # ZeRO-1: shard Adam state and fp32 master weights across DP
    scale_lr_with_batch: int = 0  # linear scaling: lr, min_lr × global_batch / this; 0 off
    # optim.algorithm=muon (engine/muon.py): torch.optim.Muon's numbers.
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per update
    muon_adjust_lr: str = "match_rms_adamw"  # torch's adjust_lr_fn: match_rms_adamw or original


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = 150  # optimizer steps
    global_batch: int = 16  # sequences per optimizer step, across all DP ranks
    micro_batch: int = 4  # sequences per forward/backward on one rank
    precision: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU), "fp32", "bf16" or "fp16"
    device: str = "auto"  # "auto" (a GPU per rank when there are enough, else CPU), "cuda", "cpu"
    seed: int = 1234  # model init and dropout seed
    log_every: int = 10  # console/TensorBoard interval in steps
    eval_every: int = 50  # validation interval in steps; 0 disables
    eval_batches: int = 4  # validation micro-batches per evaluation (the same at any layout)
    grad_bucket_mb: float = 25.0  # DP bucket size (all-reduce, ZeRO-1; FSDP has none)
    memory_cap_gib: float = 0.0  # per-rank memory budget (0: the device's); enforced on CUDA
    tensorboard: bool = True  # TensorBoard scalars in CHECKPOINT_DIR/tensorboard, kept over resumes
    wandb_project: str | None = None  # log to Weights & Biases when set (wandb must be installed)
    profile_steps: list[int] = field(default_factory=list)  # [first, last] step to trace
    sample_tokens: int = 48  # tokens sampled from the GPT after training; 0 disables
    sample_prompt: str = "def "  # prompt of that sample
    sample_temperature: float = 0.8  # sampling temperature
    sample_top_k: int = 40  # top-k of the sample
    loss_scale_init: float = 65536.0  # fp16 dynamic loss scaling: initial scale
    progress: bool = True  # rich progress bar on rank 0
    max_restarts: int = 0  # self-launched workers: restart them this often after a failure
    fail_at_step: int = 0  # fault injection: rank 1 dies after this step, once per checkpoint dir
    # Failures stop the run with one line and a non-zero exit (issue 10):
    max_bad_steps: int = 10  # bad steps in a row (non-finite, fp16 overflow) that stop the run
    collective_timeout_s: float = 600.0  # no progress this long (a frozen peer) stops; 0: off
    collective_startup_timeout_s: float | None = None  # limit while ranks start; null: 5x the above
    rendezvous_timeout_s: float = 300.0  # every rank must join the run within this, else stop
    # Scaling studies (issue 12):
    metrics_file: str | None = None  # rank 0 writes every step's time breakdown here as JSON
    step_timing: bool = True  # time TP/DP collectives for the breakdown (off: phases only)
    overlap_grad_reduce: bool = True  # DP reduces during backward (off: after it; not FSDP)


@dataclass
class CheckpointConfig:
    """Where the model and the resumable training state go."""

    dir: str | None = None  # stable directory; default checkpoints/<experiment name>
    save_final: bool = True  # export the model alone to <dir>/final at the end of training
    every: int = 50  # resumable checkpoint every N steps and at the end; 0: none
    keep: int = 2  # resumable checkpoints kept (the newest)
    resume: bool = True  # continue from <dir>/latest when it exists
    async_save: bool = False  # write saves in the background once copied to host memory
    # weights a new run starts from (a model export, a training checkpoint or a Hugging
    # Face directory of this model); optimizer, step and data start afresh; not read when
    # the run resumes its own checkpoint
    init_from: str | None = None


@dataclass
class ParallelConfig:
    """The layout: ranks per layer, replicas and stages, and what the DP axis shards."""

    tp: int = 2  # tensor-parallel size, ranks sharing each layer (short form: tp_size=)
    dp: Any = 2  # data-parallel size, or "auto": world ÷ (tp × cp × pp) (short form: dp_size=)
    pp: int = 1  # pipeline stages the layers are cut into; 1: none (short form: pp_size=)
    cp: int = 1  # context-parallel ranks splitting each sequence (ring attention; cp_size=)
    ep: int = 1  # dp ranks splitting each MoE layer's experts; 1: none (short form: ep_size=)
    dp_shard: str = "none"  # DP shards: none, optimizer (ZeRO-1), gradients (ZeRO-2), full (ZeRO-3)
    dp_replicate: int = 1  # HSDP replicas, each dp ÷ dp_replicate FSDP shards; 1: none
    # none, or optimizer: Adam's state and the fp32 masters in CPU memory, stepped there
    # (needs dp_shard != none; under FSDP, gradients/full, parameters and gradients too)
    offload: str = "none"
    # Also model.sequence_parallel=true, the key the layers read: either turns it on.
    sequence_parallel: bool = False  # shard norms and dropout along the sequence inside TP
    schedule: str | None = None  # the pipeline schedule (null: pipeline.schedule's, 1f1b)


# The sizes' short forms, top-level keys: ``tp_size=2`` sets ``parallel.tp``.
SHORT_FORMS = {"tp_size": "tp", "dp_size": "dp", "pp_size": "pp", "cp_size": "cp", "ep_size": "ep"}
PIPELINE_SCHEDULES = SCHEDULES  # engine/pipeline/split.py


@dataclass
class PipelineConfig:
    """How pipeline stages run (parallel.pp sets the stages; the micro-batches of the
    schedule are the step's gradient accumulation, global_batch ÷ (micro_batch × dp))."""

    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv or dualpipev
    virtual_stages: int = 1  # stages per pipeline rank: >= 2 interleaved, 2 for zbv/dualpipev
    layers_per_stage: list[int] = field(default_factory=list)  # per stage; empty: equal runs


@dataclass
class Config:
    """Everything a pre-training run needs.

    The sizes live in ``parallel``; ``tp_size``, ``dp_size``, ``pp_size``, ``cp_size`` and
    ``ep_size``
    are their short forms. One given (not None) overrides the section's size, one left out mirrors
    it, so after construction both spellings read the same value. In code, change a size
    through its short form (``dataclasses.replace(cfg, dp_size=4)``): a replaced
    ``parallel`` section does not beat a short form the config already holds.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    name: str = "gpt_tiny_stdlib"  # experiment name (checkpoint and log directories)
    tp_size: int | None = None  # short for parallel.tp (null: the section's)
    dp_size: Any = None  # short for parallel.dp, an integer or auto (null: the section's)
    pp_size: int | None = None  # short for parallel.pp (null: the section's)
    cp_size: int | None = None  # short for parallel.cp (null: the section's)
    ep_size: int | None = None  # short for parallel.ep (null: the section's)
    run_dir: str = "."  # where logs go; set to Hydra's output directory at launch

    def __post_init__(self) -> None:
        short = {
            "tp": self.tp_size,
            "dp": self.dp_size,
            "pp": self.pp_size,
            "cp": self.cp_size,
            "ep": self.ep_size,
        }
        given = {axis: value for axis, value in short.items() if value is not None}
        if given:  # a new section: the old one may be shared with another Config
            self.parallel = dataclasses.replace(self.parallel, **given)
        p = self.parallel
        self.tp_size, self.dp_size, self.pp_size = p.tp, p.dp, p.pp
        self.cp_size, self.ep_size = p.cp, p.ep
        # Sequence parallelism and the schedule are layout choices too: the section and
        # the keys the layers and the pipeline read agree after construction.
        sp = p.sequence_parallel or self.model.sequence_parallel
        if self.model.sequence_parallel != sp:
            self.model = dataclasses.replace(self.model, sequence_parallel=sp)
        if p.schedule is not None and p.schedule != self.pipeline.schedule:
            self.pipeline = dataclasses.replace(self.pipeline, schedule=p.schedule)
        if (p.sequence_parallel, p.schedule) != (sp, self.pipeline.schedule):
            self.parallel = dataclasses.replace(
                p, sequence_parallel=sp, schedule=self.pipeline.schedule
            )


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent: a schema already stored
    from the same class is left as it is, since building its node again is most of the
    cost of a second registration, as when ``engine.pretrain`` runs again in a process)."""
    cs = ConfigStore.instance()
    schemas = {
        (None, "config_schema"): Config,
        ("model", "schema"): ModelConfig,
        ("data", "schema"): DataConfig,
        ("optim", "schema"): OptimConfig,
        ("trainer", "schema"): TrainerConfig,
        ("parallel", "schema"): ParallelConfig,
    }
    for (group, name), schema in schemas.items():
        folder = cs.repo.get(group, {}) if group else cs.repo
        stored = folder.get(f"{name}.yaml")
        if stored is None or OmegaConf.get_type(stored.node) is not schema:
            cs.store(group=group, name=name, node=schema)


def parallel_dims(cfg: Config, world_size: int | None) -> ParallelDims:
    """The run's layout, validated: the one place a training config becomes a
    :class:`ParallelDims`, read from the ``parallel`` section (``dp=auto`` is world ÷
    (tp · cp · pp), 1 with no launcher yet, since this process then starts tp · cp · pp
    ranks itself; ``optim.distributed=true`` is the older spelling of
    ``parallel.dp_shard=optimizer``). Raises LayoutError, one line."""
    p = cfg.parallel
    return ParallelDims.resolve(
        p.tp,
        p.dp,
        world_size,
        pp=p.pp,
        cp=p.cp,
        sequence_parallel=p.sequence_parallel,
        dp_shard=p.dp_shard,
        zero1=cfg.optim.distributed,
        ep=p.ep,
        dp_replicate=p.dp_replicate,
    )


def sized_dims(
    tp_size: int,
    dp_size: int | str | None,
    world_size: int | None = None,
    *,
    cp_size: int = 1,
    ep_size: int = 1,
) -> ParallelDims:
    """The layout of a run given by its sizes alone (classification, generation, the
    studies' tools): ``parallel_dims``'s checks and ``dp_size=auto`` rule, without pipeline
    stages, sequence parallelism or DP sharding. Raises LayoutError, one line."""
    return ParallelDims.resolve(tp_size, dp_size, world_size, cp=cp_size, ep=ep_size)


INT64_MAX = 2**63 - 1  # steps, seeds and counts a run can store and honour
MAX_LR = 1e3  # far above any working learning rate, far below what overflows at once
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def validate(cfg: Config, dims: ParallelDims) -> list[str]:
    """Every problem of ``cfg`` at the layout ``dims``, one line each (empty when it can run):
    each section's rules, then every number's type range for the keys none of them named."""
    problems = [
        *_validate_parallel(cfg, dims),
        *_validate_model(cfg, dims),
        *_validate_trainer(cfg, dims),
        *_validate_sampling(cfg),
        *_validate_optim(cfg),
        *_validate_checkpoint(cfg),
        *_validate_data(cfg, dims),
    ]
    return problems + numbers_out_of_range(cfg, problems)


def _validate_parallel(cfg: Config, dims: ParallelDims) -> list[str]:
    """What the layout's pipeline stages, expert parallelism and DP sharding need of the
    rest of the config. Context parallelism needs nothing of it (its sequence length is
    the layout's rule, ``ParallelDims.check_seq_len``): it composes with tp (and sequence
    parallelism), dp, pp, attention dropout, packed documents, experts, every family's
    attention options and ``model.compile`` (the ring runs eagerly between the graphs)."""
    problems = _validate_pipeline(cfg, dims)
    problems += _validate_experts(cfg, dims)
    if dims.dp_shard in ("gradients", "full"):
        problems += _validate_fsdp(cfg, dims)
    problems += _validate_offload(cfg, dims)
    if cfg.optim.distributed and cfg.optim.impl == "apex":
        problems.append("optim.distributed=true (ZeRO-1) runs torch's AdamW: set optim.impl=auto")
    if cfg.optim.algorithm == "muon" and dims.dp_shard != "none":
        problems.append(
            f"optim=muon needs whole gradients on every DP rank; parallel.dp_shard={dims.dp_shard} "
            "shards them: set parallel.dp_shard=none (and optim.distributed=false)"
        )
    return problems


OFFLOAD_MODES = ("none", "optimizer")


def _validate_offload(cfg: Config, dims: ParallelDims) -> list[str]:
    """``parallel.offload=optimizer`` steps the DP shard of Adam's state on the host: it
    needs a sharded DP mode to take the shard from, and torch's AdamW to step it."""
    offload = cfg.parallel.offload
    unknown = _not_one_of("parallel.offload", offload, OFFLOAD_MODES)
    if unknown or offload == "none":
        return unknown
    if dims.dp_shard == "none":
        return [
            "parallel.offload=optimizer moves the sharded optimizer state to the CPU, and "
            "parallel.dp_shard=none shards none: set parallel.dp_shard=optimizer (or "
            "gradients, full), or parallel.offload=none"
        ]
    if cfg.optim.impl == "apex":
        return [
            "parallel.offload=optimizer steps torch's AdamW on the CPU, and apex's FusedAdam "
            "runs on the GPU only: set optim.impl=auto"
        ]
    return []


def _decoders() -> str:
    """The causal families of the table, as a message lists them: "gpt, llama, ..."."""
    return ", ".join(arch for arch, f in FAMILIES.items() if f.causal)


def _validate_experts(cfg: Config, dims: ParallelDims) -> list[str]:
    """What ``parallel.ep`` needs of the model (experts to split, whole experts per ep
    rank; checkpoints store the experts whole, so they save and resume at any ep), the
    router losses' pooling under pp: each stage adds its own layers' losses, so a balance
    pooled over the whole model's layers cannot be split across stages, and a capacity
    under cp (a cp rank routes part of each sequence; the balance loss is summed over cp,
    ``layers.router.load_balancing_loss``, a capacity would not be)."""
    m, ep = cfg.model, dims.ep
    pooled = m.moe_aux_loss_pooling == "model" and m.moe_aux_loss_coeff  # z stays per layer
    if m.mlp == "moe" and dims.pp > 1 and pooled:
        return [
            f"pp_size={dims.pp} adds each stage's router losses per layer, not pooled over the "
            "model: set model.moe_aux_loss_pooling=layer, or pp_size=1"
        ]
    if m.mlp == "moe" and dims.cp > 1 and m.moe_capacity_factor is not None:
        return [
            f"cp_size={dims.cp} with model.moe_capacity_factor={m.moe_capacity_factor}: each "
            "cp rank would drop past a capacity of its part of the sequences, not of the whole; "
            "set model.moe_capacity_factor=null (dropless) or cp_size=1"
        ]
    if ep == 1:
        return []
    if m.mlp != "moe":
        return [
            f"ep_size={ep} splits the experts of model.mlp=moe; model.mlp={m.mlp} has none: set ep_size=1"
        ]
    if m.moe_num_experts % ep:
        return [
            f"model.moe_num_experts={m.moe_num_experts} is not divisible by ep_size={ep} "
            f"(each ep rank holds whole experts); choose an ep_size dividing {m.moe_num_experts}"
        ]
    return []


def _validate_fsdp(cfg: Config, dims: ParallelDims) -> list[str]:
    """What FSDP2 (``parallel.dp_shard`` gradients or full) does not run with, one line each."""
    mode, problems = f"parallel.dp_shard={dims.dp_shard}", []
    if cfg.trainer.precision == "fp16":
        problems.append(f"{mode} trains in bf16 or fp32, not fp16: set trainer.precision=bf16")
    if cfg.optim.impl == "apex":
        problems.append(f"{mode} runs torch's AdamW on the shards: set optim.impl=auto")
    problems += _unread(  # the bucketed all-reduce's settings: FSDP reduces by layer unit
        "trainer",
        cfg.trainer,
        ["grad_bucket_mb", "overlap_grad_reduce"],
        f"under {mode} (FSDP reduce-scatters each layer's gradients during backward, unbucketed)",
        "leave {it} unset",
    )
    return problems


def _validate_pipeline(cfg: Config, dims: ParallelDims) -> list[str]:
    """A known schedule, and what pp > 1 needs: eager stages, layers and micro-batches that
    the stages and the schedule can split (torch's rules, ``engine/pipeline/split.py``). At pp 1
    the pipeline keys would be ignored, so one set there is refused."""
    p, t, m = cfg.pipeline, cfg.trainer, cfg.model
    unknown = _not_one_of("pipeline.schedule", p.schedule, PIPELINE_SCHEDULES)
    if dims.pp == 1:
        return unknown or _pipeline_keys_unused(p)
    problems = []
    if unknown:
        return problems + unknown
    rule = dp_rule(p.schedule, dims.dp_shard, m.tie_embeddings)
    if rule:
        problems.append(f"pipeline.{rule}")
    rule = compile_rule(p.schedule, bool(m.compile), cuda_graphs=m.cuda_graphs)
    if rule:
        problems.append(f"pipeline.{rule}" if rule.startswith("schedule=") else rule)
    rule = virtual_rule(p.schedule, p.virtual_stages)
    if rule:
        fits = next(v for v in (2, 1) if virtual_rule(p.schedule, v) is None)
        problems.append(f"pipeline.{rule}: set pipeline.virtual_stages={fits}")
        return problems
    try:
        layer_split(m.num_layers, dims.pp * p.virtual_stages, p.layers_per_stage)
    except ValueError as err:
        problems.append(str(err))
    per_step = t.micro_batch * dims.dp
    micro = t.global_batch // per_step if per_step > 0 else 0
    rule = microbatch_rule(p.schedule, dims.pp, micro) if micro > 0 else None
    if rule:
        problems.append(
            f"pipeline.{rule} (global_batch ÷ (micro_batch × dp_size)); change trainer.global_batch"
        )
    return problems


def _pipeline_keys_unused(p: PipelineConfig) -> list[str]:
    """One line naming the pipeline keys set away from their defaults at pp 1, if any."""
    return _unread(
        "pipeline",
        p,
        [f.name for f in fields(p)],
        "at pp_size=1 (no pipeline)",
        "set pp_size (parallel.pp) > 1, or leave the pipeline keys at their defaults",
    )


def _unread(section: str, values: Any, keys: list[str], where: str, fix: str) -> list[str]:
    """One line naming the ``keys`` of ``values`` (``section``'s dataclass) set away from
    their defaults where nothing reads them (``where``), or nothing: a setting the run would
    drop without a word is refused instead."""
    default = type(values)()
    changed = [
        f"{section}.{key}={_as_typed(getattr(values, key))}"
        for key in keys
        if getattr(values, key) != getattr(default, key)
    ]
    fix = fix.format(it="it" if len(changed) == 1 else "them")
    return [f"{' and '.join(changed)} would be ignored {where}: {fix}"] if changed else []


def _as_typed(value: Any) -> str:
    """A config value as an override spells it (false, null)."""
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


# Model keys that one setting of another key alone reads.
_ROPE_KEYS = ["rope_theta", "rope_scaling"]
_ROPE_SCALING_KEYS = [
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
]
_MOE_KEYS = [f.name for f in fields(ModelConfig) if f.name.startswith("moe_")]


def _model_keys_unread(m: ModelConfig) -> list[str]:
    """Rotary, MoE, token-type, window and compile keys set where the model has none of it."""
    leave = "or leave {it} unset"
    problems = []
    if m.position_embedding != "rotary":
        problems += _unread(
            "model",
            m,
            _ROPE_KEYS + _ROPE_SCALING_KEYS,
            f"with model.position_embedding={m.position_embedding}",
            f"set model.position_embedding=rotary, {leave}",
        )
    elif m.rope_scaling == "none":
        problems += _unread(
            "model",
            m,
            _ROPE_SCALING_KEYS,
            "with model.rope_scaling=none",
            f"set model.rope_scaling=llama3, {leave}",
        )
    if m.mlp != "moe":
        where = f"with model.mlp={m.mlp} (no experts)"
        problems += _unread("model", m, _MOE_KEYS, where, f"set model.mlp=moe, {leave}")
    if m.arch != "bert":
        where = f"by model.arch={m.arch} (BERT alone embeds token types)"
        problems += _unread("model", m, ["num_token_types"], where, "leave it unset")
    if m.sliding_window is None:
        where = "without model.sliding_window (every layer attends to all keys)"
        problems += _unread("model", m, ["full_attention_every"], where, "set a window, or 0")
    if m.compile is False:
        where = "with model.compile=false"
        problems += _unread(
            "model", m, ["compile_backend"], where, f"set model.compile=true, {leave}"
        )
    return problems


def _validate_model(cfg: Config, dims: ParallelDims) -> list[str]:
    """The model's own rules at this TP size, and CUDA graphs only where a GPU will run."""
    try:
        cfg.model.validate(dims.tp)
    except ValueError as err:
        return [str(err)]
    problems = _model_keys_unread(cfg.model)
    if cfg.model.kernels == "apex":  # else every rank fails at its first LayerNorm
        problems += _apex_missing("model.kernels")
    if cfg.model.cuda_graphs:  # settings that could replay, but on which device?
        problems += _cuda_graphs_device_problem(cfg.trainer.device)
        problems += _cuda_graphs_layout_problems(dims)
    return problems


def _cuda_graphs_layout_problems(dims: ParallelDims) -> list[str]:
    """The layouts that compile (``model.compile``) but whose step no replay would hold
    (the pipeline's rule is ``compile_rule``'s)."""
    at, problems = "model.cuda_graphs=true", []
    if dims.dp_shard in ("gradients", "full"):
        problems.append(
            f"{at} under parallel.dp_shard={dims.dp_shard}: FSDP gathers and frees each "
            "layer's parameters around its forward, storage a replayed graph would read: "
            "set model.cuda_graphs=false"
        )
    if dims.cp > 1:
        problems.append(
            f"{at} at cp_size={dims.cp}: each ring runs eagerly between the compiled graphs "
            "(its exchanges outside any replay), never run on a GPU: set "
            "model.cuda_graphs=false"
        )
    return problems


def _apex_missing(key: str) -> list[str]:
    """One line when ``key=apex`` is set and NVIDIA apex is not installed."""
    if importlib.util.find_spec("apex") is not None:
        return []
    return [f"{key}=apex needs NVIDIA apex, which is not installed: install it, or use {key}=auto"]


def _cuda_graphs_device_problem(device: str) -> list[str]:
    """model.cuda_graphs on a run that will not have CUDA devices, one line."""
    import torch

    if device == "cpu":
        return ["model.cuda_graphs=true replays CUDA graphs, but trainer.device=cpu"]
    if not torch.cuda.is_available():
        return ["model.cuda_graphs=true replays CUDA graphs, but no CUDA device is visible"]
    return []


def _validate_trainer(cfg: Config, dims: ParallelDims) -> list[str]:
    """The loop's batch arithmetic at ``dims``, its choices, counts, intervals and timeouts."""
    t, problems = cfg.trainer, []
    if min(t.global_batch, t.micro_batch) < 1:
        problems.append(
            f"trainer.global_batch={t.global_batch} and trainer.micro_batch={t.micro_batch} "
            "must be >= 1"
        )
    else:
        problems += _layout_problem(dims.check_batch, t.global_batch, t.micro_batch)
    if not 1 <= t.max_steps <= INT64_MAX:
        problems.append(f"trainer.max_steps={t.max_steps} must be in [1, 2**63-1]")
    problems += _not_one_of("trainer.precision", t.precision, ("auto", "fp32", "bf16", "fp16"))
    if t.precision != "fp16" and t.loss_scale_init > 0:  # else its range is the problem
        where = f"at trainer.precision={t.precision} (loss scaling is fp16's)"
        problems += _unread("trainer", t, ["loss_scale_init"], where, "leave it unset")
    problems += _not_one_of("trainer.device", t.device, ("auto", "cuda", "cpu"))
    if not 0 <= t.collective_timeout_s < math.inf:
        problems.append(
            f"trainer.collective_timeout_s={t.collective_timeout_s} must be >= 0 and finite "
            "(0: off)"
        )
    startup = t.collective_startup_timeout_s
    if startup is not None and not 0 < startup < math.inf:
        problems.append(
            f"trainer.collective_startup_timeout_s={startup} must be > 0 and finite "
            "(null: 5 x trainer.collective_timeout_s)"
        )
    elif startup is not None and t.collective_timeout_s == 0:
        problems.append(
            f"trainer.collective_startup_timeout_s={startup} does nothing with "
            "trainer.collective_timeout_s=0 (the watchdog is off); set a collective timeout "
            "or drop the start-up one"
        )
    if not 0 <= t.memory_cap_gib < math.inf:
        problems.append(
            f"trainer.memory_cap_gib={t.memory_cap_gib} must be >= 0 and finite "
            "(0: the device's memory)"
        )
    if t.profile_steps and (len(t.profile_steps) != 2 or t.profile_steps[0] > t.profile_steps[1]):
        problems.append(f"trainer.profile_steps={t.profile_steps} must be [first, last]")
    elif t.profile_steps and t.profile_steps[0] < 0:
        problems.append(
            f"trainer.profile_steps={t.profile_steps} must be >= 0: the [first, last] steps to trace"
        )
    if t.wandb_project and importlib.util.find_spec("wandb") is None:
        problems.append(
            f"trainer.wandb_project={t.wandb_project!r} needs wandb, which is not installed: "
            "pip install wandb, or leave trainer.wandb_project unset"
        )
    return problems + _out_of_range(
        ("trainer.seed", t.seed, 0 <= t.seed <= INT64_MAX, "in [0, 2**63-1]"),
        ("trainer.grad_bucket_mb", t.grad_bucket_mb, t.grad_bucket_mb > 0, "> 0"),
        ("trainer.log_every", t.log_every, t.log_every >= 1, ">= 1"),
        ("trainer.eval_every", t.eval_every, t.eval_every >= 0, ">= 0 (0 disables)"),
        ("trainer.eval_batches", t.eval_batches, t.eval_batches >= 0, ">= 0 (0: no evaluation)"),
        ("trainer.loss_scale_init", t.loss_scale_init, t.loss_scale_init > 0, "> 0"),
        ("trainer.fail_at_step", t.fail_at_step, t.fail_at_step >= 0, ">= 0 (0 disables)"),
        ("trainer.max_bad_steps", t.max_bad_steps, t.max_bad_steps >= 1, ">= 1"),
        ("trainer.max_restarts", t.max_restarts, t.max_restarts >= 0, ">= 0"),
        ("trainer.rendezvous_timeout_s", t.rendezvous_timeout_s, t.rendezvous_timeout_s > 0, "> 0"),
    )


def _validate_sampling(cfg: Config) -> list[str]:
    """The sample a causal model writes after training: a prompt and a length that fit."""
    t, m, problems = cfg.trainer, cfg.model, []
    if m.causal and t.sample_tokens > 0 and not t.sample_temperature > 0:
        problems.append(
            f"trainer.sample_temperature={t.sample_temperature} must be > 0 "
            "(or trainer.sample_tokens=0 for no sample)"
        )
    # Against a max_positions the model's own rule refuses, only that rule's line is shown.
    if m.causal and 1 <= m.max_positions <= t.sample_tokens:
        problems.append(
            f"trainer.sample_tokens={t.sample_tokens} must be < model.max_positions="
            f"{m.max_positions}: the sample and its prompt must fit the positions"
        )
    if m.causal and t.sample_tokens > 0 and not t.sample_prompt:
        problems.append(
            "trainer.sample_prompt='' is empty: give a prompt, or trainer.sample_tokens=0 for "
            "no sample"
        )
    if not m.causal:
        keys = ["sample_prompt", "sample_temperature", "sample_top_k"]
        problems += _unread(
            "trainer",
            t,
            keys + ["sample_tokens"] * (t.sample_tokens > 0),
            f"by model.arch={m.arch} (decoders alone write a sample)",
            "leave {it} unset, or trainer.sample_tokens=0",
        )
    return problems + _out_of_range(
        ("trainer.sample_tokens", t.sample_tokens, t.sample_tokens >= 0, ">= 0 (0 disables)"),
        ("trainer.sample_top_k", t.sample_top_k, t.sample_top_k >= 0, ">= 0 (0: no top-k)"),
    )


def _validate_optim(cfg: Config) -> list[str]:
    """The optimizer: its implementation, learning-rate schedule and AdamW's numbers."""
    o, problems = cfg.optim, []
    problems += _not_one_of("optim.impl", o.impl, ("auto", "torch", "apex"))
    problems += _not_one_of("optim.algorithm", o.algorithm, ("adamw", "muon"))
    if o.algorithm == "muon":
        problems += _not_one_of(
            "optim.muon_adjust_lr", o.muon_adjust_lr, ("match_rms_adamw", "original")
        )
        if o.impl == "apex":
            problems.append("optim=muon runs torch's AdamW beside Muon: set optim.impl=auto")
        if not 0.0 <= o.muon_momentum < 1.0:
            problems.append(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1)")
        if not 1 <= o.muon_ns_steps < 100:
            problems.append(f"optim.muon_ns_steps={o.muon_ns_steps} must be in [1, 99]")
    else:
        problems += _unread(
            "optim",
            o,
            [f.name for f in fields(o) if f.name.startswith("muon_")],
            f"with optim.algorithm={o.algorithm}",
            "set optim=muon, or leave {it} unset",
        )
    if o.impl == "apex":
        problems += _apex_missing("optim.impl")
    # Written as what must hold, so that NaN (false in every comparison) fails it too.
    if not 0 < o.lr <= MAX_LR:
        problems.append(
            f"optim.lr={o.lr} must be in (0, {MAX_LR:g}] (a larger step size makes "
            "every step non-finite)"
        )
    elif not 0 <= o.min_lr <= o.lr:
        problems.append(f"optim.lr={o.lr} must be > 0 and optim.min_lr={o.min_lr} in [0, lr]")
    if o.decay_steps is not None and not 1 <= o.decay_steps <= INT64_MAX:
        problems.append(
            f"optim.decay_steps={o.decay_steps} must be >= 1 (or null: max_steps - warmup_steps)"
        )
    if o.scale_lr_with_batch < 0:
        problems.append(
            f"optim.scale_lr_with_batch={o.scale_lr_with_batch} must be >= 0 "
            "(the reference global batch of optim.lr; 0 disables scaling)"
        )
    for key, value in (("beta1", o.beta1), ("beta2", o.beta2)):
        if not 0.0 <= value < 1.0:
            problems.append(f"optim.{key}={value} must be in [0, 1)")
    return problems + _out_of_range(
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("optim.clip_grad", o.clip_grad, o.clip_grad >= 0, ">= 0 (0 disables clipping)"),
    )


def _validate_checkpoint(cfg: Config) -> list[str]:
    """The checkpoint cadence and the run's name, which names its directories."""
    ck, problems = cfg.checkpoint, []
    if ck.every < 0 or ck.keep < 1:
        problems.append(
            f"checkpoint.every={ck.every} must be >= 0 and checkpoint.keep={ck.keep} >= 1"
        )
    if _PLAIN_NAME.fullmatch(cfg.name) is None:
        problems.append(
            f"name={cfg.name!r} must be a plain name (letters, digits, '.', '_', '-'; no path "
            "separators, not empty): it names the directories checkpoints/<name>"
        )
    return problems


def _validate_data(cfg: Config, dims: ParallelDims) -> list[str]:
    """The data files, their blend and split, the sequence length and the vocabulary."""
    d, problems = cfg.data, []
    problems += _layout_problem(dims.check_seq_len, d.seq_len)
    if d.seq_len < 2 or 1 <= cfg.model.max_positions < d.seq_len:  # 0: the model's line
        problems.append(
            f"data.seq_len={d.seq_len} must be in [2, model.max_positions="
            f"{cfg.model.max_positions}]"
        )
    for prefix in d.prefixes:
        found = {prefix + ext: file_problem(prefix + ext) for ext in (".bin", ".idx")}
        missing = [path for path, problem in found.items() if problem == MISSING]
        if missing:
            problems.append(
                f"data.prefixes: {' and '.join(missing)} not found (make them with "
                "tools/preprocess_data.py)"
            )
        # A FIFO would be read for ever, a directory blamed on something else later.
        problems += [
            f"data.prefixes: {p} {why}" for p, why in found.items() if why not in (None, MISSING)
        ]
    problems += _blend_problems(d) + _document_mask_problems(cfg)
    problem = file_problem(d.tokenizer) if d.tokenizer is not None else None
    if problem is not None:
        problems.append(f"data.tokenizer: {d.tokenizer} {problem}")
    if not d.prefixes and cfg.model.vocab_size < d.default_vocab_size:
        problems.append(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the embedded corpus's "
            f"data.default_vocab_size={d.default_vocab_size}"
        )
    return problems + _out_of_range(
        ("data.seed", d.seed, 0 <= d.seed <= INT64_MAX, "in [0, 2**63-1]"),
        ("data.default_max_bytes", d.default_max_bytes, d.default_max_bytes >= 1, ">= 1"),
    )


def _document_mask_problems(cfg: Config) -> list[str]:
    """What ``data.document_mask`` runs with: the causal decoders' packed windows (at any
    layout: a pipeline's stages take the document ids as a keyword input)."""
    if not cfg.data.document_mask:
        return []
    at = "data.document_mask=true"
    if not family(cfg.model.arch).causal:
        return [f"{at} packs causal documents ({_decoders()}), not model.arch={cfg.model.arch}"]
    return []


def _blend_problems(d: DataConfig) -> list[str]:
    """data.weights and data.split, by the rules the data pipeline blends and cuts with."""
    problems = []
    if d.weights:
        try:
            normalized(d.weights)
        except ValueError:
            problems.append(
                f"data.weights={list(d.weights)} must be >= 0 with a positive sum, all finite"
            )
        if len(d.weights) != len(d.prefixes):
            problems.append(
                f"data.weights has {len(d.weights)} entries for {len(d.prefixes)} data.prefixes"
            )
    try:
        split_fractions(d.split)
    except ValueError as err:
        problems.append(f"data.split={d.split!r} is invalid ({err}); e.g. data.split=949,50,1")
    return problems


def _out_of_range(*checks: tuple[str, Any, bool, str]) -> list[str]:
    """``key=value must be RULE`` for each ``(key, value, ok, rule)`` that is not ok; a
    float must also be finite (NaN fails every comparison, so ``ok`` is False for it)."""
    problems = []
    for key, value, ok, rule in checks:
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            finite = " and finite" if isinstance(value, float) else ""
            problems.append(f"{key}={value} must be {rule}{finite}")
    return problems


def _not_one_of(key: str, value: str, choices: tuple[str, ...]) -> list[str]:
    """``key=value is not one of ...``, or nothing when ``value`` is a choice."""
    return [] if value in choices else [f"{key}={value!r} is not one of {', '.join(choices)}"]


def _layout_problem(check, *args) -> list[str]:
    """The one-line LayoutError of ``check(*args)`` as a problem list."""
    try:
        check(*args)
    except LayoutError as err:
        return [str(err)]
    return []


def numbers_out_of_range(cfg: Any, reported: list[str], prefix: str = "") -> list[str]:
    """Every number of the config ``cfg`` (a dataclass, its sections recursed into), by
    type: integers within 64 bits, floats finite.

    Keys a specific check already reported (named in its line) are left to that line.
    """
    problems = []
    for f in fields(cfg):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if is_dataclass(value):
            problems += numbers_out_of_range(value, reported, f"{key}.")
        elif any(re.search(rf"(^| ){re.escape(key)}=", line) for line in reported):
            continue
        elif any(not _in_range(v) for v in (value if isinstance(value, list) else [value])):
            problems.append(
                f"{key}={value} must be a finite number within 64 bits (|value| < 2**63)"
            )
    return problems


def _in_range(value: Any) -> bool:
    """Whether a config number is one a run can store and honour (non-numbers: True)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return -INT64_MAX <= value <= INT64_MAX
    return True


def resolve_compile(cfg: Config, dims: ParallelDims, device_type: str) -> bool:
    """``model.compile``; its default (None, "auto") compiles on CUDA where the layout runs
    compiled: one pipeline stage, no FSDP2, and not selective recomputation at tp > 1 on a
    torch that compiles it wrongly (``layers.compile``)."""
    m = cfg.model
    if m.compile is not None:
        return m.compile
    from layers.compile import selective_recompute_compiles

    wrong = m.recompute == "selective" and dims.tp > 1 and not selective_recompute_compiles()
    sharded = dims.dp_shard in ("gradients", "full")
    return device_type == "cuda" and dims.pp == 1 and not sharded and not wrong


def resolve_precision(precision: str, device_type: str) -> str:
    """``auto`` is bf16 on CUDA devices that support it, else fp32 (the CPU's practice)."""
    if precision != "auto":
        return precision
    import torch

    return "bf16" if device_type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
