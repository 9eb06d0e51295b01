"""``model.compile``: torch.compile of each transformer layer, TP collectives included.

Each layer's forward is compiled in place (``nn.Module.compile``), so parameter names and
checkpoints stay as they are. The TP collectives live in the conjugate operators'
autograd Functions (``layers.mappings``, the sequence-parallel column linear); TorchDynamo
traces them and records ``torch.distributed``'s in-place collectives as functional
collectives in the graph, so one layer is one graph at any TP size, with or without
sequence parallelism. Two things stay outside the compiled region on purpose:

- full recomputation: ``torch.utils.checkpoint`` with the RNG tracker's stream replay
  (``layers.recompute``) wraps the compiled layer body, rather than being traced into it;
- the Triton kernels and the tracker's stream switches, which Dynamo cannot trace, run
  eagerly between graphs (graph breaks there, not errors).

Importing this module does not import TorchDynamo; compiling does (it is slow to import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from layers.kernel_set import TORCH_KERNELS, Kernels

# torch's built-in backends: "inductor" generates fused kernels (needs a C compiler on
# CPU); "aot_eager" traces forward and backward but runs them eagerly (checks tracing,
# quickly); "eager" only captures graphs.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


# Selective recomputation inside a compiled layer (its checkpoint traced by Dynamo) gave
# gradients 100 % off eager's at tp_size 2 on torch 2.11 (the H100 image's torch,
# 2026-11-23, tests/test_compile.py, aot_eager), and matching ones on torch 2.13.
SELECTIVE_UNDER_COMPILE_FROM = "2.13"


def selective_recompute_compiles() -> bool:
    """Whether this torch compiles selective recomputation at tp_size > 1 correctly."""
    return torch.__version__ >= SELECTIVE_UNDER_COMPILE_FROM


def compile_layers(layers: Iterable[nn.Module], *, backend: str = "inductor") -> None:
    """Compile each ``ParallelTransformerLayer`` in ``layers`` in place."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"model.compile_backend={backend!r} is not one of {COMPILE_BACKENDS}")
    for layer in layers:
        for module in layer.modules():
            if isinstance(getattr(module, "kernels", None), Kernels):
                module.kernels = _eager_kernels(module.kernels)
        if getattr(layer, "recompute_full", False):
            # The checkpoint and its RNG replay stay eager around the compiled body.
            layer._forward = torch.compile(layer._forward, backend=backend)
        else:
            layer.compile(backend=backend)


def _eager_kernels(kernels: Kernels) -> Kernels:
    """``kernels`` with the fused (Triton) ops run eagerly: a graph break around each call,
    since Dynamo cannot trace their launchers. torch's own ops are left to be compiled."""
    if kernels is TORCH_KERNELS:
        return kernels
    eager = {
        f.name: torch.compiler.disable(getattr(kernels, f.name))
        for f in dataclasses.fields(kernels)
    }
    return Kernels(**eager)
