"""A training run's checkpoint directory (``checkpoint_dir(cfg)``): the resumable
checkpoints saved during the run, the newest one loaded to resume it, the final model
export. The trainer decides when (and whether the weights are fit to save); this says
where, and in the console lines, what was done."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import nn

from engine import comm
from engine.checkpoint.background import BackgroundSaver
from engine.checkpoint.format import save_model
from engine.checkpoint.manager import Loaded, checkpoint_dir, load_checkpoint, stage_checkpoint
from engine.checkpoint.tokenizer import tokenizer_record
from engine.data_parallel import DataParallel
from layers.router import BIAS_KEY, router_biases
from parallel_state import ParallelState
from parallel_state.groups import side_group


def tensorboard_dir(cfg) -> str | None:
    """Where the run's TensorBoard scalars go (``None``: off): beside its checkpoints, the
    directory every resume of the run shares, not Hydra's per-launch folder."""
    return os.path.join(checkpoint_dir(cfg), "tensorboard") if cfg.trainer.tensorboard else None


def reshard_note(was: dict, ps: ParallelState) -> str:
    """What the resume line adds when checkpoint layout ``was`` differs from this mesh's."""
    parts = []
    if (was["tp_size"], was["dp_size"]) != (ps.size("tp"), ps.size("dp")):
        parts.append(f"tp={was['tp_size']} dp={was['dp_size']}")
    now = {"pp": ps.size("pp"), "cp": ps.dims.cp, "ep": ps.dims.ep}
    for axis, size in now.items():
        # cp_size is recorded since 2026-11-27: an older checkpoint's is unknown
        saved = was.get(f"{axis}_size", None if axis == "cp" else 1)
        if saved is not None and saved != size:
            parts.append(f"{axis}={saved}")
    return f", resharded from {' '.join(parts)}" if parts else ""


class RunCheckpoints:
    """Checkpoints of ``model`` and ``optimizer`` in the directory of run ``cfg``; every
    rank calls each method together. ``say(line, markup)`` prints a console line.

    With ``checkpoint.async_save`` a save returns once staged (copied to host memory) and
    is written in the background (``engine.checkpoint.background``); the run uses this as
    a context manager, whose exit waits for the save in flight."""

    def __init__(
        self,
        cfg,
        *,
        model: nn.Module,
        optimizer: DataParallel,
        ps: ParallelState,
        say: Callable[..., None],
    ) -> None:
        self.cfg, self.model, self.optimizer, self.ps, self.say = cfg, model, optimizer, ps, say
        self.directory = checkpoint_dir(cfg)
        self.saved_step = 0  # the step of the newest checkpoint saved or resumed
        # Recorded in every checkpoint (path and SHA-256) so that generation and evaluation
        # find the tokenizer and notice if the file there is replaced.
        self.tokenizer = tokenizer_record(cfg.data.tokenizer) if ps.rank == 0 else None
        self.background, self._group, self._buffers = None, None, {}
        if getattr(cfg.checkpoint, "async_save", False):
            self.background = BackgroundSaver(log=lambda msg: self.say(msg, markup=False))
            self._group = side_group(ps.world_size)  # the writer's agreements' own group

    def save(self, step: int, *, data: dict, loss_scaler: dict | None) -> None:
        """A resumable checkpoint of ``step``, pruned to ``checkpoint.keep``. Beside the
        tensors, what a bitwise resume needs: the data loader's and loss scaler's states
        (RNG states go with each rank), the config and the tokenizer record."""
        start = time.perf_counter()
        # One save in flight (and one host copy of the state): the previous one first.
        self.wait()
        waited = time.perf_counter() - start
        state = {
            "data": data,
            "loss_scaler": loss_scaler,
            "config": asdict(self.cfg),
            "tokenizer": self.tokenizer,
        }
        biases = self.router_biases()
        if biases:  # moved by training, not by gradients: they are not model tensors
            state["router_bias"] = biases
        stage = stage_checkpoint(
            self.directory,
            step,
            model=self.model,
            optimizer=self.optimizer,
            ps=self.ps,
            state=state,
            keep=self.cfg.checkpoint.keep,
            copy=self.background is not None,
            group=self._group,
            buffers=self._buffers,
        )
        if self.background is None:
            path = stage(lambda msg: self.say(msg, markup=False))
            self.saved_step = step
            self.say(f"saved checkpoint {path} in {time.perf_counter() - start:.2f} s")
            return
        self.background.submit(step, stage)
        self.saved_step = step
        self._staged = (time.perf_counter() - start - waited, waited)

    def router_biases(self) -> dict[str, list[float]]:
        """The whole model's sigmoid router biases by router name ({} for none), gathered
        over the pipeline stages: every rank calls this together."""
        cfg = self.model.cfg
        if getattr(cfg, "mlp", None) != "moe" or getattr(cfg, "moe_router", None) != "sigmoid":
            return {}
        mine = router_biases(self.model)
        if self.ps.size("pp") == 1:
            return mine
        parts = comm.all_gather_object(mine, self.ps.group("pp"))
        return {name: value for part in parts for name, value in part.items()}

    def wait(self) -> None:
        """Wait for the background save in flight, if any, and say it was saved; raises
        CheckpointError (on every rank) if it failed."""
        if self.background is None or not self.background.in_flight:
            return
        path, seconds = self.background.wait()
        staged, waited = self._staged
        self.say(
            f"saved checkpoint {path} in the background ({seconds:.2f} s writing; training "
            f"paused {staged:.2f} s to stage it"
            + (f", {waited:.2f} s for the save before it)" if waited >= 0.005 else ")")
        )

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is None:  # a failing run does not wait: an unfinished save is never loaded
            self.wait()

    def load(self) -> tuple[Loaded, str] | None:
        """The newest usable checkpoint loaded into the model and optimizer (resharded if
        the layout changed), and the line that says so; None when there is none. Where the
        saved RNG states do not fit this mesh, the streams are reseeded from its step."""
        start = time.perf_counter()
        loaded = load_checkpoint(
            self.directory, model=self.model, optimizer=self.optimizer, ps=self.ps, log=self.say
        )
        if loaded is None:
            return None
        self.saved_step = loaded.step
        note = reshard_note(loaded.layout, self.ps)
        if not loaded.rng_restored:  # other ranks, other streams: fresh ones from this step
            self.ps.seed(self.cfg.trainer.seed + loaded.step)
            note += ", RNG reseeded"
        line = (
            f"resuming from step {loaded.step} ({loaded.path}{note}, "
            f"loaded in {time.perf_counter() - start:.2f} s)"
        )
        return loaded, line

    def export(self) -> str:
        """The model's weights alone (for inference and conversion) in ``<dir>/final``."""
        self.wait()  # the last resumable save's line comes first, in the run log too
        directory = os.path.join(self.directory, "final")
        biases = self.router_biases()
        biases = {n + BIAS_KEY: torch.tensor(v, dtype=torch.float32) for n, v in biases.items()}
        save_model(self.model, directory, tokenizer=self.cfg.data.tokenizer, more=biases)
        self.say(f"saved the final model to {directory}")
        return directory
