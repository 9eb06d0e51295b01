"""ZeRO-2 and ZeRO-3 through PyTorch's FSDP2 (``fully_shard``) on each TP rank's DP group.

Every transformer layer is one FSDP unit and the model itself (embeddings, final norm,
head) the root unit, all on a one-axis device mesh made from this rank's DP group: TP
stays the runtime's own (plain TP-local tensors to FSDP), so FSDP shards each TP rank's
slices across the DP ranks that hold the same slices.

- ``dp_shard=full`` (ZeRO-3): parameters are gathered per unit for forward, freed after
  it, and gathered again for backward (``reshard_after_forward=True``);
- ``dp_shard=gradients`` (ZeRO-2): gathered once per step and kept through every
  micro-batch's forward and backward (``reshard_after_forward=False``, and no resharding
  after backward until the step's last micro-batch).

Under both, every micro-batch reduce-scatters its gradients into the 1/dp shard, so
gradient accumulation never holds whole gradients.

Hybrid sharding (HSDP, ``parallel.dp_replicate=R`` > 1) puts the DP ranks on a two-axis
mesh instead, (replicate, shard) = (R, dp ÷ R), from the mesh's ``fsdp_replicate`` and
``fsdp_shard`` roles: torch's own HSDP. Parameters, gradients and Adam's state are then
sharded 1/(dp ÷ R) over the ranks of one replica and replicated across the R replicas;
each reduce-scatter within a replica is followed by an all-reduce of the shard across
the replicas, so every rank ends with the DP mean of its shard's gradient, as at R 1.

Experts split over ep ranks (``layers.param_roles.expert_split``) are FSDP units of their
own (each MoE layer's ``GroupedExperts``), sharded over the ``expert_grad`` group, the
dp ÷ ep ranks holding the same experts, and left out of their layer's unit; their
gradient, averaged there, is divided by ep more (``finish_grads``). Hybrid sharding does
not yet take them.

Between steps a rank holds 1/dp of the fp32 parameters (FSDP's sharded parameters are the
master weights), of their gradients (reduce-scattered, averaged over DP) and of Adam's
moments. In bf16 the gathers carry bf16 copies (``MixedPrecisionPolicy``) and gradients are
reduced in fp32. Each layer prefetches the next one's gather in forward and the previous
one's in backward, so gathers can overlap compute where the backend runs collectives
asynchronously (NCCL; gloo on CPU runs them in line).

``parallel.offload=optimizer`` hands FSDP torch's ``CPUOffloadPolicy``: the sharded
parameters and their gradients live in host memory (pinned where CUDA is), each unit is
copied to the device for its gather, and AdamW steps the host shards, so under FSDP the
offload covers parameters and gradients as well as the optimizer state.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from engine.config import OptimConfig
from engine.data_parallel.grads import scale_grads_
from engine.data_parallel.interface import DataParallel, PlainOptimizerState
from engine.optim import build_optimizer, set_lr
from layers.param_roles import counted_in_norm, expert_split, has_sp_partial_grad
from layers.utils import dp_sharded, group_rank, group_size, local_part, tp_local
from parallel_state.groups import collective_device


class FullyShardedDP(DataParallel):
    """FSDP2 per transformer layer on the DP group (ZeRO-2 or ZeRO-3), torch's AdamW on
    the sharded parameters."""

    shards_optimizer = True  # the moments are DP shards: checkpoints never read into them
    times_comm = False  # its collectives run inside its own hooks (set_comm_timer)

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        *,
        dp_group: dist.ProcessGroup,
        tp_group: dist.ProcessGroup | None,
        device: torch.device,
        reshard_after_forward: bool,
        low_precision: torch.dtype | None = None,
        hybrid_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
        expert_grad_group: dist.ProcessGroup | None = None,
        offload: bool = False,
    ) -> None:
        self.model, self.dp_group, self.tp_group = model, dp_group, tp_group
        self.device, self.offload = device, offload
        self.reshard_after_forward = reshard_after_forward
        # Where a gradient shard's squares are summed for the norm: the ranks that hold
        # distinct shards (the DP group, or under HSDP one replica's ranks).
        self.shard_group = dp_group
        if group_size(hybrid_groups[1]) > 1:
            self.mesh = _hybrid_mesh(dp_group, *hybrid_groups, device.type)
            self.shard_group = hybrid_groups[0]
        else:
            self.mesh = DeviceMesh.from_group(dp_group, device.type)
        policy = MixedPrecisionPolicy(
            param_dtype=low_precision, reduce_dtype=torch.float32 if low_precision else None
        )
        # offload: torch keeps the sharded parameters, their gradients and so AdamW's state
        # and step on the host (pinned for DMA where CUDA is), gathering to the device.
        cpu_pinned = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        offload_policy = cpu_pinned if offload else OffloadPolicy()
        # The models return views (a transposed loss or logits); nothing of ours writes into
        # them in place, which is what FSDP warns about on every forward.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        roles = {name: dict(vars(p)) for name, p in model.named_parameters()}
        # A pipelined model's roots are its stage chunks (each one a PipelineStage's module,
        # which torch's schedule then drives as FSDP); else the model itself.
        self.roots = list(getattr(model, "chunks", None) or [model])
        self.pipelined = self.roots != [model]
        shard = dict(
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload_policy,
        )
        _shard_split_experts(model, expert_grad_group, device.type, shard)
        for root in self.roots:
            units = list(root.layers)
            for unit in [*units, root]:
                fully_shard(unit, mesh=self.mesh, **shard)
            for earlier, later in zip(units, units[1:], strict=False):
                earlier.set_modules_to_forward_prefetch([later])
                later.set_modules_to_backward_prefetch([earlier])
        # FSDP registers new (sharded) parameters: they keep the roles the layers declared.
        for name, p in model.named_parameters():
            vars(p).update(roles[name])
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.split_experts = [p for p in self.params if expert_split(p) > 1]
        # Offloaded, the sharded parameters are host tensors: so is AdamW's state.
        self.optimizer = build_optimizer(model, optim, torch.device("cpu") if offload else device)

    @contextmanager
    def no_sync(self):
        """Every micro-batch reduce-scatters its gradients (they stay 1/dp: holding whole
        ones across micro-batches would undo the sharding a large model needs). ZeRO-2 keeps
        its parameters gathered from one micro-batch to the next, so it gathers once per
        step; ZeRO-3 gathers them again in every forward and backward.

        Under a pipeline torch's schedule drives each stage's FSDP itself: it keeps the
        parameters and the unsharded gradients over the step's micro-batches and
        reduce-scatters after the last (``PipelineStage``'s own rule), so nothing is left
        to do here."""
        if self.reshard_after_forward or self.pipelined:
            yield
            return
        self.model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.model.set_reshard_after_backward(True)

    def finish_grads(self) -> list[torch.Tensor]:
        """FSDP has reduce-scattered by the end of backward; sum the sequence-parallel
        partial gradients over TP (each TP rank holds the same DP shard of them).

        An expert split over ep came averaged over its dp ÷ ep holders, but its gradient
        already summed the tokens of the ep ranks (the all-to-all's backward): ÷ ep makes
        it the mean over all dp ranks' tokens, as the dense ones are. (Done here, not by
        FSDP's divide factor, which torch 2.13 applies twice on a group of one rank: half
        the gradient at dp 2 × ep 2 in fp64.)"""
        for p in self.split_experts:
            if p.grad is not None:
                local_part(p.grad).div_(expert_split(p))
        if group_size(self.tp_group) > 1:
            for p in self.params:
                if p.grad is not None and has_sp_partial_grad(p):
                    grad = local_part(p.grad)  # offloaded: on the host, reduced on the device
                    on_device = grad.to(self.device)
                    dist.all_reduce(on_device, group=self.tp_group)
                    grad.copy_(on_device)
        return self.params

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole model's gradient: this rank's shards squared and summed
        over DP (under HSDP over one replica's shard group: the other replicas hold the
        same shards), then over TP (replicated parameters counted on TP rank 0 only).
        Experts split over ep are counted once by the same DP sum: the ranks of one ep
        index hold disjoint shards of its experts, the ep indices disjoint experts."""
        tp_rank = group_rank(self.tp_group)
        total = torch.zeros((), dtype=torch.float64, device=collective_device(self.dp_group))
        for p in self.params:
            if p.grad is not None and counted_in_norm(p, tp_rank):
                g = local_part(p.grad)
                wide = g.to(torch.promote_types(g.dtype, torch.float32))
                total += wide.pow(2).sum().double().to(total.device)
        for group in (self.shard_group, self.tp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def step(self, *, lr: float, max_norm: float, norm: torch.Tensor) -> None:
        grads = [local_part(p.grad) for p in self.params if p.grad is not None]
        scale_grads_(grads, max_norm, norm)
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def wait_params(self) -> None:
        """Nothing is in flight between steps."""

    def param_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Adam's state per parameter at TP-local shapes (gathered over DP: collective)."""
        states = PlainOptimizerState(self.optimizer).param_states()
        # Offloaded shards are host tensors: gathered where the DP group's collectives run.
        return {
            p: {
                k: tp_local(v.to(self.device)) if torch.is_tensor(v) and dp_sharded(v) else v
                for k, v in st.items()
            }
            for p, st in states.items()
        }

    def load_param_states(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Install TP-local state saved at any layout: each rank keeps its DP shard."""
        sharded = {
            p: {k: _shard_like(p, v) if _whole_of(p, v) else v for k, v in st.items()}
            for p, st in states.items()
        }
        PlainOptimizerState(self.optimizer).load_param_states(sharded)

    def set_comm_timer(self, timer: Any | None) -> None:
        """FSDP runs its collectives inside its own hooks: they count as forward/backward
        time, not as the step timer's DP communication."""

    def state_bytes(self) -> int:
        return 0 if self.offload else self._optimizer_bytes()

    def host_state_bytes(self) -> int:
        """Offloaded: Adam's moments (FSDP's host parameter and gradient shards besides)."""
        return self._optimizer_bytes() if self.offload else 0

    def _optimizer_bytes(self) -> int:
        tensors = [local_part(v) for st in self.optimizer.state.values() for v in st.values()]
        return sum(t.nbytes for t in tensors if torch.is_tensor(t) and t.dim() > 0)


def _shard_split_experts(
    model: nn.Module,
    expert_grad_group: dist.ProcessGroup | None,
    device_type: str,
    shard: dict[str, Any],
) -> None:
    """Make each module holding experts split over ep an FSDP unit of its own, sharded
    over ``expert_grad_group`` (the dp ÷ ep ranks holding the same experts; its layer's
    unit then leaves them out). FSDP averages their gradient over that group only:
    ``FullyShardedDP.finish_grads`` divides it by ep more."""
    owners = [
        m for m in model.modules() if any(expert_split(p) > 1 for p in m.parameters(recurse=False))
    ]
    if not owners:
        return
    if expert_grad_group is None:
        raise ValueError(
            "experts split over ep ranks shard over the expert_grad group: pass "
            "expert_grad_group=ps.group('expert_grad')"
        )
    mesh = DeviceMesh.from_group(expert_grad_group, device_type)
    for module in owners:
        fully_shard(module, mesh=mesh, **shard)


def _hybrid_mesh(
    dp_group: dist.ProcessGroup,
    shard_group: dist.ProcessGroup,
    replicate_group: dist.ProcessGroup,
    device_type: str,
) -> DeviceMesh:
    """The (replicate, shard) mesh of the DP group's ranks, made from the mesh's existing
    hybrid groups (no new groups): row i the ranks of replica i, in rank order, as
    ``ParallelDims`` cuts them (``HYBRID_ROLES``)."""
    ranks = sorted(dist.get_process_group_ranks(dp_group))
    grid = torch.tensor(ranks).view(group_size(replicate_group), group_size(shard_group))
    me = dist.get_rank()
    row = next(r for r in grid.tolist() if me in r)
    column = [r[row.index(me)] for r in grid.tolist()]
    if row != sorted(dist.get_process_group_ranks(shard_group)) or column != sorted(
        dist.get_process_group_ranks(replicate_group)
    ):
        raise ValueError(
            f"the hybrid groups of rank {me} ({row}, {column}) do not cut its DP group "
            f"{ranks} into replicas of neighbouring ranks"
        )
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=grid,
        mesh_dim_names=("replicate", "shard"),
    )


def _whole_of(param: torch.Tensor, value: Any) -> bool:
    """Whether ``value`` is a TP-local tensor of ``param``'s shape (moments, a master)."""
    return torch.is_tensor(value) and not dp_sharded(value) and value.shape == param.shape


def _shard_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``'s DP shard as a DTensor placed as ``param`` is (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(device=param.device, dtype=param.dtype),
        param.device_mesh,
        param.placements,
        src_data_rank=None,
    )
