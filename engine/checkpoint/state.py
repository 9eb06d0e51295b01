"""A rank's model and optimizer state as named, TP-local tensors, and back.

Tensor names are stable across layouts: ``model/<param>`` for a parameter (its module
path) and ``optim/<param>/<key>`` for optimizer state of the parameter's shape (Adam's
``exp_avg``, ``exp_avg_sq``); scalar state (Adam's ``step``) goes to the index as JSON.
Both data-parallel strategies (``engine.data_parallel``) export the same per-parameter
view, so a checkpoint of either loads into either; a bare torch optimizer (tools, tests)
is read as every replica's full state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine.checkpoint.layout import MODEL, OPTIM, Box, TensorSpec, dtype_name, local_box
from engine.data_parallel import checkpoint_view
from engine.models import ParallelModel
from layers.gqa import dedupe_gathered
from layers.mappings import gather_along
from layers.param_roles import (
    expert_rank,
    expert_split,
    is_expert,
    is_vocab_padded,
    replicas,
    tp_blocks,
    tp_dim,
)
from layers.utils import group_rank, group_size, tp_local


def model_name(param_name: str) -> str:
    """Stored name of a parameter."""
    return f"model/{param_name}"


def optim_name(param_name: str, key: str) -> str:
    """Stored name of a parameter's optimizer state ``key``."""
    return f"optim/{param_name}/{key}"


def param_of(stored: str) -> str:
    """The parameter a stored tensor name belongs to (``model/P``, ``optim/P/key``)."""
    kind, rest = stored.split("/", 1)
    return rest.rsplit("/", 1)[0] if kind == "optim" else rest


def padded_vocab(model: ParallelModel) -> int:
    """The model's in-memory vocabulary rows at its TP size."""
    return model.cfg.padded_vocab_size(group_size(model.tp_group))


def param_spec(
    name: str,
    param: nn.Parameter,
    kind: str,
    model: ParallelModel,
    dtype: torch.dtype | None = None,
) -> TensorSpec:
    """The full-shape spec of a parameter (or of state shaped like it) on this model.

    A block held by several TP ranks (GQA past the KV heads) counts once in the full shape;
    a tensor of experts split over ep holds every ep rank's experts (as at ep 1).
    """
    split = tp_dim(param)
    vocab = is_vocab_padded(param)
    shape = list(param.shape)
    if split is not None:
        shape[split] *= group_size(model.tp_group) // replicas(param)
    if is_expert(param):
        shape[0] *= expert_split(param)
    if vocab:
        shape[0] = model.cfg.vocab_size
    return TensorSpec(
        name,
        tuple(shape),
        dtype_name(dtype or param.dtype),
        kind,
        split,
        vocab,
        tp_blocks=tp_blocks(param) if split is not None else None,
        experts=is_expert(param),
    )


def as_held_by(spec: TensorSpec, param: nn.Parameter) -> TensorSpec:
    """``spec`` (as stored) with the model's ``param``'s TP split dim and block count and
    whether its dim 0 is experts: the model's layers, not the index, say how its tensors
    are cut (an index written before the count was recorded has none, and at a TP size up
    to the KV heads it needed none; one written before MoE experts split over TP records
    them replicated; the index never records experts, layout.TensorSpec). The stored
    tensors are full-shape boxes, so any cut reads them."""
    split = tp_dim(param)
    blocks = tp_blocks(param) if split is not None else None
    experts = is_expert(param)
    if (spec.tp_dim, spec.tp_blocks, spec.experts) == (split, blocks, experts):
        return spec
    return replace(spec, tp_dim=split, tp_blocks=blocks, experts=experts)


def held_box(
    spec: TensorSpec, model: ParallelModel, param: nn.Parameter | None = None
) -> Box | None:
    """The part of ``spec``'s full tensor this rank holds (``layout.local_box`` at the
    model's TP rank and, for experts, at ``param``'s ep block); None if it holds none."""
    ep_rank, ep_size = (0, 1) if param is None else (expert_rank(param), expert_split(param))
    tp_rank, tp_size = group_rank(model.tp_group), group_size(model.tp_group)
    return local_box(spec, tp_rank, tp_size, padded_vocab(model), ep_rank, ep_size)


def param_states(optimizer) -> dict[nn.Parameter, dict[str, Any]]:
    """Per-parameter optimizer state at TP-local shapes (collective over DP for ZeRO-1)."""
    return checkpoint_view(optimizer).param_states()


def export_local(model: ParallelModel, optimizer) -> tuple[dict, dict, dict]:
    """(specs, TP-local tensors, scalar state) of this rank, keyed by stored name.

    ``scalars`` is ``{param name: {key: number}}`` (e.g. Adam's step per parameter).
    """
    specs, tensors, scalars = {}, {}, {}
    states = param_states(optimizer) if optimizer is not None else {}
    for name, p in model.named_parameters():
        key = model_name(name)
        specs[key], tensors[key] = param_spec(key, p, MODEL, model), tp_local(p)
        for skey, value in sorted(states.get(p, {}).items()):
            if torch.is_tensor(value) and value.shape == p.shape:
                oname = optim_name(name, skey)
                specs[oname] = param_spec(oname, p, OPTIM, model, value.dtype)
                tensors[oname] = value.detach()
            elif torch.is_tensor(value) and value.dim() > 0:
                raise ValueError(f"optimizer state {skey} of {name} has shape {tuple(value.shape)}")
            else:
                scalars.setdefault(name, {})[skey] = float(value)
    return specs, tensors, scalars


def read_local(
    reader,
    spec: TensorSpec,
    shape: torch.Size,
    model: ParallelModel,
    into=None,
    owner: nn.Parameter | None = None,
) -> torch.Tensor:
    """This rank's in-memory tensor of ``shape`` for ``spec`` (padding zeroed), from ``reader``.

    With ``into`` (a tensor of ``shape``, e.g. the parameter itself) the stored slice is
    read into it and ``into`` is returned; call :func:`expect_local` for it first and the
    bytes go from the file straight there. Otherwise, where the stored slice is the whole
    local tensor, it is the tensor the reader read (no zeroed buffer, no copy). ``owner``,
    the parameter ``spec`` belongs to, says which experts this rank holds (``held_box``).
    """
    tp_size = group_size(model.tp_group)
    box = held_box(spec, model, owner)
    local = into
    if box is None:  # a rank holding padding rows only
        return torch.zeros(shape, dtype=spec.torch_dtype) if local is None else local.zero_()
    lengths = [hi - lo for lo, hi in box]
    # Only vocabulary padding may make the in-memory tensor larger than its stored slice;
    # anything else is another model (or a misplaced cut) and must not load half-filled.
    fits = len(lengths) == len(shape) and lengths[1:] == list(shape[1:])
    if fits and lengths:
        fits = lengths[0] <= shape[0] if spec.vocab_padded else lengths[0] == shape[0]
    if not fits:
        raise ValueError(
            f"{spec.name}: stored shape {list(spec.shape)} does not fit the model's "
            f"{list(shape)} shard at tp_size={tp_size}"
        )
    stored = reader.read(spec.name, box)
    if local is None and list(shape) == lengths:
        return stored
    if local is None:
        local = torch.empty(shape, dtype=spec.torch_dtype)
    part = local[tuple(slice(0, n) for n in lengths)]
    if stored.data_ptr() != part.data_ptr():  # not already read into place
        part.copy_(stored)
    local[lengths[0] :].zero_()  # the vocabulary padding rows
    return local


def expect_local(
    reader,
    spec: TensorSpec,
    into: torch.Tensor,
    model: ParallelModel,
    owner: nn.Parameter | None = None,
) -> None:
    """Tell ``reader`` to read ``spec``'s local slice straight into ``into`` (see read_local)."""
    box = held_box(spec, model, owner)
    if box is not None and len(box) == into.dim():
        reader.read_into(spec.name, box, into[tuple(slice(0, hi - lo) for lo, hi in box)])


def load_optimizer(optimizer, states: dict[nn.Parameter, dict[str, Any]]) -> None:
    """Install per-parameter state (TP-local tensors and scalars) into ``optimizer``."""
    checkpoint_view(optimizer).load_param_states(states)


def full_optimizer_state(model: ParallelModel, optimizer) -> dict[str, torch.Tensor]:
    """{stored name: full-shape tensor} of the optimizer state, gathered over DP and TP (and
    experts over ep).

    Collective; for tests and inspection (a checkpoint never gathers over TP).
    """
    out = {}
    states = param_states(optimizer)
    ep = model.expert_groups() if isinstance(model, ParallelModel) else {}
    for name, p in model.named_parameters():
        for key, value in sorted(states.get(p, {}).items()):
            if torch.is_tensor(value) and value.shape == p.shape:
                full = gather_along(value, tp_dim(p), model.tp_group)
                full = dedupe_gathered(full, replicas(p), group_size(model.tp_group))
                if p in ep:
                    full = gather_along(full, 0, ep[p])
                if is_vocab_padded(p):
                    full = full[: model.cfg.vocab_size]
                out[optim_name(name, key)] = full
    return out
