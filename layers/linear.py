"""Column- and row-parallel linear layers.

Both keep the ``tp_rank``-th contiguous block of the full weight. Every rank builds the
full master weight from the shared (replicated) RNG stream and keeps its slice, so a layer
at TP=N holds exactly the slices of the TP=1 layer built from the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypedDict, Unpack

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers import mappings
from layers.mappings import (
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from layers.param_roles import mark_sp_partial_grad, mark_tp_dim, tp_dim
from layers.transformer_config import TransformerConfig
from layers.utils import CommTimer, as_autocast, comm_timer_of, divide, shard
from parallel_state.groups import group_rank, group_size, resolve_tp_group

InitMethod = Callable[[torch.Tensor], object]


class ShardOptions(TypedDict, total=False):
    """The keyword options every TP-sharded layer (linear, embedding) takes."""

    tp_group: dist.ProcessGroup | None  # None: the default state's TP group
    init_method: InitMethod | None  # initializer of the full master weight (None: N(0, 0.02²))
    sequence_parallel: bool  # activations sharded along the sequence outside the layer
    sequence_dim: int  # which dim of the activations is the sequence
    dtype: torch.dtype | None  # parameter dtype (None: torch's default)
    device: torch.device | str | None


class LinearOptions(ShardOptions, total=False):
    """``ShardOptions`` plus the linear layers' own."""

    skip_bias_add: bool  # return (output, bias) for a fused kernel to add the bias


def normal_init(std: float = 0.02) -> InitMethod:
    """In-place N(0, std²) initializer (GPT-2's default for linear and embedding weights)."""
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def build_master_weight(
    shape: tuple[int, ...], init_method: InitMethod, dtype: torch.dtype
) -> torch.Tensor:
    """The full master weight, drawn on CPU so its values depend only on the seed, not the device.

    It is fp32 (fp64 for fp64 layers), whatever the layer's dtype, so a bf16 layer at any TP
    size rounds the same fp32 draws.
    """
    master = torch.float64 if dtype == torch.float64 else torch.float32
    full = torch.empty(shape, dtype=master, device="cpu")
    init_method(full)
    return full


def replicated_weight(
    shape: tuple[int, ...],
    std: float,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Parameter:
    """A parameter every TP rank holds whole, drawn N(0, std²) at full size from the seed
    (``build_master_weight``), so its values do not depend on the layout or the device."""
    dtype = dtype or torch.get_default_dtype()
    full = build_master_weight(shape, normal_init(std), dtype)
    return mark_tp_dim(nn.Parameter(full.to(dtype=dtype, device=device)), None)


def init_tp_shard(
    module: nn.Module, options: ShardOptions, schema: type = ShardOptions
) -> dict[str, object]:
    """Set ``module``'s TP placement from its keyword ``options`` (keys of ``schema``):
    ``tp_group`` (resolved), ``tp_size``, ``tp_rank``, ``sequence_parallel`` and
    ``sequence_dim``. Returns the parameters' factory keywords (dtype, device)."""
    unknown = sorted(set(options) - set(schema.__annotations__))
    if unknown:
        raise TypeError(f"{type(module).__name__} got unexpected keyword arguments {unknown}")
    module.tp_group = resolve_tp_group(options.get("tp_group"))
    module.tp_size, module.tp_rank = group_size(module.tp_group), group_rank(module.tp_group)
    module.sequence_parallel = options.get("sequence_parallel", False)
    module.sequence_dim = options.get("sequence_dim", 0)
    return {
        "dtype": options.get("dtype") or torch.get_default_dtype(),
        "device": options.get("device"),
    }


def load_master_weight(
    module: nn.Module, shape: tuple[int, int], options: ShardOptions, dtype: torch.dtype
) -> None:
    """Draw the full master weight with ``options``' init_method (N(0, 0.02²) by default)
    and load this rank's slice of it (``module.load_full_``)."""
    module.load_full_(
        build_master_weight(shape, options.get("init_method") or normal_init(), dtype)
    )


def _weight_and_bias_grads(
    grad_out: torch.Tensor, x: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d W = grad_outᵀ · x and d b = Σ grad_out over every token (x in grad_out's dtype)."""
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]))
    return grad_w, rows.sum(0) if has_bias else None


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """all-gather(x along the sequence) · Wᵀ + b, keeping only the local shard of x.

    Backward all-gathers the shard again for the weight gradient and reduce-scatters the
    input gradient. Saving the shard instead of the gathered sequence is what makes
    sequence parallelism save (t−1)/t of these activations; it costs one more all-gather
    in backward. Its collectives are the sequence-parallel operators' own
    (``mappings.all_gather_dim`` / ``reduce_scatter_dim``, looked up at call time).

    Under autocast the shard is cast to autocast's dtype before it is gathered and saved:
    F.linear would cast the gathered input to it anyway, so the numbers are the same, and
    both all-gathers move and autograd keeps half the bytes of an fp32 shard (a norm's
    output under bf16 autocast is fp32).
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, dim, timer):
        ctx.x_dtype, x_shard = x_shard.dtype, as_autocast(x_shard)
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.dim, ctx.has_bias, ctx.timer = group, dim, bias is not None, timer
        return F.linear(mappings.all_gather_dim(x_shard, dim, group, timer), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        dtype = grad_out.dtype  # under autocast the forward ran in this precision
        total = mappings.all_gather_dim(x_shard, ctx.dim, ctx.group, ctx.timer).to(dtype)
        grad_x = grad_out.matmul(weight.to(dtype))
        grad_x = mappings.reduce_scatter_dim(grad_x, ctx.dim, ctx.group, ctx.timer)
        grad_w, grad_b = _weight_and_bias_grads(grad_out, total, ctx.has_bias)
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), grad_b, None, None, None


class _LinearAfterCopy(torch.autograd.Function):
    """F.linear(copy_to_tp(x), weight, bias) with f's backward all-reduce overlapped.

    Backward computes the input gradient first, starts its all-reduce over the TP group,
    computes the weight and bias gradients while it runs, then waits (Megatron's
    asynchronous input-gradient all-reduce). The sums are the ones ``copy_to_tp`` makes,
    in the input's dtype, so the numbers are those of the composed ops.

    Under autocast the input and weight are cast here, as F.linear would cast them, and
    the cast copies are what is saved for backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, timer):
        ctx.group, ctx.timer, ctx.has_bias = group, timer, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        x, weight, bias = as_autocast(x), as_autocast(weight), as_autocast(bias)
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)).to(x_dtype)
        pending = mappings.start_input_grad_sum(grad_x, ctx.group)
        grad_w, grad_b = _weight_and_bias_grads(grad_out, x.to(grad_out.dtype), ctx.has_bias)
        grad_b = None if grad_b is None else grad_b.to(b_dtype)
        grad_x = mappings.finish_input_grad_sum(pending, ctx.timer)
        return grad_x, grad_w.to(w_dtype), grad_b, None, None


def sequence_parallel_linear(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    dim: int = 0,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """``F.linear(gather_from_sequence(x_shard), weight, bias)``: a column-parallel product
    of a sequence-sharded input (along ``dim``) that keeps only the shard for backward
    (``_SequenceParallelColumnLinear``). One rank: plain F.linear."""
    group = resolve_tp_group(group)
    if group_size(group) == 1:
        return F.linear(x_shard, weight, bias)
    dim = dim % x_shard.dim()
    return _SequenceParallelColumnLinear.apply(x_shard, weight, bias, group, dim, comm_timer)


def linear_after_copy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    comm_timer: CommTimer | None = None,
) -> torch.Tensor:
    """``F.linear(copy_to_tp(x, group), weight, bias)``: a column-parallel product of a
    replicated input, whose backward overlaps the input gradient's all-reduce with the
    weight and bias gradients. One rank: plain F.linear."""
    group = resolve_tp_group(group)
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _LinearAfterCopy.apply(x, weight, bias, group, comm_timer)


class _TPLinearBase(nn.Module):
    """Shared construction of the two parallel linear layers; see subclasses. Their keyword
    options are ``LinearOptions``'s."""

    split_dim: int  # which dim of the [out, in] weight is split across TP

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        **options: Unpack[LinearOptions],
    ) -> None:
        super().__init__()
        factory = init_tp_shard(self, options, LinearOptions)
        self.skip_bias_add = options.get("skip_bias_add", False)
        self.in_features, self.out_features = in_features, out_features
        split_features = (out_features, in_features)[self.split_dim]
        what = f"{type(self).__name__} {('out', 'in')[self.split_dim]}_features"
        local = divide(split_features, self.tp_size, what)
        shape = [out_features, in_features]
        shape[self.split_dim] = local
        self.weight = mark_tp_dim(nn.Parameter(torch.empty(shape, **factory)), self.split_dim)
        self.bias = None
        if bias:
            bias_local = local if self.split_dim == 0 else out_features
            self.bias = nn.Parameter(torch.zeros(bias_local, **factory))
            mark_tp_dim(self.bias, 0 if self.split_dim == 0 else None)
        load_master_weight(self, (out_features, in_features), options, factory["dtype"])

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Overwrite this rank's slices from full-shape ``weight`` [out, in] and ``bias`` [out]."""
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"full weight must have shape {expected}, got {tuple(weight.shape)}")
        self.weight.copy_(shard(weight, self.split_dim, self.tp_rank, self.tp_size))
        if bias is not None:
            if self.bias is None:
                raise ValueError("this layer was built with bias=False but a bias was given")
            self.bias.copy_(shard(bias, tp_dim(self.bias), self.tp_rank, self.tp_size))

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs):
        """Build the layer from full weights (checkpoint resharding, Hugging Face import)."""
        out_features, in_features = weight.shape
        # The copy stands in for random init, so no RNG draws are spent on discarded values.
        kwargs.setdefault("init_method", lambda t: t.copy_(weight))
        layer = cls(in_features, out_features, bias=bias is not None, **kwargs)
        if bias is not None:
            layer.load_full_(weight, bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_rank}/{self.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_TPLinearBase):
    """Y = X·Aᵀ + b with A split by output rows: ``weight`` is [out/tp, in], ``bias`` [out/tp].

    The input enters through f (identity forward, all-reduce backward), or under sequence
    parallelism through an all-gather along the sequence dim (reduce-scatter backward).
    The output stays sharded on its last dim unless ``gather_output=True``.
    ``skip_bias_add=True`` returns ``(X·Aᵀ, b)`` instead, for a fused kernel to add the bias
    (bias + GeLU).
    """

    split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        **options: Unpack[LinearOptions],
    ) -> None:
        sequence_parallel = options.get("sequence_parallel", False)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True cannot be combined with sequence_parallel=True")
        self.gather_output = gather_output
        super().__init__(in_features, out_features, bias, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.tp_size > 1:
            timer = comm_timer_of(self)
            y = sequence_parallel_linear(
                x, self.weight, bias, self.tp_group, self.sequence_dim, timer
            )
        else:
            timer = comm_timer_of(self)
            y = linear_after_copy(x, self.weight, bias, self.tp_group, timer)
            y = gather_from_tp(y, self.tp_group, comm_timer=timer) if self.gather_output else y
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(_TPLinearBase):
    """Y = X·Aᵀ + b with A split by input columns: ``weight`` is [out, in/tp], ``bias`` [out].

    The partial products are summed by g (all-reduce forward, identity backward), or under
    sequence parallelism reduce-scattered along the sequence dim. The full bias is added
    once, after the reduction; ``skip_bias_add=True`` returns ``(partial sum reduced, b)``
    instead, for a fused kernel to add it (bias + dropout + residual add).
    """

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        **options: Unpack[LinearOptions],
    ) -> None:
        sequence_parallel = options.get("sequence_parallel", False)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        super().__init__(in_features, out_features, bias, **options)
        if self.bias is not None and sequence_parallel:
            # Each rank adds the bias to its own sequence shard only: partial gradient.
            mark_sp_partial_grad(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        timer = comm_timer_of(self)
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group, comm_timer=timer)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(
                y, self.tp_group, dim=self.sequence_dim, comm_timer=timer
            )
        else:
            y = reduce_from_tp(y, self.tp_group, comm_timer=timer)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


def branch_options(
    cfg: TransformerConfig,
    tp_group: dist.ProcessGroup | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> LinearOptions:
    """The options every linear of a transformer layer's attention and MLP shares."""
    return LinearOptions(
        tp_group=tp_group, sequence_parallel=cfg.sequence_parallel, dtype=dtype, device=device
    )


def residual_output_linear(
    cfg: TransformerConfig, in_features: int, options: LinearOptions
) -> RowParallelLinear:
    """A residual branch's last projection to ``cfg.hidden_size`` (attention's dense, the
    MLP's fc2): row-parallel, drawn with std init_std / √(2·layers) (GPT-2 / Megatron:
    residual-branch outputs start smaller), its bias returned unadded for the layer's fused
    bias + dropout + residual add."""
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return RowParallelLinear(
        in_features,
        cfg.hidden_size,
        cfg.linear_bias,
        init_method=normal_init(out_std),
        skip_bias_add=True,
        **options,
    )
