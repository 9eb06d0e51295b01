"""Graphs and graph breaks of meshtron's compiled training step (``model.compile=true``).

Builds the model of ``--preset`` (with the overrides given) compiled, runs one training
forward, loss and backward on a random batch, and prints what TorchDynamo captured: the
number of graphs, the number of graph breaks, and each break's reason with its count. The
whole step compiles to one graph when nothing in it needs eager Python (no Triton
kernels, no dropout on sequence-sharded activations, no dropout under full
recomputation). Then the optimizer update (clipping and AdamW, as the trainer runs it at
``parallel.dp_shard=none``), counted apart: compiled where ``engine.optim.compiles_update``
allows, it is two graphs (the clipping's, AdamW's) with torch's own two breaks around
``Optimizer.step``.

    python tools/count_graph_breaks.py --preset gpt_tiny --recompute full
    torchrun --nproc-per-node 2 tools/count_graph_breaks.py --tp 2 --sequence-parallel
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.bootstrap import bootstrap_rank, world_size
from engine.config import OptimConfig, sized_dims
from engine.data_parallel import build_data_parallel
from engine.models import ModelConfig, build_model, preset, preset_names
from engine.optim import compiles_update
from engine.preflight import models_fit_problem
from engine.runner import autocast_for
from engine.tool_args import ArgumentParser, add_preset_overrides, positive_int, preset_overrides
from layers.compile import COMPILE_BACKENDS
from layers.recompute import RECOMPUTE_MODES
from parallel_state import ParallelState
from parallel_state.dims import LayoutError, ParallelDims


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt_tiny", choices=preset_names())
    add_preset_overrides(p, ("hidden", "layers", "heads", "vocab"))
    p.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence")
    p.add_argument("--micro-batch", type=positive_int, default=2)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--tp", type=positive_int, default=1, help="TP size (run under torchrun)")
    p.add_argument(
        "--cp",
        type=positive_int,
        default=1,
        help="context-parallel ranks (ring attention; each ring runs between the graphs)",
    )
    p.add_argument(
        "--ep", type=positive_int, default=1, help="expert-parallel ranks (an MoE preset)"
    )
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none")
    p.add_argument("--kernels", choices=["auto", "triton", "torch", "apex"], default="auto")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: the forward and loss under bf16 autocast, as trainer.precision=bf16 runs "
        "them (an MoE's experts then take the grouped GEMM, as on a GPU)",
    )
    p.add_argument(
        "--backend",
        choices=COMPILE_BACKENDS,
        default="aot_eager",
        help="aot_eager traces as inductor does, without code generation",
    )
    p.add_argument(
        "--no-update",
        action="store_true",
        help="count the step alone, not the optimizer update (whose compile takes longer)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    cfg = model_config(args)  # experts to split, whatever the world
    if args.ep > 1 and cfg.mlp != "moe":
        p.error(
            f"--ep {args.ep} splits the experts of an MoE preset; --preset {args.preset} has none"
        )
    if args.ep > 1 and cfg.moe_num_experts % args.ep:
        p.error(f"--ep {args.ep} does not divide the preset's {cfg.moe_num_experts} experts")
    try:  # the layout each rank would refuse once started: here, in one line
        dims = layout(args, world_size())
        if dims.cp > 1:
            dims.check_seq_len(args.seq, key="seq_len")
    except LayoutError as err:
        p.error(str(err))
    try:  # and the model, e.g. --heads not dividing the hidden size or --tp
        cfg.validate(args.tp)
    except ValueError as err:
        p.error(str(err))
    # ... and the machine: one trainable copy per rank, split over tp
    on_gpu = torch.cuda.is_available()
    problem = models_fit_problem(cfg, tp=args.tp, on_gpu=on_gpu)
    if problem:
        p.error(f"--preset {args.preset}: {problem}")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The model of ``--preset`` with the overrides given, compiled."""
    return preset(
        args.preset,
        **preset_overrides(args),
        max_positions=args.seq,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        kernels=args.kernels,
        compile=True,
        compile_backend=args.backend,
    )


def layout(args: argparse.Namespace, world: int | None) -> ParallelDims:
    """The mesh of ``--tp``, ``--cp`` and ``--ep`` on ``world`` ranks, dp the rest."""
    return sized_dims(args.tp, None, world, cp_size=args.cp, ep_size=args.ep)


def count(args: argparse.Namespace, ps: ParallelState) -> dict:
    """{"graphs": n, "graph_breaks": n, "reasons": {first line of reason: count},
    "update": the same three for the optimizer update, and "compiled": bool}; without
    "update" under ``--no-update``."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    cfg = model_config(args)
    ps.seed(0)
    model = build_model(cfg, ps, device=ps.device)
    batch = _random_batch(cfg, args.micro_batch, args.seq, ps.device)
    if ps.size("cp") > 1:  # this rank's share of each sequence, as the runner cuts it
        batch = model.context_shard(batch, ps.size("cp"), ps.rank_in("cp"))
    dp = None
    if not args.no_update:
        dp = build_data_parallel(
            model,
            OptimConfig(),
            grad_group=ps.group("grad"),
            tp_group=ps.tp_group,
            device=ps.device,
            compile_backend=args.backend,
            expert_groups=(ps.group("expert"), ps.group("expert_grad")),
        )
    dynamo.reset()
    counters.clear()
    with autocast_for(args.precision, ps.device.type):
        loss = model.loss(batch)
    loss.backward()
    step = _counted(counters)
    if dp is None:
        return step
    dp.finish_grads()
    counters.clear()
    dp.step(lr=1e-4, max_norm=1.0, norm=dp.grad_norm())
    update = {**_counted(counters), "compiled": compiles_update(dp.optimizer)}
    return {**step, "update": update}


def _counted(counters) -> dict:
    """Graphs, breaks and break reasons (first lines) in Dynamo's ``counters``."""
    reasons: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        first = str(reason).strip().splitlines()[0]
        reasons[first] = reasons.get(first, 0) + n
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "reasons": reasons,
    }


def _random_batch(cfg, micro_batch: int, seq: int, device):
    """A batch of random tokens in the form the model's ``loss`` takes."""
    gen = torch.Generator().manual_seed(0)
    if cfg.causal:  # a decoder's loss takes next-token windows
        return torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen).to(device)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq), generator=gen)
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids, -100)
    padding = torch.arange(seq) >= seq - seq // 4  # the last quarter of the last row
    batch = {
        "input_ids": ids,
        "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand_as(ids),
        "attention_mask": ~(padding & (torch.arange(micro_batch) == micro_batch - 1)[:, None]),
        "mlm_labels": labels,
        "sop_label": torch.randint(0, 2, (micro_batch,), generator=gen),
    }
    return {k: v.long().to(device) for k, v in batch.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with bootstrap_rank(lambda world: layout(args, world), split_cores=False) as ps:
        result = count(args, ps)
    if ps.rank != 0:
        return 0
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"graphs: {result['graphs']}  graph breaks: {result['graph_breaks']}")
    for reason, n in sorted(result["reasons"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {reason}")
    update = result.get("update")
    if update is None:  # --no-update
        return 0
    how = "compiled" if update["compiled"] else "eager (engine.optim.compiles_update)"
    print(
        f"optimizer update, {how}: graphs: {update['graphs']}  "
        f"graph breaks: {update['graph_breaks']}"
    )
    for reason, n in sorted(update["reasons"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {reason}")
    return 0
