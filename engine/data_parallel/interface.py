"""The interface every data-parallel strategy presents to the trainer and the checkpoint
code (:class:`DataParallel`), and the checkpoint view of a torch optimizer that every
replica runs in full (:class:`PlainOptimizerState`), which the all-reduce and FSDP
strategies share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

from engine.data_parallel.zero import MASTER_KEY
from layers.utils import local_part

GROUP_STEP = "group_step"  # scalar key of a parameter group's step count (apex FusedAdam)
MUON_KEY = "momentum_buffer"  # Muon's state (engine/muon.py), which AdamW must not load


class DataParallel(ABC):
    """Gradient reduction, the optimizer step and its checkpoint state for one DP mode."""

    shards_optimizer: bool  # recorded in checkpoints ("zero1"); never branched on
    params: list[nn.Parameter]  # the model's trainable parameters
    # Whether the step timer's DP clock (set_comm_timer) sees this mode's collectives;
    # False: they run out of its sight, and it reports no DP total rather than 0.
    times_comm: bool = True

    @abstractmethod
    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients locally (every micro-batch but the last)."""

    @abstractmethod
    def finish_grads(self) -> list[torch.Tensor]:
        """Wait for the DP reduction; return the tensors whose ``.grad`` the step uses."""

    @abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's averaged gradient, the same on every rank."""

    @abstractmethod
    def step(self, *, lr: float, max_norm: float, norm: torch.Tensor) -> None:
        """Clip to ``max_norm`` (given the global ``norm``), set ``lr`` and update."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop this step's gradients."""

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's part of ``param``'s DP-reduced gradient, after ``finish_grads``,
        which a caller may sum in place with the other holders of a tied tensor."""
        return grad_part(param)

    def wait_params(self) -> None:  # noqa: B027 - nothing is in flight unless overridden
        """Block until the parameters hold the last step's values (before reading them
        outside a forward pass, e.g. to save them)."""

    @abstractmethod
    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Per-parameter optimizer state at TP-local shapes (collective under ZeRO-1)."""

    @abstractmethod
    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Install :meth:`param_states`' output, saved at any layout."""

    @abstractmethod
    def set_comm_timer(self, timer: Any | None) -> None:
        """Hand the step timer's DP clock to whoever runs the DP collectives."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state (and master weights) this rank holds on its device."""

    def host_state_bytes(self) -> int:
        """Bytes of it offloaded to host memory (``parallel.offload=optimizer``)."""
        return 0


def grad_part(param: nn.Parameter) -> torch.Tensor:
    """``param``'s ``.grad`` as this rank stores it (FSDP: the local shard), zeros where no
    gradient reached it: the reduced gradient of every mode that keeps ``.grad``."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_part(param.grad)


class PlainOptimizerState:
    """The checkpoint view of a torch optimizer that every replica runs in full."""

    shards_optimizer = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def wait_params(self) -> None:
        """Nothing is in flight."""

    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        """torch's ``optimizer.state`` per parameter, plus apex's per-group step count."""
        states = {
            p: dict(self.optimizer.state[p])
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p in self.optimizer.state
        }
        for group in self.optimizer.param_groups:
            if "step" in group:  # apex's FusedAdam counts steps per group, not per parameter
                for p in group["params"]:
                    states.setdefault(p, {})[GROUP_STEP] = float(group["step"])
        return states

    @torch.no_grad()
    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Install per-parameter state (TP-local tensors and scalars)."""
        opt = self.optimizer
        if type(opt) is torch.optim.AdamW and any(MUON_KEY in st for st in states.values()):
            raise ValueError(
                f"the saved optimizer state holds Muon's {MUON_KEY}s (a run with optim=muon): "
                "resume it with optim=muon"
            )
        full = opt.state_dict()  # torch casts and places the values as it would its own
        ordered = [p for g in opt.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(ordered)}
        full["state"] = {
            index[id(p)]: {k: v if torch.is_tensor(v) else torch.tensor(v) for k, v in st.items()}
            for p, st in states.items()
            if st
        }
        group_steps = {}
        for i, entry in full["state"].items():
            master = entry.pop(MASTER_KEY, None)
            if master is not None:  # saved from lower-precision parameters: the exact value
                ordered[i].copy_(master)
            if GROUP_STEP in entry:
                group_steps[i] = entry.pop(GROUP_STEP)
        opt.load_state_dict(full)
        offset = 0
        for group in opt.param_groups:  # groups that count steps themselves (apex)
            first = next(
                (
                    group_steps[j]
                    for j in range(offset, offset + len(group["params"]))
                    if j in group_steps
                ),
                None,
            )
            if "step" in group and first is not None:
                group["step"] = int(first.item() if torch.is_tensor(first) else first)
            offset += len(group["params"])
