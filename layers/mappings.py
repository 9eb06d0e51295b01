"""Every tensor-parallel collective of the model, and the plain TP helpers built on them.

The conjugate operators: each is a private ``autograd.Function`` whose backward is the
conjugate of its forward, with a public wrapper that returns its input untouched when
the TP group has one rank.

=====================  ==========================  ==========================
wrapper                forward                     backward
=====================  ==========================  ==========================
copy_to_tp             identity                    all-reduce        (f)
reduce_from_tp         all-reduce                  identity          (g)
scatter_to_tp          split last dim              all-gather last dim
gather_from_tp         all-gather a dim (last)     split that dim
scatter_to_sequence    split sequence dim          all-gather sequence dim
gather_from_sequence   all-gather sequence dim     reduce-scatter sequence dim
reduce_scatter_to_seq  reduce-scatter sequence     all-gather sequence dim
=====================  ==========================  ==========================

Plain collectives (no autograd), for layers that write their own backward and for the
statistics of the vocab-parallel cross-entropy:

- ``all_gather_dim`` / ``reduce_scatter_dim``: along one tensor dim; the sequence-parallel
  operators above and the sequence-parallel column linear both call these, so a fault
  planted here reaches every sequence-parallel path;
- ``all_reduce_max_`` / ``all_reduce_sum_``: in place, for per-token statistics;
- ``start_input_grad_sum`` / ``finish_input_grad_sum``: f's backward all-reduce split in
  two, so that a linear layer can compute its weight gradient while it runs
  (``layers.linear.linear_after_copy``);
- ``gather_along`` / ``gather_full``: a TP-split tensor (or parameter) to its full shape,
  for checkpoints, verification and HF export.

``flat_all_gather`` / ``flat_reduce_scatter`` name torch's flat collectives across torch
versions, once, for the data-parallel code too.

Every collective takes an optional ``comm_timer`` / ``timer`` (see
``layers.utils.CommTimer``): the trainer's step timer, handed down explicitly by the
modules that own a TP group, so a scaling study can split a step into compute and TP
communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.param_roles import tp_dim
from layers.utils import CommTimer, divide, timed
from parallel_state.groups import group_rank, group_size, resolve_tp_group

# torch 2.13 renamed the flat collectives; keep older torch working too.
flat_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
flat_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup, timer: CommTimer | None = None
) -> torch.Tensor:
    # Reduce into a fresh tensor: autograd may hand the same gradient tensor to several
    # branches, and callers may reuse what they passed in.
    out = x.clone(memory_format=torch.contiguous_format)
    timed(timer, dist.all_reduce, out, group=group)
    return out


def start_input_grad_sum(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Start f's backward: sum ``grad`` over ``group`` into a fresh tensor, without waiting.

    Returns the pending sum (torch's functional all-reduce: in eager the collective runs
    on the backend's own thread or stream; in a compiled graph the wait is a node of its
    own), which ``finish_input_grad_sum`` completes. Work done in between overlaps the
    collective. Every f's backward goes through this pair, so a fault planted here reaches
    them all.
    """
    return torch.ops._c10d_functional.all_reduce(grad.contiguous(), "sum", group.group_name)


def finish_input_grad_sum(pending: torch.Tensor, timer: CommTimer | None = None) -> torch.Tensor:
    """Wait for ``start_input_grad_sum``'s collective; the timer sees only this wait (the
    communication left exposed)."""
    return timed(timer, torch.ops._c10d_functional.wait_tensor, pending)


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    block = divide(x.shape[dim], world, f"size of dim {dim} of a {tuple(x.shape)} tensor")
    return x.narrow(dim, group_rank(group) * block, block).contiguous()


def all_gather_dim(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, timer: CommTimer | None = None
) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order (no autograd)."""
    # The flat collective concatenates along dim 0, so gather with ``dim`` moved to the front.
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * group_size(group), *front.shape[1:]))
    timed(timer, flat_all_gather, out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, timer: CommTimer | None = None
) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum of every rank's ``x`` (no autograd)."""
    front = x.movedim(dim, 0).contiguous()
    rows = divide(
        front.shape[0], group_size(group), f"size of dim {dim} of a {tuple(x.shape)} tensor"
    )
    out = front.new_empty((rows, *front.shape[1:]))
    timed(timer, flat_reduce_scatter, out, front, group=group)
    return out.movedim(0, dim)


def all_reduce_max_(
    x: torch.Tensor, group: dist.ProcessGroup | None, timer: CommTimer | None = None
) -> torch.Tensor:
    """Element-wise max of ``x`` over ``group``, in place (no autograd); returns ``x``."""
    if group_size(group) > 1:
        timed(timer, dist.all_reduce, x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_reduce_sum_(
    x: torch.Tensor, group: dist.ProcessGroup | None, timer: CommTimer | None = None
) -> torch.Tensor:
    """Element-wise sum of ``x`` over ``group``, in place (no autograd); returns ``x``."""
    if group_size(group) > 1:
        timed(timer, dist.all_reduce, x, group=group)
    return x


def gather_along(
    tensor: torch.Tensor, dim: int | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (no autograd); a copy if dim is None."""
    if dim is None or group_size(group) == 1:
        return tensor.clone()
    return all_gather_dim(tensor.detach(), dim, group)


def gather_full(param: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather a TP-split parameter (or its grad, given ``param``'s split) to full shape."""
    dim = tp_dim(param)
    return gather_along(param.detach(), dim, resolve_tp_group(tp_group))


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group, timer):
        ctx.group, ctx.timer = group, timer
        return x

    @staticmethod
    def backward(ctx, grad):
        pending = start_input_grad_sum(grad, ctx.group)
        return finish_input_grad_sum(pending, ctx.timer), None, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group, timer):
        return _all_reduce(x, group, timer)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    """Split the last dim forward, all-gather the last dim backward."""

    @staticmethod
    def forward(ctx, x, group, timer):
        ctx.group, ctx.timer = group, timer
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, -1, ctx.group, ctx.timer), None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather a dim forward, split the same dim backward."""

    @staticmethod
    def forward(ctx, x, group, dim, timer):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, dim, group, timer)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ScatterToSequence(torch.autograd.Function):
    """Split the sequence dim forward, all-gather the sequence dim backward."""

    @staticmethod
    def forward(ctx, x, group, dim, timer):
        ctx.group, ctx.dim, ctx.timer = group, dim, timer
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group, ctx.timer), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather the sequence dim forward, reduce-scatter the sequence dim backward."""

    @staticmethod
    def forward(ctx, x, group, dim, timer):
        ctx.group, ctx.dim, ctx.timer = group, dim, timer
        return all_gather_dim(x, dim, group, timer)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group, ctx.timer), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter the sequence dim forward, all-gather the sequence dim backward."""

    @staticmethod
    def forward(ctx, x, group, dim, timer):
        ctx.group, ctx.dim, ctx.timer = group, dim, timer
        return reduce_scatter_dim(x, dim, group, timer)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group, ctx.timer), None, None, None


def _apply_on_tp(
    op: type[torch.autograd.Function],
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    *args,
) -> torch.Tensor:
    """``op.apply(x, group, *args)`` on the resolved TP group; ``x`` itself when that group
    has one rank (every public wrapper below returns early so)."""
    group = resolve_tp_group(tp_group)
    return x if group_size(group) == 1 else op.apply(x, group, *args)


def copy_to_tp(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Input of a column-parallel layer."""
    return _apply_on_tp(_CopyToTP, x, tp_group, comm_timer)


def reduce_from_tp(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """g: all-reduce forward, identity backward. Output of a row-parallel layer."""
    return _apply_on_tp(_ReduceFromTP, x, tp_group, comm_timer)


def scatter_to_tp(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """Split the last dim forward, all-gather it backward."""
    return _apply_on_tp(_ScatterToTP, x, tp_group, comm_timer)


def gather_from_tp(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    dim: int = -1,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """All-gather ``dim`` forward, split it backward: a value every TP rank then uses
    whole, each rank's gradient of it already full (``gather_output=True``; the MoE
    router's logits under sequence parallelism, ``layers.router``)."""
    return _apply_on_tp(_GatherFromTP, x, tp_group, dim, comm_timer)


def scatter_to_sequence(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    dim: int = 0,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """Split the sequence dim forward, all-gather it backward (entering a sequence-parallel region)."""
    return _apply_on_tp(_ScatterToSequence, x, tp_group, dim, comm_timer)


def gather_from_sequence(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    dim: int = 0,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """All-gather the sequence dim forward, reduce-scatter it backward (SP → TP region)."""
    return _apply_on_tp(_GatherFromSequence, x, tp_group, dim, comm_timer)


def reduce_scatter_to_sequence(
    x: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    dim: int = 0,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """Reduce-scatter the sequence dim forward, all-gather it backward (TP → SP region)."""
    return _apply_on_tp(_ReduceScatterToSequence, x, tp_group, dim, comm_timer)
