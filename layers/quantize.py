"""Int8 weight-only quantization of the tensor-parallel layers, for serving.

Each weight is stored as int8 with one symmetric scale per output channel (a row of the
``[out, in]`` matrix, a token's row of an embedding table): ``scale = max|row| / 127``,
``q = round(w / scale)`` in -127 .. 127, so ``|w - q · scale| <= scale / 2`` element by
element. The matmul dequantizes on the fly: ``x · (q · scale)ᵀ = (x · qᵀ) · scale``, the
int8 matrix cast to the activations' dtype and the scale applied to the output channels.
Activations, biases and everything not listed here stay in the model's dtype.

Quantization is local to a TP shard: a column-parallel shard holds whole output rows and
quantizes them as the unsharded layer would; a row-parallel shard holds a slice of every
row's input columns and takes its own per-row scales over that slice, so its partial
product is scaled before the all-reduce sums the shards. Nothing is communicated to build
the int8 weights and each rank reads only its own shard.

These modules are for inference: they hold buffers, not parameters (no gradient), and do
not run under sequence parallelism. meshtron uses its own implementation because torchao
is not one of its dependencies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layers.embedding import VocabParallelEmbedding
from layers.linear import ColumnParallelLinear, RowParallelLinear
from layers.mappings import gather_from_tp, reduce_from_tp, scatter_to_tp

QMAX = 127  # symmetric range: -128 is never used, so q and -q are both representable


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` float → (int8 ``[rows, cols]``, fp32 scale ``[rows]``), one symmetric
    scale per row. An all-zero row (vocabulary padding) gets scale 1 and zeros."""
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.to(torch.float32)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``q · scale`` (per row) in ``dtype``."""
    return q.to(dtype) * scale.to(dtype).unsqueeze(1)


class Int8Weight(nn.Module):
    """An int8 ``[rows, cols]`` weight with per-row scales, and its product with activations.

    ``qweight`` and ``scale`` are buffers, so ``.to(device)`` moves them; ``dtype`` is the
    float dtype the model ran in (the output's and the KV cache's)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scale", scale.to(weight.device))
        self.dtype = weight.dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x · (q · scale)ᵀ + bias`` with the scale applied to the output channels."""
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if bias is None else y + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` (an embedding lookup): ``[*ids.shape, cols]``."""
        return self.qweight[ids].to(self.dtype) * self.scale[ids].to(self.dtype).unsqueeze(-1)

    def nbytes(self) -> int:
        """Bytes held: the int8 matrix and the fp32 scales."""
        return self.qweight.nbytes + self.scale.nbytes

    def extra_repr(self) -> str:
        rows, cols = self.qweight.shape
        return f"int8 [{rows}, {cols}], fp32 scale per row, compute {self.dtype}"


def _no_sequence_parallel(layer: nn.Module) -> None:
    if getattr(layer, "sequence_parallel", False) and getattr(layer, "tp_size", 1) > 1:
        raise ValueError("int8 layers run without sequence parallelism (inference layouts)")


class _Int8ParallelLinear(nn.Module):
    """What both int8 TP linears take from the float layer they replace: its features, TP
    placement and ``skip_bias_add``, its weight shard quantized, and its float bias."""

    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear) -> None:
        super().__init__()
        _no_sequence_parallel(layer)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.tp_group, self.tp_size, self.tp_rank = layer.tp_group, layer.tp_size, layer.tp_rank
        self.skip_bias_add = layer.skip_bias_add
        self.int8 = Int8Weight(layer.weight)
        self.bias = layer.bias


class Int8ColumnParallelLinear(_Int8ParallelLinear):
    """A :class:`ColumnParallelLinear`'s forward with its ``[out/tp, in]`` shard in int8:
    each rank's output rows carry their own scales, the same as the TP 1 layer's rows.
    The bias is float, this rank's ``[out/tp]``."""

    def __init__(self, layer: ColumnParallelLinear) -> None:
        super().__init__(layer)
        self.gather_output = layer.gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # copy_to_tp is the identity in forward; no backward runs here.
        y = self.int8.linear(x, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = gather_from_tp(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y


class Int8RowParallelLinear(_Int8ParallelLinear):
    """A :class:`RowParallelLinear`'s forward with its ``[out, in/tp]`` shard in int8: each
    rank scales its own partial product by its own per-row scales before the all-reduce.
    The bias is float, the whole ``[out]``, added once after the sum."""

    def __init__(self, layer: RowParallelLinear) -> None:
        super().__init__(layer)
        self.input_is_parallel = layer.input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        y = reduce_from_tp(self.int8.linear(x), self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class Int8VocabParallelEmbedding(nn.Module):
    """A :class:`VocabParallelEmbedding` with its ``[V/tp, D]`` block in int8, one scale per
    token: a lookup dequantizes only the rows it reads. ``weight`` is None (a tied LM head
    takes ``int8`` itself: the table's rows are the head's output channels)."""

    weight = None

    def __init__(self, layer: VocabParallelEmbedding) -> None:
        super().__init__()
        _no_sequence_parallel(layer)
        self.num_embeddings, self.embedding_dim = layer.num_embeddings, layer.embedding_dim
        self.tp_group, self.tp_size, self.tp_rank = layer.tp_group, layer.tp_size, layer.tp_rank
        self.vocab_start, self.vocab_end = layer.vocab_start, layer.vocab_end
        self.int8 = Int8Weight(layer.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.int8.rows(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = self.int8.rows(local_ids).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)


class Int8VocabParallelHead(nn.Module):
    """An LM head's vocabulary-sharded product ``x · Wᵀ (+ b)`` with ``W`` ``[V/tp, h]`` in
    int8 (its own, or a tied embedding's :class:`Int8Weight`, shared, not copied)."""

    def __init__(
        self, int8: Int8Weight, bias: torch.Tensor | None, tp_group, vocab_size: int
    ) -> None:
        super().__init__()
        self.int8, self.bias, self.tp_group, self.vocab_size = int8, bias, tp_group, vocab_size
        self.sequence_parallel = False

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.int8.linear(x, self.bias)  # tied_weight: None (the embedding is int8)


def quantize_linears_(module: nn.Module) -> int:
    """Replace every :class:`ColumnParallelLinear` and :class:`RowParallelLinear` under
    ``module`` by its int8 counterpart, in place; returns how many were replaced."""
    swaps = {
        ColumnParallelLinear: Int8ColumnParallelLinear,
        RowParallelLinear: Int8RowParallelLinear,
    }
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            kind = swaps.get(type(child))
            if kind is not None:
                parent.add_module(name, kind(child))  # replaces the child of that name
                count += 1
    return count


def kv_layout(projection: nn.Module) -> tuple[int, torch.dtype, torch.device]:
    """(output rows on this rank, the float dtype, the device) of a projection, float or int8:
    what a KV cache is sized and typed from."""
    if isinstance(getattr(projection, "int8", None), Int8Weight):
        q = projection.int8.qweight
        return q.shape[0], projection.int8.dtype, q.device
    w = projection.weight
    return w.shape[0], w.dtype, w.device
