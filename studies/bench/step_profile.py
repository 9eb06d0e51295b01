"""Where a training step's time goes, by kind of work, for loops profiled side by side.

A top-20 table of kernels cannot compare two loops: meshtron's compiled step and the plain
GPT's run kernels with different generated names. Summed into a few kinds (matmuls,
attention, the compiler's fused kernels, meshtron's Triton kernels, the optimizer step,
copies, communication, the rest), two loops' steps line up, and the kind whose time
differs is where a gap between them lies.

The clock is the one torch's profiler table totals: on CUDA the self time of the device
events (kernels, copies and fills on the GPU), elsewhere the self CPU time of every op.
The kinds therefore add up to the table's "Self CUDA time total" (or "Self CPU time
total") divided by the profiled steps.
"""

from __future__ import annotations

import re

from torch.autograd import DeviceType

# (kind, pattern on the event's name), first match wins. On CUDA the names are kernel
# names (cuBLAS: nvjet_*, sm90_xmma_gemm_*, cutlass*; attention: flash_*, fmha_*,
# cudnn *sdpa*; inductor: triton_poi/red/per_*; foreach and fused AdamW:
# multi_tensor_apply_kernel); off CUDA they are aten op names.
KINDS: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_to_all"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention"),
    (
        "matmul",
        r"gemm|nvjet|xmma|cutlass|cublas|splitk"
        r"|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$",
    ),
    ("optimizer", r"multi_tensor_apply|adam|_foreach_"),
    ("compiled", r"^triton_|cpp_fused|compiled"),
    ("fused kernels", r"^_\w+_(fwd|bwd)\w*_kernel$"),
    ("copies", r"memcpy|memset|copy|fill|catarray|^aten::(cat|clone|contiguous|zero_|to)$"),
)
OTHER = "other"
# The order kinds are shown in (the rules above are in matching order).
KIND_NAMES = (
    "matmul",
    "attention",
    "compiled",
    "fused kernels",
    "optimizer",
    "copies",
    "communication",
    OTHER,
)
_COMPILED = [(kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS]
_DEVICES = {DeviceType.CUDA}


def kind_of(name: str) -> str:
    """The kind of work an event named ``name`` is (one of ``KIND_NAMES``)."""
    return next((kind for kind, pattern in _COMPILED if pattern.search(name)), OTHER)


def _on_device(event) -> bool:
    return event.device_type in _DEVICES and not getattr(event, "is_user_annotation", False)


def kind_times(averages, steps: int) -> tuple[str, dict[str, float]]:
    """(clock, {kind: ms per step}) from a profile's ``key_averages()`` over ``steps``
    steps: the device's self time when any device event was recorded ("gpu"), else every
    op's self CPU time ("cpu"). Kinds with no time are left out; "total" is their sum."""
    device = [e for e in averages if _on_device(e)]
    clock = "gpu" if device else "cpu"
    times: dict[str, float] = {}
    for event in device or averages:
        us = event.self_device_time_total if device else event.self_cpu_time_total
        kind = kind_of(event.key)
        times[kind] = times.get(kind, 0.0) + us / 1e3 / steps
    ordered = {kind: times[kind] for kind in KIND_NAMES if times.get(kind)}
    ordered["total"] = sum(ordered.values())
    return clock, ordered


def kinds_line(times: dict[str, float]) -> str:
    """``matmul 101.2 · attention 20.3 · … ms`` in ``KIND_NAMES`` order, largest kinds kept."""
    parts = [f"{kind} {ms:.1f}" for kind, ms in times.items() if kind != "total"]
    return " · ".join(parts) + f" (total {times['total']:.1f}) ms"


def difference_line(times: dict[str, float], anchor: dict[str, float]) -> str:
    """Each kind's ms per step minus the anchor loop's, largest differences first (those
    under 0.05 ms left out)."""
    kinds = [k for k in dict.fromkeys([*times, *anchor]) if k != "total"]
    deltas = [(times.get(k, 0.0) - anchor.get(k, 0.0), k) for k in kinds]
    deltas = sorted((d for d in deltas if abs(d[0]) >= 0.05), key=lambda d: -abs(d[0]))
    total = times["total"] - anchor["total"]
    return "".join(f"{k} {d:+.1f}, " for d, k in deltas) + f"total {total:+.1f} ms"


def kinds_table(kinds: dict[str, dict]):
    """A rich table: a row per kind, a column per loop (ms per step), each loop after the
    first with its difference to the first in brackets."""
    from rich.table import Table

    names = list(kinds)
    clocks = sorted({entry["clock"] for entry in kinds.values()})
    table = Table(title=f"ms per step by kind ({' and '.join(clocks)} time)")
    table.add_column("kind")
    for name in names:
        table.add_column(name.split(" tp=")[0], justify="right")
    first = kinds[names[0]]["ms_per_step"]
    present = {k for entry in kinds.values() for k in entry["ms_per_step"]}
    for kind in [k for k in (*KIND_NAMES, "total") if k in present]:
        cells = []
        for name in names:
            ms = kinds[name]["ms_per_step"].get(kind, 0.0)
            delta = ms - first.get(kind, 0.0)
            cells.append(f"{ms:.2f}" if name == names[0] else f"{ms:.2f} ({delta:+.2f})")
        table.add_row(kind, *cells)
    return table
