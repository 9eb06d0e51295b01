"""The target's data-parallel step in the layout verifier, through the DP mode its spec
names: the verifier's own bucketed all-reduce (GradSync) and torch's AdamW for ``none``,
else the runtime's strategy (ZeRO-1, FSDP2's ZeRO-2/3) with clipping off. Both the plain
and the pipelined comparisons train the target through it."""

from __future__ import annotations

import torch

from engine.config import OptimConfig
from engine.data_parallel import GradSync, build_data_parallel
from engine.data_parallel.interface import grad_part

ADAMW_DEFAULTS = ((0.9, 0.999), 1e-8)  # torch's AdamW betas and eps, the reference's


class TargetStep:
    """The target's gradient reduction and AdamW step (torch's AdamW without weight decay,
    as the reference's) through the DP mode ``spec.dp_shard`` names: GradSync's all-reduce
    for none, else the runtime's strategy (ZeRO-1, FSDP2) with clipping off."""

    def __init__(self, spec, target, ps) -> None:
        self.lr, self.sync = spec.lr, None
        if spec.dp_shard == "none":
            self.sync = GradSync(  # experts split over ep reduce over their own group
                target.parameters(),
                grad_group=ps.group("grad"),
                tp_group=ps.tp_group,
                expert_grad_group=ps.group("expert_grad"),
            )
            self.optimizer = torch.optim.AdamW(target.parameters(), lr=spec.lr, weight_decay=0.0)
            return
        betas, eps = ADAMW_DEFAULTS
        self.optimizer = build_data_parallel(
            target,
            OptimConfig(
                lr=spec.lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=0.0, clip_grad=0
            ),
            grad_group=ps.group("grad"),
            tp_group=ps.tp_group,
            device=ps.device,
            dp_shard=spec.dp_shard,
            expert_groups=(ps.group("expert"), ps.group("expert_grad")),
            offload=spec.offload,
            hybrid_groups=(
                (ps.group("fsdp_shard"), ps.group("fsdp_replicate"))
                if spec.dp_replicate > 1
                else (None, None)
            ),
        )

    def no_sync(self):
        """Accumulate this micro-batch's gradients (the strategy's own rule under a mode)."""
        return self.sync.no_sync() if self.sync is not None else self.optimizer.no_sync()

    def finish_grads(self) -> None:
        if self.sync is not None:
            self.sync.finish()
        else:
            self.optimizer.finish_grads()

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's part of ``param``'s reduced gradient (``DataParallel.reduced_grad``)."""
        return grad_part(param) if self.sync is not None else self.optimizer.reduced_grad(param)

    def step(self) -> None:
        if self.sync is not None:
            self.optimizer.step()
        else:
            self.optimizer.step(lr=self.lr, max_norm=0.0, norm=torch.zeros(()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad()

    def remove(self) -> None:
        if self.sync is not None:
            self.sync.remove()
