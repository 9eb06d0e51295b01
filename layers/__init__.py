"""Tensor-parallel building blocks; they import nothing of ours but ``parallel_state``."""

from layers.attention import KVCache, ParallelAttention, decoder_mask
from layers.cross_entropy import vocab_parallel_cross_entropy
from layers.embedding import VocabParallelEmbedding
from layers.linear import ColumnParallelLinear, RowParallelLinear, normal_init
from layers.mappings import (
    copy_to_tp,
    gather_along,
    gather_from_sequence,
    gather_from_tp,
    gather_full,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from layers.mlp import ParallelMLP
from layers.norm import LayerNorm
from layers.recompute import checkpointed
from layers.transformer import ParallelTransformerLayer
from layers.utils import divide, pad_vocab_size, shard

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "normal_init",
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "divide",
    "pad_vocab_size",
    "shard",
    "gather_full",
    "gather_along",
    "LayerNorm",
    "ParallelAttention",
    "KVCache",
    "decoder_mask",
    "ParallelMLP",
    "ParallelTransformerLayer",
    "checkpointed",
]
