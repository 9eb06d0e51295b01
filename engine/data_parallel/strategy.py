"""One strategy object per data-parallel mode, chosen once by :func:`build_data_parallel`.

Both present the interface the trainer and the checkpoint code use, so neither asks
which one it holds:

- :class:`AllReduceDP` — bucketed gradient all-reduces overlapping backward (GradSync),
  then the plain optimizer on every replica;
- :class:`Zero1DP` — ZeRO-1: bucketed reduce-scatters overlapping backward, the optimizer
  on this rank's 1/dp slice, bucketed all-gathers overlapping the next forward.

A step::

    for i, micro in enumerate(micro_batches):
        with dp.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss(micro).backward()
    grads = dp.finish_grads()   # tensors whose .grad the step uses (loss scaling)
    norm = dp.grad_norm()
    dp.step(lr=lr, max_norm=clip, norm=norm)   # or skip it (a bad step)
    dp.zero_grad()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.config import OptimConfig
from engine.data_parallel.grad_sync import GradSync
from engine.data_parallel.grads import clip_grads_, global_grad_norm
from engine.data_parallel.zero import MASTER_KEY, ZeroOptimizer
from engine.optim import build_optimizer, set_lr

GROUP_STEP = "group_step"  # scalar key of a parameter group's step count (apex FusedAdam)


class DataParallel(ABC):
    """Gradient reduction, the optimizer step and its checkpoint state for one DP mode."""

    shards_optimizer: bool  # recorded in checkpoints ("zero1"); never branched on
    params: list[nn.Parameter]  # the model's trainable parameters

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
        """Bytes of optimizer state (and master weights) this rank holds."""


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


class AllReduceDP(DataParallel):
    """Bucketed gradient all-reduce (GradSync) and the plain optimizer on every replica."""

    shards_optimizer = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
    ) -> None:
        self.optimizer, self.tp_group = optimizer, tp_group
        self._state = PlainOptimizerState(optimizer)
        self.grad_sync = GradSync(
            model.parameters(),
            dp_group=dp_group,
            tp_group=tp_group,
            bucket_size_mb=bucket_size_mb,
            overlap=overlap,
        )
        self.params = self.grad_sync.params

    def no_sync(self) -> ContextManager[None]:
        return self.grad_sync.no_sync()

    def finish_grads(self) -> list[torch.Tensor]:
        self.grad_sync.finish()
        return self.params

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self.params, self.tp_group)

    def step(self, *, lr: float, max_norm: float, norm: torch.Tensor) -> None:
        clip_grads_(self.params, max_norm, norm)
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        return self._state.param_states()

    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        self._state.load_param_states(states)

    def set_comm_timer(self, timer: Any | None) -> None:
        self.grad_sync.comm_timer = timer

    def state_bytes(self) -> int:
        tensors = [v for st in self.optimizer.state.values() for v in st.values()]
        return sum(t.nbytes for t in tensors if torch.is_tensor(t) and t.dim() > 0)


class Zero1DP(DataParallel):
    """ZeRO-1 (``engine.data_parallel.zero``): sharded master weights and Adam state."""

    shards_optimizer = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.zero = self.optimizer = ZeroOptimizer(
            optimizer,
            dp_group=dp_group,
            tp_group=tp_group,
            bucket_size_mb=bucket_size_mb,
            param_dtype=param_dtype,
            overlap=overlap,
            registration_order=list(model.parameters()),
        )
        if overlap:
            self.zero.overlap_param_gather(model)
        self.params = self.zero.params

    def no_sync(self) -> ContextManager[None]:
        return self.zero.no_sync()

    def finish_grads(self) -> list[torch.Tensor]:
        self.zero.finish_grads()
        return self.zero.master_params

    def grad_norm(self) -> torch.Tensor:
        return self.zero.grad_norm()

    def step(self, *, lr: float, max_norm: float, norm: torch.Tensor) -> None:
        clip_grads_(self.zero.master_params, max_norm, norm)
        set_lr(self.zero, lr)
        self.zero.step()

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def wait_params(self) -> None:
        self.zero.wait_params()

    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        return self.zero.param_states()

    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        self.zero.load_param_states(states)

    def set_comm_timer(self, timer: Any | None) -> None:
        self.zero.comm_timer = timer

    def state_bytes(self) -> int:
        return self.zero.state_bytes()


def build_data_parallel(
    model: nn.Module,
    optim: OptimConfig,
    *,
    dp_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None,
    device: torch.device,
    bucket_size_mb: float = 25.0,
    overlap: bool = True,
    low_precision: torch.dtype | None = None,
) -> DataParallel:
    """The strategy ``optim.distributed`` selects, with its optimizer, for ``model``.

    ``low_precision`` (bf16 training): ZeRO-1 then stores the parameters in that dtype
    beside its fp32 master slices; the all-reduce path keeps fp32 parameters (they are its
    masters). The one place that looks at the mode.
    """
    optimizer = build_optimizer(model, optim, device)
    common = {
        "dp_group": dp_group,
        "tp_group": tp_group,
        "bucket_size_mb": bucket_size_mb,
        "overlap": overlap,
    }
    if optim.distributed:
        return Zero1DP(model, optimizer, param_dtype=low_precision, **common)
    return AllReduceDP(model, optimizer, **common)


def checkpoint_view(optimizer: DataParallel | torch.optim.Optimizer | None):
    """What checkpoints read and write: a strategy as it is, a bare torch optimizer (tools,
    tests) as every replica's full state; None stays None."""
    if optimizer is None or isinstance(optimizer, DataParallel):
        return optimizer
    return PlainOptimizerState(optimizer)
