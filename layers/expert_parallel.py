"""Expert parallelism: every collective of it, the token-row all-to-all and its plan.

The ``expert`` group's ep ranks each hold ``E / ep`` whole experts (rank r: experts
r·E/ep … (r+1)·E/ep − 1, a dim-0 slice of ``GroupedExperts``' weights). A MoE layer routes
its own tokens first (``layers.router``: the choices, ties and capacity drops of this
rank's tokens, as at ep 1), groups the kept token-slots by expert (``layers.moe.permute``)
and then:

1. ``dispatch``: the per-expert counts go to every ep rank (an equal-split all-to-all of
   ``[ep, E/ep]`` counts, no gradient), then the rows themselves (an uneven-split
   all-to-all: rank r's rows for rank s's experts go to s). A rank receives its experts'
   rows source by source; they are regrouped by local expert, each expert's rows in
   source-rank order, each source's in its token order;
2. the local experts compute (a grouped GEMM over ``E / ep`` experts);
3. ``combine``: the rows are put back in source order and returned by the reverse
   all-to-all, so each rank gets its own slots' outputs in the order it sent them.

Autograd Function (``_AllToAll``; the wrapper ``all_to_all`` returns its input when the
group has one rank): forward all-to-all with splits (send, receive), backward the
all-to-all with the splits swapped: the gradient of a received row goes back to the rank
that sent it. Per layer and step: 2 row all-to-alls forward, 2 backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel_state.groups import collective_device, group_size

__all__ = ["DispatchPlan", "all_to_all", "combine", "dispatch", "expert_range"]


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """``(first, end)``: the experts ep rank ``ep_rank`` of ``ep_size`` holds."""
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


class _AllToAll(torch.autograd.Function):
    """all-to-all forward (rows ``send[i]`` to rank i, ``recv[i]`` from it), the same with
    the splits swapped backward."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``rows`` ``[sum(send), ...]`` → ``[sum(recv), ...]`` over ``group``, on the group's
    collective device and back."""
    device = collective_device(group)
    out = rows.new_empty((sum(recv), *rows.shape[1:]), device=device)
    dist.all_to_all_single(
        out,
        rows.contiguous().to(device),
        output_split_sizes=recv,
        input_split_sizes=send,
        group=group,
    )
    return out.to(rows.device)


def all_to_all(
    rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``rows`` split ``send`` (one count per rank of ``group``, in rank order) sent out,
    ``recv`` rows received from each; differentiable (module docstring). ``rows`` itself
    when the group has one rank."""
    if group_size(group) == 1:
        return rows
    return _AllToAll.apply(rows, send, recv, group)


@dataclass
class DispatchPlan:
    """How ``dispatch`` moved one layer's rows, for ``combine`` to move them back."""

    send: list[int]  # rows this rank sent to each ep rank
    recv: list[int]  # rows it received from each
    regroup: torch.Tensor  # [m]: received row of each local-expert-ordered row
    group: dist.ProcessGroup | None


def dispatch(
    rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """This rank's ``rows`` ``[n, h]``, grouped by expert with ``counts[e]`` (``[E]``) rows
    for expert e, to the ep ranks holding their experts: (the rows of this rank's experts
    ``[m, h]`` grouped by local expert, their counts ``[E / ep]``, the plan for
    ``combine``). One host sync: the splits are data."""
    ep = group_size(group)
    if ep == 1:
        return rows, counts, DispatchPlan([len(rows)], [len(rows)], None, group)
    per_rank = counts.view(ep, -1)  # [ep, E/ep]: rows for each rank's experts
    received = _exchange(per_rank, [1] * ep, [1] * ep, group)  # [ep, E/ep] from each source
    send, recv = per_rank.sum(1).tolist(), received.sum(1).tolist()
    arrived = all_to_all(rows, send, recv, group)  # by source, each by local expert
    local = torch.arange(per_rank.shape[1], device=rows.device).repeat(ep)
    expert_of_row = local.repeat_interleave(received.reshape(-1).to(rows.device))
    regroup = torch.argsort(expert_of_row, stable=True)  # by local expert, then source
    plan = DispatchPlan(send, recv, regroup, group)
    return arrived[regroup], received.sum(0).to(counts.device), plan


def combine(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """The inverse of ``dispatch``: the local experts' output rows ``[m, h]`` back to the
    ranks (and the order) they came from → ``[n, h]``."""
    if plan.regroup is None:
        return rows
    by_source = torch.empty_like(rows).index_copy(0, plan.regroup, rows)
    return all_to_all(by_source, plan.recv, plan.send, plan.group)
