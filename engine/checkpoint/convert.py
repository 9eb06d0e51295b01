"""Offline (one CPU process, no cluster): resolve, summarize, re-shard and export checkpoints."""

from __future__ import annotations

import copy
import math
import shutil
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import storage
from engine.checkpoint.format import META_FILE, check_output_dir, write_checkpoint
from engine.checkpoint.layout import MODEL, OPTIM, RNG, TensorSpec, assign_writers, written_layout
from engine.checkpoint.manager import CheckpointDirLock
from engine.checkpoint.state import model_name, optim_name, param_of, param_spec
from engine.checkpoint.storage import CheckpointError, ShardReader
from engine.checkpoint.tokenizer import recorded_tokenizer
from engine.flops import params_count
from engine.models import ModelConfig, build_model
from layers.router import BIAS_KEY
from parallel_state import ParallelState

MAX_WORLD = 1 << 16  # ranks a conversion plans for, one by one (~1 min at the bound)


def resolve(path: str | Path) -> Path:
    """A step directory, given either it or a checkpoint root (then the one ``latest`` names)."""
    path = Path(path)
    if (path / storage.INDEX).exists():
        return path
    if (path / storage.LATEST).exists():
        return path / storage.step_dir_name(storage.read_latest(path))
    if (path / META_FILE).exists():
        raise CheckpointError(
            f"{path} is a model-only export (meshtron.json + model.safetensors), not a training "
            "checkpoint: tools/convert_hf.py export --ckpt reads it, any TP size loads it"
        )
    steps = storage.step_dirs(path)
    if steps:  # a root whose latest pointer is missing: name what is there
        newest = steps[max(steps)]
        raise CheckpointError(
            f"{path} has no latest pointer; inspect a step directory, e.g. {newest}"
        )
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist: give a checkpoint root (checkpoints/NAME, as a run "
            "prints) or one of its step directories"
        )
    raise CheckpointError(f"{path} is neither a checkpoint step directory nor a checkpoint root")


def summarize(step_dir: Path, *, verify: bool = True) -> dict[str, Any]:
    """The index plus, per file, whether its size and checksum match (``verify``)."""
    reader = ShardReader(step_dir)
    files = {}
    for fname, record in reader.index["files"].items():
        status = "not checked"
        if verify:
            try:
                reader.verify_file(fname)
                status = "OK"
            except CheckpointError as err:
                status = f"DAMAGED: {err}"
        files[fname] = {**record, "status": status}
    pieces: dict[str, int] = {}
    for record in reader.index["files"].values():
        for name in record["slices"]:
            pieces[name] = pieces.get(name, 0) + 1
    return {"index": reader.index, "specs": reader.specs, "files": files, "pieces": pieces}


def convert(src: str | Path, out_root: str | Path, tp_size: int, dp_size: int) -> Path:
    """Rewrite checkpoint ``src`` as if saved at (tp_size, dp_size); returns the new step dir.

    The tensors are the same full-shape ones, re-cut into the files the ranks of the new
    layout would have written, one rank's file at a time (peak memory: one rank's part).
    Per-rank RNG streams belong to the old ranks and are dropped; a run resumed from the
    result reseeds, as any resume at a changed layout does.
    """
    if tp_size < 1 or dp_size < 1:
        raise ValueError(f"--tp-size {tp_size} and --dp-size {dp_size} must be >= 1")
    if tp_size * dp_size > MAX_WORLD:  # the plan is made per rank: bound it before making it
        raise ValueError(
            f"--tp-size {tp_size} × --dp-size {dp_size} = {tp_size * dp_size} ranks must be "
            f"<= {MAX_WORLD} (2**16)"
        )
    src, out_root = resolve(src), Path(out_root)
    reader = ShardReader(src)
    check_out_root(out_root, src, tp_size, dp_size, reader.index["step"])
    cfg, model_specs = check_shapes(reader)
    index = reader.index
    cfg.validate(tp_size)
    # Every tensor of a parameter is cut as the model's layers cut the parameter (the block
    # count of a KV projection past its heads), whatever the index recorded.
    blocks = {param_of(n): s.tp_blocks for n, s in model_specs.items() if s.kind == MODEL}
    specs = [
        replace(s, tp_blocks=blocks.get(param_of(s.name), s.tp_blocks))
        for s in reader.specs.values()
        if s.kind != RNG
    ]
    plan = assign_writers(specs, written_layout(tp_size, dp_size), cfg.padded_vocab_size(tp_size))
    # The output may be a run's checkpoint directory: hold its lock while writing, as a
    # run does, so neither removes the other's files.
    with CheckpointDirLock(out_root, run_dir="tools/checkpoint.py convert"):
        # Again under the lock: another convert may have written there since the check.
        check_out_root(out_root, src, tp_size, dp_size, index["step"], locked=True)
        return _write_converted(reader, index, specs, plan, out_root, tp_size, dp_size)


OUT_RULE = (
    "--out must be a new or empty directory, or a root that earlier converts of the same "
    "source run wrote at the same tp/dp with only older steps (the step is added and latest "
    "moves forward); never a root holding another run's steps or latest, never inside the "
    "source run's root"
)


def check_out_root(
    out_root: Path, src: Path, tp_size: int, dp_size: int, step: int, *, locked: bool = False
) -> None:
    """Raise ValueError (one line) unless writing step ``step`` of ``src`` (a step directory)
    into ``out_root`` at (tp_size, dp_size) follows ``OUT_RULE``: convert only ever adds a
    newer step to a root of its own, so no run's checkpoint is replaced, pruned, or has its
    ``latest`` moved. ``locked``: this process holds the root's lock (its ``.lock`` is ours).
    """
    source_root, out = src.resolve().parent, out_root.resolve()
    if out == source_root or source_root in out.parents:
        raise ValueError(
            f"--out {out_root} is inside the source run's checkpoint root {source_root}: "
            "convert never writes into its input; give a new directory"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out_root} is a file; give a checkpoint directory to write")
    from engine.preflight import probe_writable

    problem = probe_writable(out, directory=True)
    if problem:
        raise ValueError(f"--out {out_root}: {problem}; give a directory that can be written")
    entries = list(out.iterdir()) if out.is_dir() else []
    entries = [e for e in entries if e.name != CheckpointDirLock.NAME or _held(e, locked)]
    if not entries:
        return
    steps = _own_steps(out, entries, source_root, tp_size, dp_size)
    if isinstance(steps, str):
        raise ValueError(f"--out {out_root} {steps}; {OUT_RULE}")
    newest = max([*steps, storage.read_latest(out) or 0])
    if newest >= step:
        raise ValueError(
            f"--out {out_root} already holds step {newest} of this conversion, not older "
            f"than step {step}: convert never replaces a step nor moves latest backwards"
        )


def _held(lock_file: Path, locked: bool) -> bool:
    """Whether a root's ``.lock`` names a run (live, or one that died holding it)."""
    return not locked and (not lock_file.is_file() or lock_file.stat().st_size > 0)


def _own_steps(
    out: Path, entries: list[Path], source_root: Path, tp_size: int, dp_size: int
) -> list[int] | str:
    """The steps of a root that converts of ``source_root`` at (tp_size, dp_size) wrote,
    or why it is not such a root (its first entry that is not)."""
    steps, committed = [], {path.name: step for step, path in storage.step_dirs(out).items()}
    for entry in sorted(entries):
        if entry.name == storage.LATEST and entry.is_file():
            continue
        if entry.name == CheckpointDirLock.NAME:
            return f"is locked by a run ({entry} names it, live or dead)"
        if entry.name not in committed:
            return f"is not empty ({entry.name} is there)"
        try:
            layout = storage.read_index(entry)["layout"]
        except (CheckpointError, KeyError, TypeError):
            layout = None
        ours = isinstance(layout, dict) and layout.get("converted_source") == str(source_root)
        if not ours or (layout.get("tp_size"), layout.get("dp_size")) != (tp_size, dp_size):
            return f"holds {entry.name}, not converted from {source_root} at this tp/dp"
        steps.append(committed[entry.name])
    return steps or "is not empty (a latest without step directories)"


def _write_converted(reader, index, specs, plan, out_root: Path, tp_size: int, dp_size: int):
    """Write the re-cut files and the index into a temp directory of this conversion's
    own, and commit it as a step of ``out_root``."""
    tmp = out_root / f".tmp-{storage.step_dir_name(index['step'])}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        return _fill_and_commit(tmp, reader, index, specs, plan, out_root, tp_size, dp_size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion leaves nothing half made
        raise


def _fill_and_commit(tmp, reader, index, specs, plan, out_root, tp_size, dp_size) -> Path:
    files = {}
    for rank, mine in plan.items():
        if mine:
            tensors = {name: reader.read(name, box) for name, box in mine.items()}
            files[f"rank{rank:05d}.safetensors"] = storage.write_shard(
                tmp / f"rank{rank:05d}.safetensors", tensors, mine
            )
    new = copy.deepcopy({k: v for k, v in index.items() if k not in ("files", "index_sha256")})
    new["tensors"] = {s.name: s.to_json() for s in specs}
    new["files"] = files
    new["layout"] = {
        "tp_size": tp_size,
        "dp_size": dp_size,
        "pp_size": 1,
        "cp_size": 1,
        "ep_size": 1,
        "world_size": tp_size * dp_size,
        "zero1": index["layout"].get("zero1", False),
        "converted_from": index["layout"],
        "converted_source": str(reader.directory.resolve().parent),
    }
    config = new.get("trainer_state", {}).get("config")
    if isinstance(config, dict):  # keep the recorded run config consistent with the layout
        config.update(tp_size=tp_size, dp_size=dp_size)
    storage.write_index(tmp, new)
    return storage.commit(tmp, out_root, index["step"], keep=1 << 30)


def read_model_state(
    src: str | Path, state: ParallelState | None = None
) -> tuple[ModelConfig, dict, dict]:
    """(model config, full model weights, index) of a training checkpoint (root or step);
    ``state``: the calling rank's mesh, if it has one (the shape check builds on it)."""
    reader = ShardReader(resolve(src))
    cfg, _ = check_shapes(reader, state)  # before any tensor is allocated
    weights = {
        n[len("model/") :]: reader.read(n) for n, s in reader.specs.items() if s.kind == MODEL
    }
    # The sigmoid routers' biases live in the trainer state (engine.checkpoint.run).
    biases = (reader.index.get("trainer_state") or {}).get("router_bias") or {}
    for name, values in biases.items():
        weights[name + BIAS_KEY] = torch.tensor(values, dtype=torch.float32)
    return cfg, weights, reader.index


# Weights past this size take seconds to minutes to read and write (about 5 s a GiB on a
# 2-core CPU): the conversion tools say so first, on stderr (stdout keeps their summary).
ANNOUNCE_BYTES = 1 << 30


def announce_large(source: str | Path) -> None:
    """Say on stderr that a conversion of more than ``ANNOUNCE_BYTES`` of weights has
    started, and what it reads: a folder's safetensors (or DCP) files, a training
    checkpoint root's latest step. Nothing for a smaller or unreadable source (the
    conversion names what is wrong with it)."""
    root = Path(source)
    if not root.is_dir():
        return
    if (root / storage.LATEST).is_file():  # a training checkpoint root: its latest step
        try:
            latest = storage.read_latest(root)
        except (CheckpointError, OSError, ValueError):
            return
        root = root if latest is None else root / storage.step_dir_name(latest)
    files = [*root.glob("*.safetensors"), *root.glob("*.distcp")]
    size = sum(p.stat().st_size for p in files if p.is_file())
    if size >= ANNOUNCE_BYTES:
        print(
            f"converting {size / (1 << 30):.1f} GiB of weights from {source} ...", file=sys.stderr
        )


def export_model(src: str | Path, out_dir: str | Path) -> ModelConfig:
    """Write the model weights alone in engine.checkpoint.format (for HF export, inference),
    with a copy of the tokenizer the checkpoint records (when that file is still there)."""
    check_output_dir(out_dir)
    cfg, state, index = read_model_state(src)
    tokenizer = recorded_tokenizer(index.get("trainer_state"))
    extra = {"step": index["step"], "source": str(resolve(src))}
    write_checkpoint(out_dir, state, cfg, extra=extra, tokenizer=tokenizer)
    return cfg


def check_shapes(
    reader: ShardReader, state: ParallelState | None = None
) -> tuple[ModelConfig, dict[str, TensorSpec]]:
    """The index's model config, once its tensor shapes are known to be sane, and the specs
    of the tensors the config's model holds (by stored name); before any tensor is allocated.

    The index's self-checksum catches accidents, not edits: an edited index can ask for
    any shape. So every tensor must fit in the bytes its files hold on disk, and the model
    tensors must have the shapes of the model the index's config describes.
    """
    where = reader.directory / storage.INDEX
    try:
        cfg = ModelConfig.from_dict(reader.index["model_config"])
        cfg.validate(1)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: bad model_config ({err})") from None
    on_disk = sum(
        (reader.directory / f).stat().st_size
        for f in reader.index["files"]
        if (reader.directory / f).is_file()
    )
    for spec in reader.specs.values():
        nbytes = math.prod(spec.shape) * spec.torch_dtype.itemsize
        if min(spec.shape, default=1) < 0 or nbytes > on_disk:
            raise CheckpointError(
                f"{where}: {spec.name} of shape {list(spec.shape)} needs {nbytes} bytes, more "
                f"than the checkpoint's files hold ({on_disk} bytes); the index is edited or damaged"
            )
    if params_count(cfg) * 2 > on_disk:  # at least 2 bytes a parameter are stored
        raise CheckpointError(
            f"{where}: model_config describes {params_count(cfg)} parameters, more than the "
            f"files ({on_disk} bytes) can hold; the index is edited or damaged"
        )
    return cfg, _check_model_shapes(reader, cfg, where, state)


def _check_model_shapes(
    reader: ShardReader, cfg: ModelConfig, where: Path, state: ParallelState | None
) -> dict[str, TensorSpec]:
    model = build_model(cfg, state, device="meta")  # shapes only: meta allocates nothing
    expected = {}
    for name, param in model.named_parameters():
        expected[model_name(name)] = param_spec(model_name(name), param, MODEL, model)
        for key in ("exp_avg", "exp_avg_sq"):
            oname = optim_name(name, key)
            expected[oname] = param_spec(oname, param, OPTIM, model)
    for spec in reader.specs.values():
        want = expected.get(spec.name)
        if spec.kind == MODEL and want is None:
            raise CheckpointError(f"{where}: {spec.name} is not a parameter of this model")
        if spec.kind in (MODEL, OPTIM) and want is not None and spec.shape != want.shape:
            raise CheckpointError(
                f"{where}: {spec.name} has shape {list(spec.shape)}, the model_config's model "
                f"{list(want.shape)}; the index is edited or damaged"
            )
    return expected
