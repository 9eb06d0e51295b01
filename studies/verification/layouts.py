"""Layout equivalence: a model at (tp, dp, cp, sequence parallel, recompute) against tp=1,
dp=1.

Both layouts are built from the same seed (hence hold the same full weights) and see the
same global batch; each DP rank of the target takes its contiguous slice, and each cp rank
its load-balanced share of every sequence (``model.context_shard``, as the runner cuts
it); the cp ranks' outputs are joined back in sequence order before they are compared. The reference
runs on global rank 0 on a one-rank process group. Every module's output is captured by a
forward hook, gathered to full shape and compared on rank 0; then the loss and every
parameter gradient (after the DP average and the sequence-parallel TP sum), in backward
order; then the loss of each further optimizer step. Through a pipeline (pp > 1,
``pipeline_layouts``) the outputs are watched per micro-batch, and each stage's hand-off
(what it sent, what the next stage received) is compared too.

Error of a tensor: ``max_abs`` = max |target − reference|, ``max_rel`` = max_abs divided by
max |reference|. A row fails when max_rel exceeds the tolerance; the first failing row
names where the layouts diverge.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import parallel_state
from engine import comm
from engine.models import ModelConfig, ParallelModel, build_model, family, preset
from engine.pipeline import SCHEDULES, layer_split
from engine.pipeline.split import compile_rule, dp_rule, microbatch_rule, virtual_rule
from parallel_state import groups
from parallel_state.dims import ParallelDims
from studies.verification.dp_step import TargetStep
from studies.verification.moe import check_moe, moe_config_keys, moe_train_and_compare
from studies.verification.outputs import OutputCapture, Row, compare
from studies.verification.pipeline_layouts import pipeline_rows

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Relative tolerances (max error / max |reference|). float64 proves the math: layouts differ
# only in summation order (~1e-16 per op; observed ≤ 3e-15). float32's unit roundoff is
# 6e-8; reordered reductions over a few layers stay far below 1e-5 (observed ≤ 1e-6).
# bfloat16 keeps 8 mantissa bits (roundoff 3.9e-3): LayerNorm weight and bias gradients
# are sums over every token, grouped differently per layout (sequence shards, TP and DP
# all-reduces in bf16), so they differ by several roundoffs (observed ≤ 2.5e-2); 5e-2
# bounds that while a real bug still shows as O(1).
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 5e-2}
# What the verifier's tiny model takes from its family's ``<arch>_tiny`` preset: the
# component choices. Sizes, dropout and epsilon are the spec's (or the schema's) instead.
TINY_PARTS = (
    "norm",
    "position_embedding",
    "activation",
    "num_kv_heads",
    "qkv_bias",
    "linear_bias",
    "tie_embeddings",
)


@dataclass(frozen=True)
class VerifySpec:
    """The target layout, the tiny model, the batch and the dtype to compare with."""

    model: str = ModelConfig.arch  # a family of engine/models/families.py
    tp_size: int = 1
    dp_size: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # "none", "selective" or "full"
    dtype: str = "float64"
    num_layers: int = 2
    hidden_size: int = 48
    num_heads: int = 12  # divisible by tp 1, 2, 3, 4, 6
    vocab_size: int = 1001
    seq_len: int = 12
    batch_size: int = 4
    steps: int = 1
    lr: float = 1e-3
    seed: int = 1234
    pp_size: int = 1  # pipeline stages (>1: the model cut and run by a pipelining schedule)
    schedule: str = "1f1b"  # a name of engine.pipeline.SCHEDULES (pp_size > 1)
    virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b, zero_bubble, V)
    microbatches: int = 1  # micro-batches each DP rank's slice is cut into (pp_size > 1)
    dp_shard: str = "none"  # the DP mode the target trains under (none: plain AdamW + GradSync)
    offload: str = "none"  # "optimizer": the sharded modes step Adam's state in host memory
    dp_replicate: int = 1  # HSDP: FSDP replicas, each sharding over dp ÷ dp_replicate ranks
    cp_size: int = 1  # context-parallel ranks splitting each sequence (ring attention)
    ep_size: int = 1  # expert-parallel ranks splitting each MoE layer's experts (from dp)
    experts: int = 0  # routed experts per layer: > 0 makes every MLP an MoE layer (llama)
    top_k: int = 2  # experts each token goes to (experts > 0)
    capacity_factor: float | None = None  # per expert ⌈factor·T·k/E⌉ token-slots; None: dropless
    router: str = "softmax"  # "softmax" or "sigmoid" (layers/router.py)
    shared_ffn: int = 0  # width of a gated shared expert beside the routed ones; 0: none
    document_mask: bool = False  # decoders: rows packed with documents (``document_ids``)
    compile: str | None = None  # the target compiled with this backend (model.compile); eager

    @property
    def tolerance(self) -> float:
        """Relative tolerance for this dtype."""
        return TOLERANCES[self.dtype]

    def check(self, model_config: ModelConfig | None = None) -> None:
        """Raise ValueError naming the numbers if this layout cannot split the batch/model
        (``model_config``, by default :meth:`model_config`)."""
        keys = ("tp_size", "dp_size", "pp_size", "cp_size", "ep_size", "virtual_stages")
        keys = (*keys, "microbatches")
        keys = (*keys, "steps")
        for key in (*keys, "batch_size", "seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        check_moe(self)  # before the layout: its one line names the expert count too
        if self.offload != "none" and self.dp_shard == "none":
            raise ValueError(
                f"offload={self.offload} needs a sharded DP mode: pass --dp-shard optimizer, "
                "gradients or full (or --offload none)"
            )
        if self.document_mask:
            self._check_document_mask()
        dims = self.dims
        dims.check_batch(self.batch_size)  # one slice per DP rank
        if self.batch_size % (self.dp_size * self.microbatches):
            need = self.dp_size * self.microbatches
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by dp_size × microbatches = "
                f"{self.dp_size} × {self.microbatches}: choose a batch_size multiple of {need}"
            )
        dims.check_seq_len(self.seq_len, key="seq_len")
        (model_config or self.model_config()).validate(dims.tp)
        if self.pp_size > 1:
            self._check_pipeline()

    def _check_document_mask(self) -> None:
        """Packed documents run on the causal decoders (as ``data.document_mask`` does)."""
        if not family(self.model).causal:
            raise ValueError(f"--document-mask packs causal documents, not {self.model}")

    def _compiled(self) -> dict:
        """The target's compile keys: ``model.compile`` with this backend."""
        return {"compile": True, "compile_backend": self.compile}

    def _check_pipeline(self) -> None:
        """The stage split and torch's micro-batch rules for the schedule."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        rule = virtual_rule(self.schedule, self.virtual_stages)
        if rule:
            raise ValueError(f"{rule}: change --virtual-stages")
        rule = dp_rule(self.schedule, self.dp_shard, self.model_config().tie_embeddings)
        rule = rule or compile_rule(self.schedule, bool(self.compile), off="drop --compile")
        if rule:
            raise ValueError(rule)
        stages = self.pp_size * self.virtual_stages
        if self.num_layers % stages:  # the verifier has no per-stage layer counts to offer
            fits = -(-self.num_layers // stages) * stages
            raise ValueError(
                f"num_layers={self.num_layers} is not divisible by the {stages} pipeline "
                f"stages (pp_size={self.pp_size} × virtual_stages={self.virtual_stages}): "
                f"give a multiple of {stages} (num_layers={fits})"
            )
        layer_split(self.num_layers, stages)
        rule = microbatch_rule(self.schedule, self.pp_size, self.microbatches)
        if rule:
            raise ValueError(f"{rule}: change --microbatches")

    @property
    def dims(self) -> ParallelDims:
        """The target layout as a validated value."""
        return ParallelDims(
            self.tp_size,
            self.dp_size,
            self.pp_size,
            sequence_parallel=self.sequence_parallel,
            dp_shard=self.dp_shard,
            cp=self.cp_size,
            ep=self.ep_size,
            dp_replicate=self.dp_replicate,
        )

    def model_config(self, *, reference: bool = False) -> ModelConfig:
        """The target's config, or with ``reference=True`` the plain unsplit one. Its
        components are the family's tiny preset's (``TINY_PARTS``): the Llama one has 2 KV
        heads, so at tp 4 each is replicated on 2 ranks."""
        tiny = preset(f"{family(self.model).arch}_tiny")
        parts = {k: getattr(tiny, k) for k in TINY_PARTS}
        return ModelConfig(
            **parts,
            arch=self.model,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            max_positions=self.seq_len,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            sequence_parallel=self.sequence_parallel and not reference,
            recompute="none" if reference else self.recompute,
            **moe_config_keys(self),
            **({} if reference or not self.compile else self._compiled()),
        )


def model_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The tiny model's sizes as VerifySpec fields, from the flags the tools that build a
    VerifySpec name alike (``--layers --hidden --heads --vocab --seq``), so each tool maps
    them in one place."""
    sizes = dict(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads)
    return dict(sizes, vocab_size=args.vocab, seq_len=args.seq)


@dataclass
class Report:
    """All compared tensors in model order; ``first_failure`` is where the layouts diverge."""

    spec: VerifySpec
    tolerance: float
    rows: list[Row]
    absolute: bool = False  # whether ``tolerance`` bounds max_abs rather than max_rel
    notes: list[str] = field(default_factory=list)  # lines printed under the table (routing)

    @property
    def first_failure(self) -> Row | None:
        """The first out-of-tolerance row, in model order."""
        return next((r for r in self.rows if not r.ok), None)

    @property
    def ok(self) -> bool:
        """Whether at least one tensor was compared and every row is within tolerance."""
        return bool(self.rows) and self.first_failure is None


def make_batch(spec: VerifySpec) -> dict[str, torch.Tensor]:
    """A fixed random global batch. BERT: padded rows, two segments, 3 MLM labels per row
    (the same count in every row, so per-DP-slice mean losses average to the global one).
    Decoders with ``document_mask``: each row packed with documents (``document_ids``)."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    b, s, v = spec.batch_size, spec.seq_len, spec.vocab_size
    ids = torch.randint(0, v, (b, s), generator=g)
    if family(spec.model).causal:  # decoders: next-token batches
        batch = {"input_ids": ids, "labels": torch.randint(0, v, (b, s), generator=g)}
        if spec.document_mask:
            batch["document_ids"] = packed_documents(b, s, g)
        return batch
    lengths = torch.randint(max(4, s // 2), s + 1, (b,), generator=g)
    positions = torch.arange(s)
    attention_mask = (positions < lengths[:, None]).long()
    token_type_ids = (positions >= lengths[:, None] // 2).long() * attention_mask
    mlm_labels = torch.full((b, s), -100)
    for row in range(b):
        picked = 1 + torch.randperm(int(lengths[row]) - 1, generator=g)[:3]
        mlm_labels[row, picked] = torch.randint(0, v, (3,), generator=g)
    sop_label = torch.randint(0, 2, (b,), generator=g)
    return dict(
        input_ids=ids,
        token_type_ids=token_type_ids,
        attention_mask=attention_mask,
        mlm_labels=mlm_labels,
        sop_label=sop_label,
    )


def packed_documents(rows: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Document ids ``[rows, seq_len]``: each row cut at up to 3 random places (a row may
    hold 1 to 4 documents), so boundaries fall inside the cp chunks as well as on them and
    the ring meets blocks within one document, across two and between two."""
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    for row in range(rows):
        cuts = torch.randint(1, seq_len, (3,), generator=g)
        ids[row, cuts] = 1  # a repeated cut counts once
    return ids.cumsum(dim=1)


def dp_slice(batch: dict[str, torch.Tensor], ps: parallel_state.ParallelState) -> dict:
    """This DP rank's contiguous block of the global batch."""
    return {k: v.chunk(ps.dp_size)[ps.dp_rank] for k, v in batch.items()}


def solo_group(ps: parallel_state.ParallelState) -> dist.ProcessGroup:
    """A one-rank group for this rank (every rank must call this together)."""
    return groups.solo_group(ps.rank, ps.world_size)


def compare_layouts(
    spec: VerifySpec,
    *,
    mutate_target: Callable[[ParallelModel], None] | None = None,
    mutate_runner: Callable[[Any], None] | None = None,
) -> Report | None:
    """Run ``spec`` on the initialized mesh; the Report on global rank 0, None elsewhere.

    ``mutate_target(model)`` may alter the target after it is built, ``mutate_runner`` the
    pipeline runner (pp_size > 1) after it is built (planting faults).
    """
    ps = parallel_state.get()
    spec.check()
    if ps.dims.sizes != spec.dims.sizes:
        raise ValueError(f"the mesh is {ps.dims.sizes} but the spec asks for {spec.dims.sizes}")
    dtype, solo = DTYPES[spec.dtype], solo_group(ps)
    ps.seed(spec.seed)
    target = build_model(spec.model_config(), ps, dtype=dtype)
    if mutate_target is not None:
        mutate_target(target)
    reference = None
    if ps.rank == 0:
        ps.seed(spec.seed)  # the same draws again: the same full weights
        reference = build_model(  # dropout is off: the RNG is passed, never drawn from
            spec.model_config(reference=True), tp_group=solo, rng=ps.rng, dtype=dtype
        )
    notes: list[str] = []
    if spec.pp_size > 1:
        batch = make_batch(spec)
        rows = pipeline_rows(spec, target, reference, batch, dp_slice(batch, ps), ps, mutate_runner)
    elif spec.experts:
        batch = make_batch(spec)
        rows, notes = moe_train_and_compare(spec, target, reference, batch, dp_slice(batch, ps), ps)
    else:
        rows = _train_and_compare(spec, target, reference, make_batch(spec), ps)
    return Report(spec, spec.tolerance, rows, notes=notes) if ps.rank == 0 else None


def _train_and_compare(spec, target, reference, batch, ps) -> list[Row]:
    tol, rows = spec.tolerance, []
    # A compiled target's graph spans its modules: no module's own output to capture.
    models = () if spec.compile else (target, reference)
    captures = [OutputCapture(m) for m in models if m is not None]
    dp = TargetStep(spec, target, ps)
    optimizers = [dp]
    if reference is not None:
        optimizers.append(torch.optim.AdamW(reference.parameters(), lr=spec.lr, weight_decay=0.0))
    local = dp_slice(batch, ps)
    if ps.size("cp") > 1:  # this rank's share of each sequence, as the runner cuts it
        local = target.context_shard(local, ps.size("cp"), ps.rank_in("cp"))
    for step in range(spec.steps):
        loss = target.loss(local)
        loss.backward()
        dp.finish_grads()
        loss = loss.detach().double()
        comm.sum_(loss, ps.group("loss"))
        loss /= ps.size("loss")
        ref_loss = None
        if reference is not None:
            ref_loss = reference.loss(batch)
            ref_loss.backward()
        if step == 0 and captures:
            rows += _output_rows(captures, ps, tol)
            for c in captures:
                c.remove()
        if ref_loss is not None:
            rows.append(compare("loss", f"loss (step {step})", loss, ref_loss, tol))
        if step == 0 and spec.dp_shard != "optimizer":  # ZeRO-1 keeps them in its buckets
            rows += _grad_rows(target, reference, tol)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    dp.remove()
    return rows


def _output_rows(captures: list[OutputCapture], ps, tol: float) -> list[Row]:
    # A collective: every rank takes part.
    got = captures[0].gathered(ps.tp_group, ps.dp_group, ps.group("cp"))
    if len(captures) == 1:
        return []
    want = captures[1].gathered(None, None)  # the reference's outputs are whole already
    return [compare("output", name, got[name], want[name], tol) for name in got]


def _grad_rows(target: ParallelModel, reference: ParallelModel | None, tol: float) -> list[Row]:
    got = target.full_grad_dict()  # collective over TP
    if reference is None:
        return []
    want = reference.full_grad_dict()
    # Reverse registration order approximates backward order: the first failing gradient
    # is the one closest to where backward went wrong.
    return [compare("grad", name, got[name], want[name], tol) for name in reversed(got)]


T = TypeVar("T")


def run_on_mesh(fn: Callable[..., T], spec: VerifySpec, *args: Any) -> T:
    """Rank entry: build the (pp, dp, cp, tp) mesh from the launcher's environment, run
    ``fn(spec, *args)``, tear down."""
    from engine.bootstrap import bootstrap_rank

    def say(ps: parallel_state.ParallelState, line: str) -> None:
        if ps.rank == 0:  # stdout holds the report alone
            print(line, file=sys.stderr)

    # The models and batches live on the CPU: the split's math does not depend on the
    # device, and gloo keeps the tool working on GPU nodes too (NCCL would need CUDA tensors).
    # The ranks share the cores instead of oversubscribing them.
    with bootstrap_rank(spec.dims, backend="gloo", say=say):
        return fn(spec, *args)


def launch_local(fn: Callable[..., T], world_size: int, *args: Any) -> T:
    """Run ``fn(*args)`` on ``world_size`` local worker processes started by torch's elastic
    launcher (standalone c10d rendezvous on localhost); return rank 0's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"verify-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    return elastic_launch(config, fn)(*args)[0]
