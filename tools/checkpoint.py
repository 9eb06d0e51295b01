"""Inspect, re-shard and export meshtron training checkpoints on one CPU, without a cluster.

    python tools/checkpoint.py inspect checkpoints/gpt_tiny_stdlib
    python tools/checkpoint.py convert checkpoints/gpt_tiny_stdlib --tp-size 4 --dp-size 1 --out checkpoints/gpt_tiny_tp4
    python tools/checkpoint.py export-model checkpoints/gpt_tiny_stdlib --out checkpoints/gpt_tiny_weights
    python tools/checkpoint.py export-dcp checkpoints/gpt_tiny_stdlib checkpoints/gpt_tiny_dcp
    python tools/checkpoint.py import-dcp checkpoints/gpt_tiny_dcp checkpoints/gpt_tiny_back

CKPT is a step directory (``.../step_00000150``) or a checkpoint root, which means the
step its ``latest`` names. ``inspect`` verifies every file's size and SHA-256 unless
``--no-verify``. ``convert`` writes a checkpoint root that a run at the new layout resumes
from with ``checkpoint.dir=OUT``: OUT is a new or empty directory, or a root earlier
converts of the same source run wrote at the same layout with older steps only; a root
holding any other ``step_*`` or ``latest`` (another run's), or one inside the source run's
root, is refused, so convert never replaces a step nor moves a ``latest`` backwards; ``export-model`` writes the weights alone in the format
``tools/convert_hf.py export --ckpt`` and ``engine.checkpoint.format.load_model`` read, with
a copy of the tokenizer the checkpoint records (``tokenizer.json``). ``export-dcp`` writes
the weights, Adam moments and steps as a PyTorch Distributed Checkpoint directory
(``torch.distributed.checkpoint.load`` reads it; names in docs/CHECKPOINTS.md) and
``import-dcp`` turns one into a checkpoint root (tp=1 dp=1) a run resumes from with
``checkpoint.dir=OUT``; a DCP directory meshtron did not write needs ``--like`` (a training
checkpoint or a model-only export) for the model config and trainer state.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.checkpoint import CheckpointError, storage  # noqa: E402
from engine.checkpoint.convert import (  # noqa: E402
    OUT_RULE,
    announce_large,
    convert,
    export_model,
    resolve,
    summarize,
)
from engine.checkpoint.dcp import export_dcp, import_dcp  # noqa: E402
from engine.checkpoint.format import META_FILE, WEIGHTS_FILE  # noqa: E402
from engine.checkpoint.tensorfile import HASHES  # noqa: E402
from engine.checkpoint.tokenizer import TOKENIZER_FILE  # noqa: E402
from engine.hf_interop import HF_CONFIG  # noqa: E402
from engine.models.config import ModelConfig, preset_of  # noqa: E402
from engine.tool_args import ArgumentParser  # noqa: E402


def _add_out(parser: argparse.ArgumentParser, what: str) -> None:
    """The directory a subcommand writes: OUT last, or ``--out OUT``, in every one of them
    (``--out`` given to export-dcp was "unrecognized")."""
    parser.add_argument("out", nargs="?", help=f"{what} (or --out OUT)")
    parser.add_argument("--out", dest="out_option", metavar="OUT", help="the same as OUT")


def _settle_out(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One OUT, from either spelling; a parser error (exit 2) when none or two differ."""
    given = {v for v in (getattr(args, "out", None), args.out_option) if v is not None}
    if len(given) != 1:
        why = "is missing" if not given else f"is given twice, as {' and '.join(sorted(given))}"
        parser.error(f"{args.command}: OUT {why}: give it last or as --out OUT")
    args.out = given.pop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="list tensors, shapes, dtypes, layout and files")
    ins.add_argument("ckpt", help="step directory, checkpoint root or model export")
    ins.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check")
    con = sub.add_parser("convert", help="re-shard for another tp/dp layout")
    con.add_argument("ckpt", help="step directory or checkpoint root")
    con.add_argument("--tp-size", type=int, required=True)
    con.add_argument("--dp-size", type=int, required=True)
    _add_out(con, f"checkpoint root to write: {OUT_RULE}")
    exp = sub.add_parser("export-model", help="the model weights alone (checkpoint/format)")
    exp.add_argument("ckpt", help="step directory or checkpoint root")
    _add_out(exp, "model checkpoint directory to write")
    edc = sub.add_parser("export-dcp", help="write as a torch.distributed.checkpoint directory")
    edc.add_argument("ckpt", help="step directory or checkpoint root")
    _add_out(edc, "DCP directory to write (new or empty)")
    idc = sub.add_parser("import-dcp", help="a torch.distributed.checkpoint directory as a root")
    idc.add_argument("dcp", help="DCP directory (export-dcp's, or torch's dcp.save of our names)")
    _add_out(idc, "checkpoint root to write (new or empty)")
    idc.add_argument(
        "--like", help="training checkpoint or model-only export giving the model config"
    )
    args, extra = parser.parse_known_args(argv)
    # OUT after the options (argparse takes positionals in one run: "convert CKPT --tp-size
    # 2 --dp-size 1 OUT" leaves it over)
    leftover = len(extra) == 1 and not extra[0].startswith("-")
    if args.command != "inspect" and args.out is None and leftover:
        args.out = extra.pop()
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command != "inspect":
        _settle_out(parser, args)
    return args


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _sizes(layout: dict, config: dict) -> dict[str, int]:
    """tp and dp of an index's layout, and pp, cp and ep where they exceed 1; an index from
    before cp_size was recorded takes the run config's (a convert's layout is tp × dp)."""
    sizes = {"tp": layout["tp_size"], "dp": layout["dp_size"]}
    for axis in ("pp", "cp", "ep"):
        key = f"{axis}_size"
        if key in layout or "converted_from" in layout:
            size = layout.get(key, 1)
        else:
            size = config.get(key, 1)
        if isinstance(size, int) and size > 1:
            sizes[axis] = size
    return sizes


def _layout_line(layout: dict, trainer_state: dict) -> str:
    """The sizes a checkpoint was written at and what its DP axis sharded: the run's
    ``parallel.dp_shard`` where recorded, else the index's flag."""
    config = trainer_state.get("config") or {}
    sizes = _sizes(layout, config)
    line = " ".join(f"{axis}={size}" for axis, size in sizes.items())
    whole = "; experts stored whole" if "ep" in sizes else ""
    line += f" (world {layout['world_size']}{whole})"
    shard = (config.get("parallel") or {}).get("dp_shard")
    if shard is None:
        shard = "optimizer" if layout.get("zero1") else "none"
    line += f", dp_shard={shard}"
    if "converted_from" in layout:
        was = _sizes(layout["converted_from"], config)
        line += ", converted from " + " ".join(f"{axis}={size}" for axis, size in was.items())
    return line


def inspect(ckpt: str, verify: bool) -> int:
    """Print the summary of one checkpoint; non-zero exit status when a file is damaged."""
    if (Path(ckpt) / META_FILE).is_file():
        return inspect_export(Path(ckpt))
    step_dir = resolve(ckpt)
    info = summarize(step_dir, verify=verify)
    index, layout, m = info["index"], info["index"]["layout"], info["index"]["model_config"]
    data = index["trainer_state"].get("data", {})
    scaler = index["trainer_state"].get("loss_scaler")
    total = sum(f["bytes"] for f in info["files"].values())
    print(
        f"checkpoint {step_dir}: step {index['step']}, {_mib(total)} in {len(info['files'])} files"
    )
    print(f"layout: {_layout_line(layout, index['trainer_state'])}")
    print(
        f"model: {m['arch']} h={m['hidden_size']} layers={m['num_layers']} "
        f"heads={m['num_heads']} vocab={m['vocab_size']}"
    )
    print(
        f"data: {data.get('consumed_samples', '?')} samples consumed; loss scale: "
        f"{scaler['scale'] if scaler else '-'}"
    )
    steps = {s.get("step") for s in index["optimizer"]["scalars"].values()}
    print(f"optimizer step counts: {sorted(int(x) for x in steps if x is not None) or '-'}")
    width = max(len(n) for n in info["specs"]) + 2
    print(f"\n{'tensor':<{width}}{'shape':<18}{'dtype':<10}{'tp_dim':<8}slices")
    for name in sorted(info["specs"]):
        spec = info["specs"][name]
        shape = "[" + ", ".join(map(str, spec.shape)) + "]"
        tp_dim = "-" if spec.tp_dim is None else str(spec.tp_dim)
        print(f"{name:<{width}}{shape:<18}{spec.dtype:<10}{tp_dim:<8}{info['pieces'].get(name, 0)}")
    print(f"\n{'file':<24}{'bytes':>12}  {'hash':<24}status")
    damaged = 0
    for fname, f in sorted(info["files"].items()):
        damaged += f["status"].startswith("DAMAGED")
        algo = next((a for a in HASHES if a in f), "-")
        digest = f"{algo} {f.get(algo, '')[:16]}"
        print(f"{fname:<24}{f['bytes']:>12}  {digest:<24}{f['status']}")
    return 1 if damaged else 0


def inspect_export(directory: Path) -> int:
    """Print a model export's summary (``ROOT/final``, export-model's or an import's
    folder): its model, where it came from, its tensors and files. It was refused ("not a
    training checkpoint"). The weights file's header and size are checked (the tensors'
    bytes are not hashed: an export records no digest); a damaged one exits 1."""
    from safetensors import safe_open

    from engine.checkpoint.format import read_meta
    from engine.inference import ModelSource

    cfg, extra = read_meta(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"model export {directory}: {_mib(total)} in {len(files)} files")
    print(
        f"model: {cfg.arch} h={cfg.hidden_size} layers={cfg.num_layers} heads={cfg.num_heads} "
        f"vocab={cfg.vocab_size}"
    )
    if "step" in extra:
        print(f"from: step {extra['step']} of {extra.get('source', '?')}")
    elif HF_CONFIG in extra:
        hf_class = (extra[HF_CONFIG].get("architectures") or ["?"])[0]
        print(f"from: a Hugging Face {hf_class} (tools/convert_hf.py import)")
    elif (directory.parent / storage.LATEST).is_file():
        latest = storage.read_latest(directory.parent)
        print(
            f"from: the end of the run in {directory.parent} (its latest checkpoint: step {latest})"
        )
    try:
        ModelSource(str(directory)).check_weights()
    except ValueError as err:
        print(f"DAMAGED: {err}")
        return 1
    with safe_open(directory / WEIGHTS_FILE, "pt") as weights:
        names = sorted(weights.keys())
        width = max(map(len, names), default=6) + 2
        print(f"\n{'tensor':<{width}}{'shape':<18}dtype")
        for name in names:
            piece = weights.get_slice(name)
            shape = "[" + ", ".join(map(str, piece.get_shape())) + "]"
            print(f"{name:<{width}}{shape:<18}{piece.get_dtype()}")
    print(f"\n{'file':<28}{'bytes':>12}")
    for path in files:
        print(f"{path.name:<28}{path.stat().st_size:>12}")
    return 0


def _tokenizer_note(out: str) -> str:
    if (Path(out) / TOKENIZER_FILE).is_file():
        return f"with its {TOKENIZER_FILE}"
    return "no tokenizer recorded or found: generate.py will need --tokenizer PATH"


def _preset_override(step_dir: Path) -> str:
    """`` model=NAME`` when the checkpoint's model is a preset's (the run needs it to
    resume, as a run of the default preset does not say so), else nothing."""
    cfg = ModelConfig.from_dict(storage.read_index(step_dir)["model_config"])
    name = preset_of(cfg)
    return f" model={name}" if name else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command != "inspect":
        announce_large(args.dcp if args.command == "import-dcp" else args.ckpt)
    try:
        if args.command == "inspect":
            return inspect(args.ckpt, verify=not args.no_verify)
        if args.command == "convert":
            out = convert(args.ckpt, args.out, args.tp_size, args.dp_size)
            print(
                f"wrote {out} for tp={args.tp_size} dp={args.dp_size}; resume with "
                f"checkpoint.dir={args.out}{_preset_override(out)} tp_size={args.tp_size} "
                f"dp_size={args.dp_size}"
            )
            return 0
        if args.command == "export-dcp":
            step = export_dcp(args.ckpt, args.out)
            print(f"exported step {step} to {args.out} (torch.distributed.checkpoint)")
            return 0
        if args.command == "import-dcp":
            path = import_dcp(args.dcp, args.out, like=args.like)
            print(f"imported {args.dcp} as {path}; resume with checkpoint.dir={args.out}")
            return 0
        cfg = export_model(args.ckpt, args.out)
        print(f"exported the {cfg.arch} weights to {args.out} ({_tokenizer_note(args.out)})")
        return 0
    except BrokenPipeError:  # the reader of stdout left: run_tool stops quietly
        raise
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
