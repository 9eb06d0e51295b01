"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) interop, offline.

``export_dcp`` writes a meshtron training checkpoint as a DCP directory, ``import_dcp`` a
DCP directory as a meshtron checkpoint root a run resumes from. Both run in one process
without a process group (``no_dist=True``). The names (docs/CHECKPOINTS.md) are the
state dict ``{"model": {P: tensor}, "optim": {"state": {P: {"exp_avg", "exp_avg_sq",
"step"}}}, "meshtron": {...}}`` that DCP flattens with dots:

    model/P                  <->  model.P                      (full shape)
    optim/P/exp_avg          <->  optim.state.P.exp_avg        (full shape)
    optim/P/exp_avg_sq       <->  optim.state.P.exp_avg_sq
    optimizer.scalars[P]     <->  optim.state.P.step           (0-d float32, as torch's Adam)
    index step               <->  meshtron.step                (0-d int64)
    model_config, trainer_state <-> meshtron.index_json        (uint8 bytes of JSON)

P is the parameter's module path (``layers.0.attn.qkv.weight``). Only tensors are
written, so DCP pickles nothing of ours; reading a DCP directory does unpickle its
``.metadata`` file (torch's format), so import only directories you trust.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from engine.checkpoint import storage
from engine.checkpoint.convert import check_shapes, resolve
from engine.checkpoint.format import META_FILE
from engine.checkpoint.layout import MODEL, OPTIM, assign_writers, dtype_name, written_layout
from engine.checkpoint.manager import CheckpointDirLock
from engine.checkpoint.state import model_name, optim_name, param_spec
from engine.checkpoint.storage import CheckpointError, ShardReader
from engine.models import ModelConfig, build_model

META_KEY = "meshtron.index_json"
STEP_KEY = "meshtron.step"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _dcp():
    import torch.distributed.checkpoint as dcp  # imported on use: it is slow to import

    return dcp


@contextlib.contextmanager
def _one_process():
    """Silence DCP's note that no process group runs: one process is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def to_dcp_name(stored: str) -> str:
    """``model/P`` -> ``model.P``; ``optim/P/key`` -> ``optim.state.P.key``."""
    kind, rest = stored.split("/", 1)
    if kind == MODEL:
        return f"model.{rest}"
    param, key = rest.rsplit("/", 1)
    return f"optim.state.{param}.{key}"


def from_dcp_name(key: str) -> str | None:
    """The stored name of a flattened DCP key, None for keys meshtron does not store as
    tensors (``optim.state.P.step``, ``meshtron.*``, anything else)."""
    if key.startswith("model."):
        return model_name(key[len("model.") :])
    if key.startswith("optim.state."):
        param, moment = key[len("optim.state.") :].rsplit(".", 1)
        return optim_name(param, moment) if moment in MOMENTS else None
    return None


def _json_tensor(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def export_dcp(src: str | Path, out_dir: str | Path) -> int:
    """Write training checkpoint ``src`` (root or step) to ``out_dir`` as DCP; its step.

    ``out_dir`` must be new or empty; it is written under a temp name beside it and renamed
    into place, so a failed export leaves nothing that looks complete.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; give a new one")
    from engine.preflight import probe_writable

    problem = probe_writable(out, directory=True)  # before reading anything
    if problem:
        raise ValueError(f"{problem}; give a directory that can be created and written")
    reader = ShardReader(resolve(src))
    check_shapes(reader)
    index = reader.index
    flat: dict[str, torch.Tensor] = {}
    for name, spec in sorted(reader.specs.items()):
        if spec.kind in (MODEL, OPTIM):
            flat[to_dcp_name(name)] = reader.read(name)
    for param, scalars in index["optimizer"]["scalars"].items():
        if "step" in scalars:
            flat[f"optim.state.{param}.step"] = torch.tensor(float(scalars["step"]))
    flat[STEP_KEY] = torch.tensor(index["step"], dtype=torch.int64)
    meta = {
        "model_config": index["model_config"],
        "trainer_state": index["trainer_state"],
        "source": str(reader.directory),
    }
    flat[META_KEY] = _json_tensor(meta)
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:12]}")
    try:
        with _one_process():
            _dcp().save(flat, checkpoint_id=str(tmp), no_dist=True)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index["step"]


def read_dcp(dcp_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, by flattened key (its non-tensor items skipped)."""
    dcp = _dcp()
    reader = dcp.FileSystemReader(str(dcp_dir))
    try:
        metadata = reader.read_metadata()
    except (OSError, ValueError, EOFError) as err:
        raise CheckpointError(f"{dcp_dir} is not a readable DCP directory ({err})") from None
    flat = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in metadata.state_dict_metadata.items()
        if isinstance(m, dcp.TensorStorageMetadata)
    }
    with _one_process():
        dcp.load(flat, storage_reader=reader, no_dist=True)
    return flat


def _like(path: str | Path) -> tuple[dict, dict]:
    """(model_config, trainer_state) of ``--like``: a training checkpoint (root or step),
    or a model-only export directory (its meshtron.json; no trainer state)."""
    path = Path(path)
    if (path / META_FILE).is_file():
        meta = json.loads((path / META_FILE).read_text())
        return meta.get("model_config", meta), {}
    index = storage.read_index(resolve(path))
    return index["model_config"], index["trainer_state"]


def import_dcp(dcp_dir: str | Path, out_root: str | Path, like: str | Path | None = None) -> Path:
    """Write DCP directory ``dcp_dir`` as a checkpoint root ``out_root`` (new or empty)
    holding one step at tp=1 dp=1; returns the step directory. The model config and
    trainer state come from ``like`` when given, else from the directory's own
    ``meshtron.index_json`` (an ``export_dcp``'s); the step from ``meshtron.step``, else 0.
    """
    out_root = Path(out_root)
    if out_root.exists() and (not out_root.is_dir() or any(out_root.iterdir())):
        raise ValueError(f"{out_root} exists and is not an empty directory; give a new one")
    flat = read_dcp(dcp_dir)
    meta = {}
    if META_KEY in flat:
        meta = json.loads(bytes(flat.pop(META_KEY).tolist()).decode())
    if like is not None:
        meta["model_config"], meta["trainer_state"] = _like(like)
    if "model_config" not in meta:
        raise ValueError(
            f"{dcp_dir} records no meshtron model config: give --like CKPT_OR_MODEL_DIR"
        )
    step = int(flat.pop(STEP_KEY).item()) if STEP_KEY in flat else 0
    cfg = ModelConfig.from_dict(meta["model_config"])
    tensors, scalars = _tensors_of(flat, cfg, dcp_dir)
    state = dict(meta.get("trainer_state") or {})
    state.setdefault("data", {"consumed_samples": 0})
    with CheckpointDirLock(out_root, run_dir="tools/checkpoint.py import-dcp"):
        return _write_root(out_root, step, cfg, tensors, scalars, state)


def _tensors_of(flat: dict, cfg: ModelConfig, where) -> tuple[dict, dict]:
    """({stored name: (spec, tensor)}, optimizer scalars) of the DCP tensors, checked
    against the model ``cfg`` describes (every parameter present, every shape right)."""
    model = build_model(cfg, None, device="meta")
    expected = {}
    for pname, p in model.named_parameters():
        expected[model_name(pname)] = param_spec(model_name(pname), p, MODEL, model)
        for key in MOMENTS:
            expected[optim_name(pname, key)] = param_spec(optim_name(pname, key), p, OPTIM, model)
    tensors, scalars = {}, {}
    for key, value in flat.items():
        name = from_dcp_name(key)
        if name is None:
            if key.startswith("optim.state.") and key.endswith(".step"):
                param = key[len("optim.state.") : -len(".step")]
                scalars[param] = {"step": float(value.item())}
            continue
        spec = expected.get(name)
        if spec is None:
            raise ValueError(f"{where}: {key} is not a tensor of this model (config {cfg.arch})")
        if tuple(value.shape) != spec.shape:
            raise ValueError(
                f"{where}: {key} has shape {list(value.shape)}, the model {list(spec.shape)}"
            )
        tensors[name] = (replace(spec, dtype=dtype_name(value.dtype)), value)
    missing = sorted(n for n, s in expected.items() if s.kind == MODEL and n not in tensors)
    if missing:
        raise ValueError(f"{where} lacks {len(missing)} parameters, e.g. {to_dcp_name(missing[0])}")
    return tensors, {p: s for p, s in scalars.items() if optim_name(p, "exp_avg") in tensors}


def _write_root(out_root, step, cfg, tensors, scalars, state) -> Path:
    specs = [spec for spec, _ in tensors.values()]
    plan = assign_writers(specs, written_layout(1, 1), cfg.padded_vocab_size(1))
    tmp = out_root / f".tmp-{storage.step_dir_name(step)}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        boxes = plan[0]
        data = {name: tensors[name][1].contiguous() for name in boxes}
        record = storage.write_shard(tmp / "rank00000.safetensors", data, boxes)
        index = {
            "step": step,
            "model_config": cfg.to_dict(),
            "trainer_state": state,
            "layout": {
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "ep_size": 1,
                "world_size": 1,
                "zero1": False,
                "device_type": "cpu",
                "imported_from": "dcp",
            },
            "optimizer": {"scalars": scalars},
            "tensors": {spec.name: spec.to_json() for spec in specs},
            "files": {"rank00000.safetensors": record},
        }
        storage.write_index(tmp, index)
        return storage.commit(tmp, out_root, step, keep=1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
