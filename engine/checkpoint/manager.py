"""Save and resume a training run: the collective protocol over a checkpoint root.

Saving: every rank writes only the slices it owns (``layout.assign_writers``) plus its
RNG streams into one safetensors file of a shared temp directory; rank 0 writes the index
(layout, trainer state, scalar optimizer state, per-file size and BLAKE3 hash) and commits
(``storage.commit``). Failures on any rank are agreed on, so no rank waits forever.

Loading: candidates are ``latest`` and then older committed steps (without ``latest``,
every step directory, newest first). Each rank reads what its own layout needs, the
parameters straight into place, verifying every file it opens; if any rank found damage
the ranks agree to fall back to the next candidate (which overwrites every parameter
again), and rank 0 says so. A load that finds nothing usable raises, and the parameters
it had begun to overwrite are then undefined.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import comm
from engine.checkpoint.format import check_compatible
from engine.checkpoint.layout import (
    MODEL,
    OPTIM,
    RNG,
    TensorSpec,
    assign_writers,
    crop_local,
    written_layout,
)
from engine.checkpoint.state import (
    as_held_by,
    expect_local,
    export_local,
    load_optimizer,
    model_name,
    padded_vocab,
    param_of,
    read_local,
)
from engine.checkpoint.storage import (
    CheckpointError,
    ShardReader,
    commit,
    read_index,
    read_latest,
    step_dir_name,
    step_dirs,
    write_index,
    write_shard,
)
from engine.checkpoint.tensorfile import HASHES
from engine.data_parallel import DataParallel, checkpoint_view
from engine.models import ModelConfig, ParallelModel
from layers.router import load_router_biases
from layers.utils import assign_tp_local_, dp_sharded
from parallel_state import ParallelState
from parallel_state.dims import ParallelDims

Fault = Callable[[str], None]  # test hook: called at "after_shard", "before_index", ...


@dataclass(frozen=True)
class _Mesh:
    """This rank in the run's layout, and the few world-wide agreements the protocol needs."""

    rank: int = 0
    dims: ParallelDims = written_layout()  # the run's layout (a lone process: 1 × 1)
    device_type: str = "cpu"  # RNG states only transfer between generators of one kind
    group: Any = None  # the agreements' group; None: the world's

    @classmethod
    def of(cls, ps: ParallelState | None) -> _Mesh:
        return cls() if ps is None else cls(ps.rank, ps.dims, ps.device.type)

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def stage_rank(self) -> int:
        """This rank's index among the ranks of its pipeline stage (``assign_writers``
        plans each stage's own parameters over them)."""
        return self.dims.rank_in_stage(self.rank)

    def _group(self) -> Any:
        if self.world == 1:
            return None
        return self.group if self.group is not None else comm.world()

    def all_gather(self, obj: Any) -> list[Any]:
        return comm.all_gather_object(obj, self._group())

    def from_rank0(self, obj: Any) -> Any:
        return comm.broadcast_object(obj, self._group())


@dataclass
class Loaded:
    """What :func:`load_checkpoint` restored."""

    path: Path
    step: int
    state: dict[str, Any]  # the trainer state given to save_checkpoint
    layout: dict[str, Any]  # the layout it was saved at
    rng_restored: bool  # False when the layout changed: the caller reseeds


def _rng_tensors(ps: ParallelState | None, rank: int) -> dict[str, torch.Tensor]:
    states = {"default": torch.get_rng_state()} if ps is None else ps.rng.get_states()
    if ps is not None and ps.device.type == "cuda":
        states["torch_cpu"] = torch.get_rng_state()  # the tracker's default is the GPU's
    return {f"rng/rank{rank:05d}/{k}": v for k, v in states.items()}


def _guard(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
        return None, f"{type(err).__name__}: {err}"


def save_checkpoint(
    root: str | Path, step: int, *, log: Callable[[str], None] | None = None, **save: Any
) -> Path:
    """Write step ``step`` under ``root`` and make it ``latest``; every rank calls this.

    ``save``: the keywords of :func:`stage_checkpoint`, whose two halves this runs in one
    go (``model``, ``optimizer``, ``ps``, ``state``: JSON-able trainer state such as the
    data position, loss scale and config; ``keep`` and ``fault`` optional). Returns the
    committed step directory; raises CheckpointError on every rank if any rank failed.
    ``log`` (rank 0) hears which older or broken step directories were removed, and why.
    """
    return stage_checkpoint(root, step, **save)(log)


def stage_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: ParallelModel,
    optimizer: DataParallel | torch.optim.Optimizer | None,
    ps: ParallelState | None,
    state: dict[str, Any],
    keep: int = 2,
    fault: Fault | None = None,
    copy: bool = False,
    group: Any = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> Callable[[Callable[[str], None] | None], Path]:
    """The first half of :func:`save_checkpoint` (every rank, together): make this save's
    temp directory and take this rank's slices; returns ``write(log)``, the second half
    (write the files, agree, rank 0 commits), which every rank then calls.

    ``copy``: the slices are copied to host memory, so training may change the model and
    optimizer while ``write`` runs in another thread (``engine.checkpoint.background``);
    ``group``: the process group ``write``'s agreements use (one of the writer's own there);
    ``buffers``: host tensors the copies go into, kept by the caller from save to save (a
    fresh allocation is page-faulted in at every save, slower than the copy itself); only
    while no earlier ``write`` that used them still runs.
    """
    root, mesh, fault = Path(root), _Mesh.of(ps), fault or (lambda point: None)
    # A name of this save's own: nothing another save (of any run) makes or removes.
    tmp, err = root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}", None
    if mesh.rank == 0:
        _, err = _guard(lambda: (root.mkdir(parents=True, exist_ok=True), tmp.mkdir()))
    err, tmp = mesh.from_rank0((err, tmp))
    _raise_if(err, "creating", tmp)
    specs, tensors, scalars = export_local(model, optimizer)  # collective under ZeRO-1
    copies = set(model.stored_elsewhere())  # a pipeline's tied copy: its original is stored
    specs = {n: spec for n, spec in specs.items() if param_of(n) not in copies}
    # Each pipeline stage plans the slices of its own parameters among its tp × dp ranks.
    plan = assign_writers(list(specs.values()), mesh.dims.stage(), padded_vocab(model))
    mine = dict(plan.get(mesh.stage_rank, {}))
    rng = _rng_tensors(ps, mesh.rank)
    for name, value in rng.items():
        specs[name] = TensorSpec(name, tuple(value.shape), "uint8", RNG, rank=mesh.rank)
        mine[name] = [(0, n) for n in value.shape]
    local = {n: rng[n] if n in rng else crop_local(tensors[n], box) for n, box in mine.items()}
    if copy:  # a snapshot of host memory of its own: training goes on meanwhile
        with _one_thread():
            local = {n: _host_copy(t, buffers, n) for n, t in local.items()}
    zero1 = optimizer is not None and checkpoint_view(optimizer).shards_optimizer
    head = _index_head(step, model.cfg, state, zero1, mesh)
    writer = mesh if group is None else replace(mesh, group=group)
    del tensors  # the slices to write are in ``local``

    def write(log: Callable[[str], None] | None = None) -> Path:
        def write_mine() -> dict:
            record = write_shard(tmp / f"rank{mesh.rank:05d}.safetensors", local, mine)
            record["specs"] = {n: specs[n].to_json() for n in mine}
            record["scalars"] = scalars  # each pipeline stage has its own parameters' scalars
            fault("after_shard")
            return record

        records = writer.all_gather(_guard(write_mine))
        _raise_if(next((e for _, e in records if e), None), "writing shards of", tmp, mesh)
        err = None
        if mesh.rank == 0:

            def finish() -> Path:
                fault("before_index")
                write_index(tmp, _index(head, records))
                fault("before_rename")
                return commit(
                    tmp, root, step, keep, before_latest=lambda: fault("before_latest"), log=log
                )

            _, err = _guard(finish)
        _raise_if(writer.from_rank0(err), "committing", tmp, mesh)
        return root / step_dir_name(step)

    return write


@contextlib.contextmanager
def _one_thread():
    """Copies on this thread alone: each of the many small copies would otherwise wake
    torch's intra-op threads, which on a busy CPU took 25× longer than the copies (0.42 s
    against 0.016 s for 60 MiB in 157 tensors on 2 shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _host_copy(t: torch.Tensor, buffers: dict | None, name: str) -> torch.Tensor:
    """A host copy of ``t``, into ``buffers[name]`` when it fits (kept there for next time)."""
    into = None if buffers is None else buffers.get(name)
    if into is None or into.shape != t.shape or into.dtype != t.dtype:
        into = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if buffers is not None:
            buffers[name] = into
    return into.copy_(t.detach())


def _index_head(step: int, cfg: ModelConfig, state: dict, zero1: bool, mesh: _Mesh) -> dict:
    """index.json of a save but for what the ranks' files add: the step, the model config,
    the trainer state and the layout it was written at."""
    return {
        "step": step,
        "model_config": cfg.to_dict(),
        "trainer_state": state,
        "layout": {
            "tp_size": mesh.dims.tp,
            "dp_size": mesh.dims.dp,
            "pp_size": mesh.dims.pp,
            "cp_size": mesh.dims.cp,
            "ep_size": mesh.dims.ep,  # the experts are stored whole whatever it was
            "world_size": mesh.world,
            "zero1": zero1,
            "device_type": mesh.device_type,
        },
    }


def _index(head: dict, records: list) -> dict:
    """index.json of a save: ``_index_head``'s, the optimizer's scalars and every rank's
    file and slice records."""
    merged: dict[str, dict] = {}
    for record, _ in records:  # rank 0's first: without a pipeline, rank 0's alone
        for pname, values in record.pop("scalars").items():
            merged.setdefault(pname, values)
    return {
        **head,
        "optimizer": {"scalars": merged},
        "tensors": {n: s for r, _ in records for n, s in r.pop("specs").items()},
        "files": {f"rank{i:05d}.safetensors": r for i, (r, _) in enumerate(records)},
    }


def _raise_if(err: str | None, doing: str, path: Path, mesh: _Mesh | None = None) -> None:
    """Raise the agreed failure; rank 0 first removes this save's temp directory (every
    rank is past writing into it: the failure was agreed on)."""
    if err is not None:
        if mesh is not None and mesh.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(f"checkpoint save failed while {doing} {path}: {err}")


def _candidates(root: Path, log: Callable[[str], None]) -> list[Path]:
    """Step directories to try, best first (see the module docstring)."""
    dirs = step_dirs(root)
    try:
        latest = read_latest(root)
    except CheckpointError as err:
        log(f"{err}; trying the newest complete checkpoint instead")
        return [dirs[s] for s in sorted(dirs, reverse=True)]
    if latest is None:
        if dirs:  # e.g. a copy that lost the pointer: the checksums tell what is complete
            log(
                f"{root} has no 'latest': trying the newest complete checkpoint of "
                f"{len(dirs)} ({step_dir_name(max(dirs))}) first"
            )
        return [dirs[s] for s in sorted(dirs, reverse=True)]
    older = [dirs[s] for s in sorted(dirs, reverse=True) if s < latest]
    return [root / step_dir_name(latest), *older]


def _quick_check(path: Path) -> dict:
    """``path``'s index, after the checks that read no tensor data: the index reads and is
    well formed, and every file it lists is there at its recorded size (CheckpointError
    otherwise). The hashes are the loader's to check."""
    index = read_index(path)
    _check_index(path, index)
    ShardReader(path, index).check_sizes()
    return index


def newest_index(root: str | Path) -> tuple[Path, dict] | None:
    """The step directory a resume from ``root`` tries first that passes the quick checks
    (the loader's order: ``latest``, then older steps), with its index; None when there is
    none. Its shard files are not read: the load may still fall back further."""
    for path in _candidates(Path(root), lambda msg: None):
        try:
            return path, _quick_check(path)
        except CheckpointError:
            continue
    return None


def unusable_checkpoints(root: str | Path) -> list[str]:
    """Why each step directory under ``root`` fails the quick checks, newest first, when
    every one fails (a resume would then find nothing to load); [] when one passes or
    there are none. Found before any worker starts."""
    problems = []
    for path in _candidates(Path(root), lambda msg: None):
        try:
            _quick_check(path)
        except CheckpointError as err:
            problems.append(f"{path.name}: {err}")
            continue
        return []
    return problems


def _read_rank(path: Path, model: ParallelModel, optimizer, mesh: _Mesh) -> dict[str, Any]:
    """Everything this rank needs from ``path``, read and verified.

    Parameters (and optimizer state the optimizer already holds, unsharded) are read
    straight into place, so a failed read leaves them undefined: a fallback overwrites
    them all, and with nothing usable the load raises. The rest is applied by ``_apply``.
    """
    index = read_index(path)
    _check_index(path, index)
    try:
        saved = ModelConfig.from_dict(index["model_config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"{path / 'index.json'} has a malformed model_config ({err})"
        ) from None
    try:
        check_compatible(model.cfg, saved)
    except ValueError as err:
        raise ValueError(
            f"{path} does not fit this model: {err} (choose another checkpoint.dir or name "
            "for a new model; delete the directory only if its checkpoints are not wanted)"
        ) from None
    try:
        return _read_tensors(path, index, model, optimizer, mesh)
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError) as err:
        # Shapes of the index's entries that its checksum cannot vouch for (an edited index).
        raise CheckpointError(f"{path / 'index.json'} is malformed ({err!r})") from None


_INDEX_SHAPE = {
    "model_config": dict,
    "trainer_state": dict,
    "layout": dict,
    "optimizer": dict,
    "tensors": dict,
    "files": dict,
}


def _check_index(path: Path, index: dict) -> None:
    """CheckpointError naming the first entry of ``index`` of the wrong type or value, or
    claiming what the directory contradicts (its step)."""
    where = path / "index.json"
    for key, kind in _INDEX_SHAPE.items():
        if not isinstance(index.get(key), kind):
            raise CheckpointError(f"{where}: {key} is not a {kind.__name__}")
    step = index.get("step")
    if type(step) is not int or path.name != step_dir_name(step):
        raise CheckpointError(f"{where} claims step {step!r}, but the directory is {path.name}")
    layout = index["layout"]
    for key in ("tp_size", "dp_size", "world_size"):
        if type(layout.get(key)) is not int or layout[key] < 1:
            raise CheckpointError(f"{where}: layout.{key}={layout.get(key)!r} is not a size")
    scalars = index["optimizer"].get("scalars")
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        raise CheckpointError(f"{where}: optimizer.scalars is not a mapping of mappings")
    for fname, record in index["files"].items():
        ok = isinstance(record, dict) and type(record.get("bytes")) is int
        # A record names its digest under one of the algorithms a reader verifies.
        digest = ok and any(isinstance(record.get(name), str) for name in HASHES)
        if not (digest and isinstance(record.get("slices"), dict)):
            raise CheckpointError(f"{where}: the record of {fname!r} is malformed")


def _read_tensors(path: Path, index: dict, model, optimizer, mesh: _Mesh) -> dict[str, Any]:
    """The parameters, optimizer state and RNG streams this rank needs from ``path``."""
    reader = ShardReader(path, index)
    wanted = _wanted(reader, model, optimizer, path)
    for spec, owner, into in wanted:
        if into is not None:
            expect_local(reader, spec, into, model, owner)
    params, states = {}, {}
    for spec, owner, into in wanted:
        value = read_local(reader, spec, owner.shape, model, into, owner)
        if spec.kind == MODEL:
            params[owner] = value
        else:
            states.setdefault(owner, {})[spec.name.rsplit("/", 1)[1]] = value
    if optimizer is not None:
        owners = dict(model.named_parameters())
        for pname, scalars in index["optimizer"]["scalars"].items():
            if pname in owners:
                states.setdefault(owners[pname], {}).update(scalars)
    layout, rng = index["layout"], None
    saved = (layout["tp_size"], layout["dp_size"], layout.get("pp_size", 1))
    same_layout = saved == (mesh.dims.tp, mesh.dims.dp, mesh.dims.pp)
    # A CUDA generator state cannot seed a CPU generator (nor the reverse): reseed instead.
    if same_layout and layout.get("device_type", "cpu") == mesh.device_type:
        prefix = f"rng/rank{mesh.rank:05d}/"
        rng = {n[len(prefix) :]: reader.read(n) for n in reader.specs if n.startswith(prefix)}
    return {"index": index, "params": params, "states": states, "rng": rng or None}


def _wanted(reader: ShardReader, model: ParallelModel, optimizer, path: Path) -> list[tuple]:
    """[(spec, parameter it belongs to, tensor to read it into or None)] for this rank."""
    owners = dict(model.named_parameters())
    held = {}  # optimizer state tensors already in place (unsharded): read into them
    if optimizer is not None and not checkpoint_view(optimizer).shards_optimizer:
        held = checkpoint_view(optimizer).param_states()
    wanted = []
    for name, p in owners.items():
        spec = reader.specs.get(model_name(name))
        if spec is None or spec.kind != MODEL:
            raise ValueError(f"{path} has no parameter {name}: not this model's checkpoint")
        wanted.append((as_held_by(spec, p), p, None if dp_sharded(p) else p.detach()))
    for spec in reader.specs.values() if optimizer is not None else ():
        if spec.kind == OPTIM:
            pname, key = spec.name[len("optim/") :].rsplit("/", 1)
            if pname not in owners and pname in model.full_names:
                continue  # another pipeline stage's parameter
            if pname not in owners:
                raise ValueError(f"{path} has optimizer state of {pname}, not in the model")
            owner = owners[pname]
            into = held.get(owner, {}).get(key)
            fits = torch.is_tensor(into) and into.shape == owner.shape
            wanted.append((as_held_by(spec, owner), owner, into if fits else None))
    return wanted


@torch.no_grad()
def _apply(payload: dict, model: nn.Module, optimizer, ps: ParallelState | None) -> None:
    for p, value in payload["params"].items():
        if dp_sharded(p) or value.data_ptr() != p.data_ptr():  # not read into place
            assign_tp_local_(p, value)
    if optimizer is not None:
        load_optimizer(optimizer, payload["states"])
    # The sigmoid routers' biases, which the trainer state keeps (engine.checkpoint.run).
    load_router_biases(model, (payload["index"]["trainer_state"] or {}).get("router_bias"))
    rng = payload["rng"]
    if rng is not None:
        cpu = rng.pop("torch_cpu", None)
        if ps is None:
            torch.set_rng_state(rng["default"])
        else:
            ps.rng.set_states(rng)
        if cpu is not None:
            torch.set_rng_state(cpu)


def load_checkpoint(
    root: str | Path,
    *,
    model: ParallelModel,
    optimizer: DataParallel | torch.optim.Optimizer | None,
    ps: ParallelState | None,
    log: Callable[[str], None] = print,
) -> Loaded | None:
    """Restore the newest usable checkpoint under ``root`` at this rank's layout.

    Returns None when ``root`` holds no committed checkpoint. A damaged one is skipped for
    the previous one (``log`` says why, on rank 0); CheckpointError if none is usable.
    """
    root, mesh = Path(root), _Mesh.of(ps)
    say = log if mesh.rank == 0 else (lambda msg: None)
    candidates = _candidates(root, say)
    problems = []
    for i, path in enumerate(candidates):
        payload, err, fatal = _guard_damage(lambda p=path: _read_rank(p, model, optimizer, mesh))
        outcomes = mesh.all_gather((fatal is not None, err))  # err names its file
        if fatal is not None:
            raise fatal
        fatal_ranks = [r for r, (is_fatal, _) in enumerate(outcomes) if is_fatal]
        if fatal_ranks:
            raise CheckpointError(
                f"loading {path} failed on rank {fatal_ranks[0]} (its error is in that rank's log)"
            )
        errors = [e for _, e in outcomes if e]
        if errors:
            problems.append(f"{path.name}: {errors[0]}")
            nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
            say(
                f"checkpoint {path} is unusable ({errors[0]}); "
                + (f"falling back to {nxt}" if nxt else "no older checkpoint left")
            )
            continue
        _apply(payload, model, optimizer, ps)
        index = payload["index"]
        return Loaded(
            path, index["step"], index["trainer_state"], index["layout"], payload["rng"] is not None
        )
    if problems:
        raise CheckpointError(f"no usable checkpoint in {root}: " + "; ".join(problems))
    return None


def _guard_damage(fn: Callable[[], Any]) -> tuple[Any, str | None, BaseException | None]:
    """(result, damage, fatal): damage (a CheckpointError) is survivable; anything else
    (a mismatch with the model, an OS error) is fatal, and is returned rather than raised
    so that every rank first reaches the agreement all-gather instead of waiting on this one.
    """
    try:
        return fn(), None, None
    except CheckpointError as err:
        return None, str(err), None
    except Exception as err:  # noqa: BLE001 - re-raised on every rank after the all-gather
        return None, None, err


def checkpoint_dir(cfg) -> str:
    """The experiment's stable checkpoint directory (not Hydra's per-run folder); ``cfg``:
    the run's Config."""
    return cfg.checkpoint.dir or str(Path("checkpoints") / cfg.name)


class CheckpointDirBusy(CheckpointError):
    """Another live run holds the checkpoint directory's lock."""


class CheckpointDirLock:
    """One run per checkpoint directory: an advisory ``flock`` on ``ROOT/.lock``, held for
    the run's life, recording who holds it (user, host, PID, start, run directory).

    The kernel drops the lock when its process dies, however it dies, so a lock file that
    still names an owner but is not locked is a dead run's: it is taken over with a line
    saying so, and that run's interrupted saves (``.tmp-*``, ``.trash-*``) are removed.
    A clean release empties the file. Use as ``lock.acquire(log=...)`` then ``with lock:``.
    """

    NAME = ".lock"

    def __init__(self, root: str | Path, *, run_dir: str = ".") -> None:
        self.root, self.run_dir, self._file = Path(root), run_dir, None

    def acquire(self, *, log: Callable[[str], None] = print) -> None:
        """Take the lock or raise CheckpointDirBusy naming the run that holds it."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / self.NAME, "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _describe_owner(f)
            f.close()
            raise CheckpointDirBusy(
                f"checkpoint.dir={self.root} is in use by another run ({owner}); wait for it "
                "to end, or give this run its own name=NAME or checkpoint.dir=DIR"
            ) from None
        previous = _describe_owner(f)
        if previous:
            log(
                f"took over the lock of {self.root} from a run that did not end cleanly "
                f"({previous}; no longer running)"
            )
            for entry in self.root.iterdir():
                if entry.is_dir() and entry.name.startswith((".tmp-", ".trash-")):
                    log(f"removed {entry}: an interrupted save of that run")
                    shutil.rmtree(entry, ignore_errors=True)
        record = {
            "user": _user(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "run_dir": self.run_dir,
        }
        f.seek(0)
        f.truncate()
        f.write(json.dumps(record) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        """Empty the record (a clean end) and drop the lock."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.truncate(0)
            self._file.close()  # closing the last descriptor drops the flock
            self._file = None

    def __enter__(self) -> CheckpointDirLock:
        if self._file is None:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container's uid without a passwd entry
        return str(os.getuid())


def _describe_owner(f) -> str:
    """``user@host, PID n, started ..., run dir ...`` from a lock file, '' when empty."""
    f.seek(0)
    text = f.read(4096).strip()
    try:
        r = json.loads(text) if text else None
        return (
            f"{r['user']}@{r['host']}, PID {r['pid']}, started {r['started']}, "
            f"run directory {r['run_dir']}"
        )
    except (ValueError, TypeError, KeyError, RecursionError):
        return f"an unreadable record {text[:60]!r}" if text else ""
