"""Check that a parallel layout computes what the unsplit model computes.

Compares a target layout (--tp-size, --dp-size, --cp-size, --ep-size, --pp-size with
--schedule, --sequence-parallel, --recompute) with tp=1, dp=1, cp=1, ep=1, pp=1 on the same
weights and the same global batch: every module's forward output (through a pipeline also
what each stage sent and the next received, per micro-batch), the loss, every parameter
gradient (gathered to full shape) and, with --steps N, N AdamW steps' losses. Prints a table
in model order, names the first module that diverges and exits 1 if any tensor is out of
tolerance.

With --experts E (implied by --ep-size N > 1: 4 experts) every MLP is a mixture-of-experts
layer (llama) and --ep-size N splits its experts over N of the dp ranks. The reference runs
each DP slice as its own forward, as each rank routes its own tokens; compared besides: each
router's kept (token, expert) pairs, its dropped ones (--capacity-factor), its weights and
its auxiliary and z-losses, the experts' output rows, the router loss.

With --document-mask (the decoders) every row of the batch packs several documents:
attention stays within each and positions restart at each (data.document_mask=true).

With --compile BACKEND the target runs compiled (model.compile; aot_eager traces as
inductor does without generating code) against the eager unsplit reference: the losses
and gradients are compared, not each module's output (a graph spans modules). inductor
computes the rotary tables' fp32 cos/sin its own way, an fp32 ulp from eager's, which the
float64 tolerance sees on rotary models (GPT passes at 1e-10, Llama is 4e-8 off).

With --hf-dir DIR it instead compares the logits of a local Hugging Face GPT-2, BERT,
Llama, Mistral, Qwen2, or MoE (Mixtral, Qwen2-MoE, Qwen3-MoE) directory loaded by
transformers with meshtron's import of it at the given layout (an MoE directory at any
--ep-size dividing --dp-size and its expert count).

Starts its own tp×dp×cp×pp local workers (torch elastic launcher); under torchrun or another
launcher (RANK set) each process is one rank.

    python tools/verify_equivalence.py --model gpt --tp-size 2 --dp-size 2 --sequence-parallel
    python tools/verify_equivalence.py --pp-size 2 --tp-size 1 --schedule 1f1b --layers 4
    python tools/verify_equivalence.py --model llama --cp-size 2 --tp-size 1 --heads 4
    python tools/verify_equivalence.py --model llama --cp-size 2 --tp-size 2 --document-mask
    python tools/verify_equivalence.py --model llama --ep-size 2 --dp-size 2 --tp-size 1 --heads 4
    python tools/verify_equivalence.py --model gemma --pp-size 2 --tp-size 1 --compile aot_eager
    python tools/verify_equivalence.py --hf-dir ./gpt2-tiny --tp-size 2 --dtype float32
    python tools/verify_equivalence.py --hf-dir ./mixtral-tiny --tp-size 1 --dp-size 2 --ep-size 2
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.models import FAMILIES  # noqa: E402
from engine.pipeline.split import SCHEDULES as PIPELINE_SCHEDULES  # noqa: E402
from engine.pipeline.split import V_SCHEDULES  # noqa: E402
from engine.tool_args import (  # noqa: E402
    CONFIG_FLAGS,
    ArgumentParser,
    add_model_size_flags,
    in_flags,
    positive_int,
)
from layers.compile import COMPILE_BACKENDS  # noqa: E402
from layers.router import ROUTERS  # noqa: E402
from parallel_state.dims import DP_SHARD_MODES  # noqa: E402
from studies.verification.hf_parity import (  # noqa: E402
    HF_TOLERANCES,
    check_hf_layout,
    compare_with_hf,
    hf_reference_note,
)
from studies.verification.layouts import (  # noqa: E402
    TOLERANCES,
    Report,
    VerifySpec,
    compare_layouts,
    launch_local,
    model_sizes,
    run_on_mesh,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    tols = ", ".join(f"{k} {v:g}" for k, v in TOLERANCES.items())
    hf_tols = ", ".join(f"{k} {v:g}" for k, v in HF_TOLERANCES.items())
    p = ArgumentParser(
        prog="verify_equivalence.py",
        description=__doc__.split("\n\n")[0],
        epilog=f"Tolerances: max|Δ| / max|reference| per tensor: {tols}. "
        f"With --hf-dir, on logits: {hf_tols} (absolute; bfloat16 relative); at float64 "
        "the reference's RMSNorm computes in float64 (transformers' rounds through float32).",
    )
    p.add_argument(
        "--model", choices=tuple(FAMILIES), default=VerifySpec.model, help="the family (model.arch)"
    )
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages")
    p.add_argument(
        "--cp-size", type=int, default=1, help="context-parallel ranks (--seq divisible by 2·cp)"
    )
    _expert_args(p)
    _pipeline_args(p)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument(
        "--dp-shard",
        choices=DP_SHARD_MODES,
        default="none",
        help="the DP mode the target trains under: none (all-reduce), optimizer (ZeRO-1), "
        "gradients (ZeRO-2) or full (ZeRO-3), the last two through FSDP2",
    )
    p.add_argument(
        "--dp-replicate",
        type=positive_int,
        default=1,
        help="HSDP: FSDP replicas, each sharding over dp ÷ R ranks (--dp-shard gradients or full)",
    )
    p.add_argument(
        "--offload",
        choices=("none", "optimizer"),
        default="none",
        help="optimizer: the sharded --dp-shard modes keep Adam's state in host memory "
        "(parallel.offload)",
    )
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument(
        "--dtype",
        choices=tuple(TOLERANCES),
        default="float64",
        help="both layouts run in this dtype; tolerances below",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_BACKENDS,
        default=None,
        metavar="BACKEND",
        help="compile the target (model.compile) with this backend: "
        f"{', '.join(COMPILE_BACKENDS)}; the unsplit reference runs eagerly. Its graphs span "
        "modules, so the losses and gradients are compared, not each module's output. In "
        "float64 use aot_eager: inductor's fp32 cos/sin of the rotary tables differ from "
        "eager's by an fp32 ulp (Llama gradients 4e-8 relative)",
    )
    _model_args(p)
    p.add_argument(
        "--hf-dir",
        help="local Hugging Face GPT-2, BERT, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE or "
        "Qwen3-MoE directory to compare with",
    )
    p.add_argument(
        "--document-mask",
        action="store_true",
        help="decoders: pack each row with several documents (attention and positions "
        "within each, as data.document_mask=true), at any layout",
    )
    p.add_argument("--failing-only", action="store_true", help="print only out-of-tolerance rows")
    return p.parse_args(argv)


def _pipeline_args(p: argparse.ArgumentParser) -> None:
    """The pipeline schedule, its virtual stages and its micro-batches."""
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b")
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="stages per pipeline rank (default: 2 for interleaved_1f1b, zbv and dualpipev, else 1)",
    )
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="per DP rank, >= 1 (default: pp × virtual)",
    )


def _expert_args(p: argparse.ArgumentParser) -> None:
    """The expert-parallel axis and the tiny MoE model's router and experts."""
    p.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert-parallel ranks, carved from dp: must divide --dp-size and --experts "
        "(MoE runs at any tp, pp and cp; dropless at cp > 1)",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=None,
        help="routed experts per MoE layer; > 0 makes every MLP one (llama; default: 4 with "
        "--ep-size > 1, else 0: dense)",
    )
    p.add_argument("--top-k", type=int, default=2, help="experts each token goes to")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="each expert takes at most ⌈factor · T · k / E⌉ of a rank's token-slots, "
        "dropping the rest (default: dropless)",
    )
    p.add_argument("--router", choices=ROUTERS, default="softmax", help="the MoE router")
    p.add_argument(
        "--shared-ffn",
        type=int,
        default=0,
        help="width of a gated shared expert beside the routed ones (default 0: none)",
    )


def _model_args(p: argparse.ArgumentParser) -> None:
    """The tiny model's sizes, the steps compared and the seed."""
    p.add_argument("--steps", type=int, default=1, help="optimizer steps whose losses to compare")
    add_model_size_flags(
        p,
        layers=2,
        hidden=48,
        heads=12,
        vocab=1001,
        seq=12,
        batch=4,
        notes={
            "heads": "divisible by tp-size",
            "vocab": "padded per TP size",
            "seq": "divisible by tp-size",
            "batch": "global; divisible by dp-size",
        },
    )
    p.add_argument("--seed", type=int, default=1234)


def render(report: Report, console: Console, *, failing_only: bool, hf: bool) -> None:
    """Print the rows as a table, then the first divergence (and the HF error line)."""
    table = Table(title=f"{report.spec.model} vs reference, {report.spec.dtype}")
    for column in ("kind", "name", "max abs", "max rel", ""):
        table.add_column(column, justify="right" if column.startswith("max") else "left")
    shown = [row for row in report.rows if not (failing_only and row.ok)]
    for row in shown:
        mark = "[green]ok[/green]" if row.ok else "[bold red]FAIL[/bold red]"
        table.add_row(row.kind, row.name, f"{row.max_abs:.3e}", f"{row.max_rel:.3e}", mark)
    if shown:
        console.print(table)
    first = report.first_failure
    measure = "absolute" if report.absolute else "relative"
    if not report.rows:
        console.print("[bold red]nothing was compared[/bold red]")
    elif first is None:
        console.print(
            f"all {len(report.rows)} tensors within {measure} tolerance {report.tolerance:g}"
        )
    else:
        console.print(
            f"[bold red]first divergence:[/bold red] {first.kind} of [bold]{first.name}[/bold] "
            f"(max abs {first.max_abs:.3e}, max rel {first.max_rel:.3e}; {measure} tolerance "
            f"{report.tolerance:g})"
        )
    for note in report.notes:
        console.print(note)
    if hf and report.rows:
        print(f"max abs logit error: {max(r.max_abs for r in report.rows):.6e}")


def spec_of(args: argparse.Namespace) -> VerifySpec:
    """The layout and model the options name (checked later, by ``VerifySpec.check``)."""
    return VerifySpec(
        model=args.model,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        sequence_parallel=args.sequence_parallel,
        dp_shard=args.dp_shard,
        recompute=args.recompute,
        dtype=args.dtype,
        **model_sizes(args),
        batch_size=args.batch,
        steps=args.steps,
        seed=args.seed,
        pp_size=args.pp_size,
        cp_size=args.cp_size,
        ep_size=args.ep_size,
        experts=(4 if args.ep_size > 1 else 0) if args.experts is None else args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        router=args.router,
        shared_ffn=args.shared_ffn,
        offload=args.offload,
        dp_replicate=args.dp_replicate,
        document_mask=args.document_mask,
        compile=args.compile,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        microbatches=(
            args.pp_size * args.virtual_stages if args.microbatches is None else args.microbatches
        ),
    )


# The flags that build the tiny model, which --hf-dir replaces with the directory's own.
TINY_MODEL_FLAGS = ("--model", "--layers", "--hidden", "--heads", "--vocab", "--experts")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; exit status 0 within tolerance, 1 outside, 2 on a bad layout."""
    args = parse_args(argv)
    if args.virtual_stages is None:
        two = args.schedule == "interleaved_1f1b" or args.schedule in V_SCHEDULES
        args.virtual_stages = 2 if two else 1
    spec = spec_of(args)
    given = sys.argv[1:] if argv is None else argv
    tiny = [f for f in TINY_MODEL_FLAGS if any(a == f or a.startswith(f + "=") for a in given)]
    try:
        if args.hf_dir and tiny:  # they would be ignored: the directory's model is compared
            raise ValueError(
                f"{' '.join(tiny)} describe the tiny model; an --hf-dir directory has its own "
                f"(drop {' '.join(tiny)})"
            )
        if args.hf_dir:
            spec = check_hf_layout(spec, args.hf_dir)
        else:
            spec.check()
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (OSError, ValueError) as err:
        # an --hf-dir model's sizes are the directory's: those keep their config names
        flags = {f for fs in CONFIG_FLAGS.values() for f in fs} - set(TINY_MODEL_FLAGS)
        flags = flags if args.hf_dir else None
        print(f"verify_equivalence: {in_flags(str(err), flags)}", file=sys.stderr)
        return 2
    task, extra = (compare_with_hf, (args.hf_dir,)) if args.hf_dir else (compare_layouts, ())
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        report = run_on_mesh(task, spec, *extra)
    else:
        report = launch_local(run_on_mesh, spec.dims.world, task, spec, *extra)
    if report is None:  # not global rank 0
        return 0
    if args.hf_dir:
        print(hf_reference_note(spec, args.hf_dir))
    render(report, Console(), failing_only=args.failing_only, hf=bool(args.hf_dir))
    return 0 if report.ok else 1


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
