"""One strategy object per data-parallel mode, chosen once by :func:`build_data_parallel`.

All present the interface the trainer and the checkpoint code use, so neither asks
which one it holds:

- :class:`AllReduceDP` — bucketed gradient all-reduces overlapping backward (GradSync),
  then the plain optimizer on every replica;
- :class:`Zero1DP` — ZeRO-1: bucketed reduce-scatters overlapping backward, the optimizer
  on this rank's 1/dp slice, bucketed all-gathers overlapping the next forward;
- :class:`FullyShardedDP` (``fsdp``) — ZeRO-2 and ZeRO-3 through FSDP2.

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

from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.config import OptimConfig
from engine.data_parallel.grad_sync import GradSync
from engine.data_parallel.grads import clip_grads_, global_grad_norm
from engine.data_parallel.interface import DataParallel, PlainOptimizerState
from engine.data_parallel.zero import ZeroOptimizer
from engine.optim import build_optimizer, compile_update, compiles_update, set_lr
from layers.param_roles import expert_split
from parallel_state.dims import resolve_dp_shard
from parallel_state.groups import group_size

# (ep group, expert_grad group): the mesh's "expert" and "expert_grad" roles; (None, None)
# where experts are not split (their gradients then reduce with the dense ones).
ExpertGroups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]
# (fsdp_shard group, fsdp_replicate group): the mesh's hybrid-sharding roles; (None, None)
# or a replicate group of one rank: plain FSDP over the whole gradient group.
HybridGroups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]


@dataclass(frozen=True)
class BucketedSync:
    """What the two bucketed strategies (AllReduceDP, Zero1DP) sync gradients over and how:
    one object, so ``build_data_parallel`` states it once for whichever it builds."""

    dp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    expert_groups: ExpertGroups = (None, None)
    bucket_size_mb: float = 25.0
    overlap: bool = True


class _DelegatingDP(DataParallel):
    """A strategy whose optimizer checkpoint state lives in one object (``_state``: the
    plain optimizer's view, or ZeRO-1's sharded optimizer) and whose DP collectives run in
    one object (``_comm``: GradSync, or the same ZeRO-1 optimizer); both kinds answer the
    same calls, so the strategies hand those calls on alike."""

    _state: PlainOptimizerState | ZeroOptimizer
    _comm: GradSync | ZeroOptimizer

    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        return self._state.param_states()

    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        self._state.load_param_states(states)

    def set_comm_timer(self, timer: Any | None) -> None:
        self._comm.comm_timer = timer


class AllReduceDP(_DelegatingDP):
    """Bucketed gradient all-reduce (GradSync) and the plain optimizer on every replica."""

    shards_optimizer = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: BucketedSync,
        *,
        compile_backend: str | None = None,
    ) -> None:
        self.optimizer, self.tp_group = optimizer, sync.tp_group
        self.ep_group, expert_grad_group = sync.expert_groups
        self._state = PlainOptimizerState(optimizer)
        self.grad_sync = GradSync(
            model.parameters(),
            grad_group=sync.dp_group,
            tp_group=sync.tp_group,
            expert_grad_group=expert_grad_group,
            bucket_size_mb=sync.bucket_size_mb,
            overlap=sync.overlap,
        )
        self._comm = self.grad_sync
        self.params = self.grad_sync.params
        self._update = self._clip_and_step
        if compile_backend is not None and compiles_update(optimizer):
            self._update = compile_update(self._clip_and_step, optimizer, compile_backend)

    def no_sync(self) -> ContextManager[None]:
        return self.grad_sync.no_sync()

    def finish_grads(self) -> list[torch.Tensor]:
        self.grad_sync.finish()
        return self.params

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self.params, self.tp_group, self.ep_group)

    def step(self, *, lr: float, max_norm: float, norm: torch.Tensor) -> None:
        set_lr(self.optimizer, lr)
        self._update(max_norm, norm)

    def _clip_and_step(self, max_norm: float, norm: torch.Tensor) -> None:
        clip_grads_(self.params, max_norm, norm)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        tensors = [v for st in self.optimizer.state.values() for v in st.values()]
        return sum(t.nbytes for t in tensors if torch.is_tensor(t) and t.dim() > 0)


class Zero1DP(_DelegatingDP):
    """ZeRO-1 (``engine.data_parallel.zero``): sharded master weights and Adam state."""

    shards_optimizer = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: BucketedSync,
        *,
        param_dtype: torch.dtype | None = None,
        offload: bool = False,
    ) -> None:
        self.zero = self.optimizer = ZeroOptimizer(
            optimizer,
            dp_group=sync.dp_group,
            tp_group=sync.tp_group,
            expert_grad_group=sync.expert_groups[1],
            bucket_size_mb=sync.bucket_size_mb,
            param_dtype=param_dtype,
            overlap=sync.overlap,
            registration_order=list(model.parameters()),
            offload=offload,
        )
        if sync.overlap:
            self.zero.overlap_param_gather(model)
        self._state = self._comm = self.zero
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

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        return self.zero.reduced_grad(param)

    def state_bytes(self) -> int:
        return self.zero.state_bytes()

    def host_state_bytes(self) -> int:
        return self.zero.host_state_bytes()


def build_data_parallel(
    model: nn.Module,
    optim: OptimConfig,
    *,
    grad_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None,
    device: torch.device,
    expert_groups: ExpertGroups = (None, None),
    bucket_size_mb: float = 25.0,
    overlap: bool = True,
    low_precision: torch.dtype | None = None,
    dp_shard: str | None = None,
    compile_backend: str | None = None,
    hybrid_groups: HybridGroups = (None, None),
    offload: str = "none",
) -> DataParallel:
    """The strategy of ``dp_shard`` (none, optimizer, gradients or full; by default
    ``optim.distributed``'s: optimizer or none), with its optimizer, for ``model``,
    reducing gradients (and sharding state) over ``grad_group``: the mesh's ``grad`` role;
    experts split over ep ranks over ``expert_groups``' (the ``expert`` and
    ``expert_grad`` roles) in every mode but hybrid sharding.

    ``low_precision`` (bf16 training): ZeRO-1 then stores the parameters in that dtype
    beside its fp32 master slices, FSDP gathers them in it; the all-reduce path keeps fp32
    parameters (they are its masters). The one place that looks at the mode.

    ``hybrid_groups`` (the ``fsdp_shard`` and ``fsdp_replicate`` roles): under FSDP with
    more than one replica, HSDP on their (replicate, shard) mesh; the other modes refuse
    them (``ParallelDims`` already does, at the config).

    ``compile_backend`` (``model.compile_backend`` when ``model.compile=true``): the
    all-reduce path compiles its clipping and optimizer step with it, where the optimizer
    is torch's unfused AdamW (``engine.optim.compile_update``); ZeRO-1 and FSDP step
    eagerly. None: every step eager.

    ``offload="optimizer"`` (``parallel.offload``): the sharded modes keep Adam's state
    and the fp32 masters in host memory and step them there (ZeRO-1 through
    ``engine.data_parallel.offload``, FSDP through torch's ``CPUOffloadPolicy``, which
    offloads the parameters and gradients too).
    """
    mode, dp_group = resolve_dp_shard(dp_shard or "none", optim.distributed), grad_group
    if optim.algorithm == "muon" and mode != "none":
        raise ValueError(
            f"optim=muon needs whole gradients on every DP rank; dp_shard={mode} shards "
            "them: use dp_shard=none"
        )
    if offload not in ("none", "optimizer") or (offload != "none" and mode == "none"):
        raise ValueError(
            f"parallel.offload={offload} with dp_shard={mode}: offload=optimizer needs a "
            "sharded mode (dp_shard=optimizer, gradients or full)"
        )
    hybrid = group_size(hybrid_groups[1]) > 1
    split = max((expert_split(p) for p in model.parameters()), default=1)
    if split > 1 and hybrid:
        raise ValueError(
            f"hybrid sharding does not yet replicate experts split over ep_size={split}: "
            "use one replica (dp_replicate=1) or ep_size=1"
        )
    if hybrid and mode not in ("gradients", "full"):
        raise ValueError(
            f"hybrid sharding replicates FSDP's shards, and dp_shard={mode} is not FSDP: "
            "use dp_shard=full (or gradients), or one replica"
        )
    if mode in ("gradients", "full"):
        # imported here: torch's FSDP2 takes ~1 s of CPU to import, which every process
        # that only all-reduces (the classifier, DP none or optimizer) would pay
        from engine.data_parallel.fsdp import FullyShardedDP

        return FullyShardedDP(
            model,
            optim,
            dp_group=dp_group,
            tp_group=tp_group,
            device=device,
            reshard_after_forward=mode == "full",
            low_precision=low_precision,
            hybrid_groups=hybrid_groups,
            expert_grad_group=expert_groups[1],
            offload=offload == "optimizer",
        )
    if mode not in ("none", "optimizer"):
        raise ValueError(f"dp_shard={mode!r} is not one of none, optimizer, gradients, full")
    optimizer = build_optimizer(model, optim, device, tp_group)
    sync = BucketedSync(dp_group, tp_group, expert_groups, bucket_size_mb, overlap)
    if mode == "optimizer":
        return Zero1DP(
            model, optimizer, sync, param_dtype=low_precision, offload=offload == "optimizer"
        )
    return AllReduceDP(model, optimizer, sync, compile_backend=compile_backend)


def checkpoint_view(optimizer: DataParallel | torch.optim.Optimizer | None):
    """What checkpoints read and write: a strategy as it is, a bare torch optimizer (tools,
    tests) as every replica's full state; None stays None."""
    if optimizer is None or isinstance(optimizer, DataParallel):
        return optimizer
    return PlainOptimizerState(optimizer)
