"""``model.compile``: torch.compile of the whole forward and loss, TP collectives included.

``compile_model`` compiles a model's forward in place (``nn.Module.compile``, so parameter
names and checkpoints stay as they are): the embedding, every transformer layer, the LM
head and the vocab-parallel cross-entropy are one region for TorchDynamo. The TP
collectives live in the conjugate operators' autograd Functions (``layers.mappings``, the
sequence-parallel column linear, the cross-entropy's statistics); Dynamo traces them and
records ``torch.distributed``'s in-place collectives as functional collectives in the
graph, at any TP size, with or without sequence parallelism. Dropout is in the graph too:
its masks come from ``layers.dropout``'s op, which draws from the RNG tracker's streams
what eager dropout draws, and recomputation (full or selective) is a traced checkpoint
that keeps those masks. What Dynamo cannot trace runs eagerly between graphs (graph
breaks, counted by ``tools/count_graph_breaks.py``): the Triton kernels, and with them
the checkpoint of a layer with full recomputation and dropout (``_needs_eager_checkpoint``).

``compile_layers`` compiles the transformer layers alone (the narrower form, kept for
callers that compile their own head). Importing this module does not import TorchDynamo;
compiling does (it is slow to import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from layers.kernel_set import TORCH_KERNELS, Kernels
from layers.mlp import ParallelMLP

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
    _check_backend(backend)
    for layer in layers:
        _use_eager_kernels(layer)
        if _needs_eager_checkpoint(layer):
            layer._forward = torch.compile(layer._forward, backend=backend)
        else:
            layer.compile(backend=backend)


def compile_model(
    model: nn.Module, *, backend: str = "inductor", kernels: str = "auto", cuda_graphs: bool = False
) -> None:
    """Compile ``model``'s whole forward (embedding, layers, head, loss) in place.

    ``kernels`` is the model's ``model.kernels``: under "auto" the compiled graph takes
    torch's element-wise ops, which the compiler fuses itself (the auto rule weighs the
    Triton kernels against eager torch, and each would break the graph); "triton" and
    "apex" keep their kernels, run eagerly between graphs.

    ``cuda_graphs`` (``model.cuda_graphs``) compiles with inductor's
    ``mode="reduce-overhead"``: each graph's kernels are recorded once per shape as a CUDA
    graph and replayed, one launch instead of one per kernel. The model must be on a CUDA
    device (checked here); ``ModelConfig.validate`` refuses the settings it cannot replay.
    A graph output (the loss) is valid until the next forward replays over it: the
    trainer reads it before then.
    """
    _check_backend(backend)
    if cuda_graphs:
        check_cuda_graphs(model, backend)
    if kernels == "auto":
        for module in model.modules():
            if isinstance(getattr(module, "kernels", None), Kernels):
                module.kernels = TORCH_KERNELS
    for module in model.modules():
        if isinstance(module, ParallelMLP) and module.kernels is TORCH_KERNELS:
            # The GEMM adds fc1's bias (addmm): the compiled activation's backward then
            # reads the stored pre-activation instead of recomputing bias + GeLU twice
            # (once for the input gradient, once for the bias gradient's column sums).
            module.fc1.skip_bias_add = False
    _use_eager_kernels(model)
    _use_eager_ring(model)
    for layer in model.modules():
        if _needs_eager_checkpoint(layer):
            layer._forward = torch.compile(layer._forward, backend=backend)
            layer.forward = torch.compiler.disable(layer.forward)
    model.compile(backend=backend, **({"mode": "reduce-overhead"} if cuda_graphs else {}))


def check_cuda_graphs(model: nn.Module, backend: str) -> None:
    """Raise ValueError, one line, where ``model`` cannot run as CUDA graphs."""
    if backend != "inductor":
        raise ValueError(f"model.cuda_graphs=true needs compile_backend=inductor, not {backend!r}")
    devices = sorted({p.device.type for p in model.parameters()})
    if devices != ["cuda"]:
        raise ValueError(
            "model.cuda_graphs=true needs the model on a CUDA device; its parameters are on "
            + ", ".join(devices)
        )


def _needs_eager_checkpoint(layer: nn.Module) -> bool:
    """A layer with full recomputation and dropout whose kernels run eagerly: a kernel's
    graph break inside the traced checkpoint would leave that checkpoint running eagerly
    without the tracker's replay (wrong masks in backward), so the checkpoint stays eager,
    with its replay, around a separately compiled body."""
    return (
        getattr(layer, "recompute_full", False)
        and getattr(layer, "draws_random", False)
        and layer.kernels is not TORCH_KERNELS
    )


def _check_backend(backend: str) -> None:
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"model.compile_backend={backend!r} is not one of {COMPILE_BACKENDS}")


def _use_eager_ring(root: nn.Module) -> None:
    """Each context-parallel core's ring (``RingCoreAttention``) runs eagerly between the
    compiled graphs, one break a layer: its point-to-point exchanges and the blocks it
    skips (decided from the positions and document ids) are nothing Dynamo traces: left to
    it, they broke the graph at each exchange and skip test (Llama, 2 layers, packed rows
    at cp 2: 20 graphs and 10 breaks, against 8 graphs and 4 breaks with the ring
    disabled, all of them the ring's). Everything around it compiles."""
    from layers.attention import RingCoreAttention

    for module in root.modules():
        if isinstance(module, RingCoreAttention):
            module._attend = torch.compiler.disable(module._attend)


def _use_eager_kernels(root: nn.Module) -> None:
    for module in root.modules():
        if isinstance(getattr(module, "kernels", None), Kernels):
            module.kernels = _eager_kernels(module.kernels)


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
