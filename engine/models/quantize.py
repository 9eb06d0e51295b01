"""``--quantize int8`` for a built decoder: its linears, LM head and word embedding in int8.

``quantize_model_`` swaps, in place and on every TP rank alike, each transformer layer's
column- and row-parallel linears (qkv or query/key-value, dense, fc1, fc2), the LM head and
the word embedding for the int8 modules of ``layers.quantize`` (per-output-channel scales,
each TP shard quantized locally). The word embedding is included because with tied
embeddings (GPT's default) it *is* the LM head's weight: one int8 table with one scale per
token serves both, its rows being the head's output channels; untied, it is quantized the
same way, a lookup dequantizing only the rows it reads. What stays in the model's dtype:
the learned position table (additive, ``max_positions × h``), LayerNorm/RMSNorm weights,
biases, and, where present, the MoE routers and routed experts (``GroupedExperts``; a
shared expert is a ParallelMLP and is int8) and the KV projection replicated per head when
TP exceeds the KV heads (those modules are not swapped).

A quantized model serves and evaluates; it does not train or save (its weights are
buffers, and ``full_state_dict`` no longer sees them).
"""

from __future__ import annotations

import torch
from torch import nn

from layers.quantize import (
    Int8VocabParallelEmbedding,
    Int8VocabParallelHead,
    Int8Weight,
    quantize_linears_,
)

QUANTIZE_MODES = ("none", "int8")


def quantize_model_(model: nn.Module, mode: str = "int8") -> nn.Module:
    """``model`` (a decoder, weights loaded) with its weights quantized by ``mode``, in place.
    ``"none"`` leaves it as it is. Call on every TP rank: each quantizes its own shards."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize mode must be one of {QUANTIZE_MODES}, got {mode!r}")
    if mode == "none" or isinstance(model.lm_head, Int8VocabParallelHead):  # done already
        return model
    if not model.cfg.causal:
        raise ValueError(f"--quantize {mode} is for decoders (gpt, llama), not {model.cfg.arch}")
    if model.cfg.sequence_parallel:
        raise ValueError("int8 quantization serves models built without sequence parallelism")
    with torch.no_grad():
        quantize_linears_(model.layers)
        head = model.lm_head
        word = Int8VocabParallelEmbedding(model.embedding.word)
        model.embedding.word = word
        int8 = word.int8 if head.weight is None else Int8Weight(head.weight)
        model.lm_head = Int8VocabParallelHead(int8, head.bias, head.tp_group, head.vocab_size)
    return model


def weight_memory(model: nn.Module, float_bytes: int = 2) -> dict[str, int]:
    """Bytes of ``model``'s weights on this rank, each storage counted once (a tied table is
    one): ``int8`` (the int8 matrices and their fp32 scales), ``float`` (every other parameter,
    counted at ``float_bytes`` per element: 2 is an fp16/bf16 model), ``total``,
    and ``float_equivalent``: the same tensors with every weight at ``float_bytes``."""
    seen: set[int] = set()
    int8 = float_rest = equivalent = 0
    for module in model.modules():
        if isinstance(module, Int8Weight) and id(module) not in seen:
            seen.add(id(module))
            int8 += module.nbytes()
            equivalent += module.qweight.numel() * float_bytes
    pointers: set[int] = set()
    for module in model.modules():
        if isinstance(module, Int8Weight):
            continue
        for t in module.parameters(recurse=False):
            if not t.is_floating_point() or t.data_ptr() in pointers:
                continue
            pointers.add(t.data_ptr())
            float_rest += t.numel() * float_bytes
            equivalent += t.numel() * float_bytes
    return {
        "int8": int8,
        "float": float_rest,
        "total": int8 + float_rest,
        "float_equivalent": equivalent,
    }
