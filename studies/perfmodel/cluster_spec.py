"""Cluster specs: the YAML files under configs/cluster/, read into a typed ClusterSpec.

Schema (every number says where it comes from in a ``source`` string next to it):

- ``name``, ``gpus_per_node`` (ranks per node);
- ``intra_node: {bandwidth_GBps, latency_us}``: one direction, per rank, inside a node
  (optional ``by_ranks: {p: {bandwidth_GBps, latency_us}}``, measured per group size);
- ``inter_node: {bandwidth_Gbps, latency_us}``: one direction, the whole node's network;
- ``device: {peak_tflops, mem_bandwidth_TBps, memory_gib}`` plus optional measured
  ``gemm_table`` ([m, n, k, tflops] rows), ``op_overhead_us`` (host time per operator),
  ``cores`` and ``thread_efficiency`` (CPU ranks share the cores), ``rank_speed``
  ({ranks: speed of one single-thread rank while that many compute at once}), ``reserved_gib``
  (runtime memory outside the model: CUDA context, NCCL buffers, library workspaces);
- ``efficiency: {gemm, memory, network}``: the fraction of peak a large GEMM, a streaming
  kernel and a collective reach (global per device, never per workload), and ``gemm_k0``:
  the per-tile fixed cost of a GEMM in steps of its reduction length (efficiency
  × k/(k + k0); 0 or absent: none);
- ``collectives`` (algorithms the library chooses from), ``overlap_efficiency`` (how much
  of backward can hide communication: 0 when communication needs the busy cores),
  ``precision`` (default training precision on this device), ``max_nodes`` (a single
  machine says 1);
- ``in_model`` (CPU ranks): what collectives and the optimizer phase cost inside real
  training steps, measured by short trainer runs (studies/perfmodel/in_model_runs.py).

Unknown keys (e.g. the emulated clusters' ``emulation``) are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from studies.perfmodel.in_model import parse as parse_in_model

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "cluster"


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in bytes/s (one direction) and latency α in seconds."""

    bandwidth_Bps: float
    latency_s: float


@dataclass(frozen=True)
class ClusterSpec:
    """What the performance model needs to know about a cluster (see the module docstring)."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link  # the whole node's network bandwidth
    peak_flops: float
    mem_bandwidth_Bps: float
    memory_bytes: float
    gemm_efficiency: float = 0.8
    gemm_k0: float = 0.0  # per-tile fixed cost, in reduction steps (compute.reduction_factor)
    memory_efficiency: float = 0.8
    network_efficiency: float = 0.8
    gemm_table: tuple[tuple[int, int, int, float], ...] = ()  # (m, n, k, FLOP/s) measured
    op_overhead_s: float = 0.0
    cores: int | None = None
    thread_efficiency: float = 1.0
    rank_speed: dict[int, float] = field(default_factory=dict)  # measured, one thread per rank
    collectives: tuple[str, ...] = ("ring", "tree")
    overlap_efficiency: float = 1.0
    precision: str = "bf16"
    max_nodes: int | None = None  # None: as many as asked for
    reserved_bytes: float = 0.0  # runtime memory outside the model (context, NCCL, workspaces)
    intra_by_ranks: dict[int, Link] = field(default_factory=dict)  # measured per group size
    compute_scale: dict[int, float] = field(default_factory=dict)  # by hidden size (in_model.py)
    in_model: dict[str, tuple] = field(default_factory=dict)  # measured in training (in_model.py)
    extras: dict[str, Any] = field(default_factory=dict, compare=False)


def _need(section: dict, key: str, where: str) -> float:
    value = section.get(key)
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}.{key}={value!r} must be a positive number")
    return float(value)


def _by_size(value: Any) -> dict[int, float]:
    """A measured factor per size ({hidden: factor}); a lone number applies to every size
    (one entry is the nearest for any size)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {int(k): float(v) for k, v in value.items()}
    return {1: float(value)}


def scale_for(table: dict[int, float], size: int) -> float:
    """The factor measured at the size nearest to ``size`` (in log space); 1 without any."""
    if not table:
        return 1.0
    return table[min(table, key=lambda k: abs(math.log(k / size)))]


def cluster_from_dict(raw: dict[str, Any]) -> ClusterSpec:
    """Build a ClusterSpec from a parsed YAML mapping; raise ValueError naming a bad field."""
    name = str(raw.get("name", "?"))
    for key in ("intra_node", "inter_node", "device"):
        if not isinstance(raw.get(key), dict):
            raise ValueError(f"cluster {name}: {key} must be a mapping (see configs/cluster/)")
    intra, inter, dev = raw["intra_node"], raw["inter_node"], raw["device"]
    eff = raw.get("efficiency") or {}
    table = tuple(
        (int(m), int(n), int(k), float(tf) * 1e12) for m, n, k, tf in dev.get("gemm_table") or ()
    )
    return ClusterSpec(
        name=name,
        gpus_per_node=int(_need(raw, "gpus_per_node", name)),
        intra=Link(
            _need(intra, "bandwidth_GBps", f"{name}.intra_node") * 1e9,
            float(intra.get("latency_us", 0.0)) * 1e-6,
        ),
        inter=Link(
            _need(inter, "bandwidth_Gbps", f"{name}.inter_node") * 1e9 / 8,
            float(inter.get("latency_us", 0.0)) * 1e-6,
        ),
        peak_flops=_need(dev, "peak_tflops", f"{name}.device") * 1e12,
        mem_bandwidth_Bps=_need(dev, "mem_bandwidth_TBps", f"{name}.device") * 1e12,
        memory_bytes=_need(dev, "memory_gib", f"{name}.device") * 2**30,
        gemm_efficiency=float(eff.get("gemm", 0.8)),
        gemm_k0=float(eff.get("gemm_k0", 0.0)),
        memory_efficiency=float(eff.get("memory", 0.8)),
        network_efficiency=float(eff.get("network", 0.8)),
        gemm_table=table,
        op_overhead_s=float(dev.get("op_overhead_us", 0.0)) * 1e-6,
        cores=int(dev["cores"]) if dev.get("cores") else None,
        thread_efficiency=float(dev.get("thread_efficiency", 1.0)),
        rank_speed={int(p): float(v) for p, v in (dev.get("rank_speed") or {}).items()},
        collectives=tuple(raw.get("collectives") or ("ring", "tree")),
        overlap_efficiency=float(raw.get("overlap_efficiency", 1.0)),
        precision=str(raw.get("precision", "bf16")),
        max_nodes=int(raw["max_nodes"]) if raw.get("max_nodes") else None,
        reserved_bytes=float(dev.get("reserved_gib", 0.0)) * 2**30,
        intra_by_ranks={
            int(p): Link(float(v["bandwidth_GBps"]) * 1e9, float(v["latency_us"]) * 1e-6)
            for p, v in (intra.get("by_ranks") or {}).items()
        },
        compute_scale=_by_size(dev.get("compute_scale")),
        in_model=parse_in_model(raw.get("in_model")) if raw.get("in_model") else {},
        extras={k: v for k, v in raw.items() if k not in _KNOWN},
    )


_KNOWN = {
    "name",
    "gpus_per_node",
    "intra_node",
    "inter_node",
    "device",
    "efficiency",
    "collectives",
    "overlap_efficiency",
    "precision",
    "defaults",
    "max_nodes",
    "in_model",
}


def cluster_names(directory: Path = CLUSTER_DIR) -> list[str]:
    """The cluster specs shipped under configs/cluster/."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def load_cluster(
    name_or_path: str, directory: Path = CLUSTER_DIR, base: str | None = None
) -> ClusterSpec:
    """Read ``configs/cluster/NAME.yaml`` (or a YAML file path) into a ClusterSpec.

    With ``base`` (another spec), what the file leaves out is taken from it, section by
    section: an emulated cluster's links over this machine's calibrated compute.
    """
    raw = _read(name_or_path, directory)
    if base:
        under = _read(base, directory)
        for key, value in under.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                # null in the file ("measured per study") leaves the base's figure
                raw[key] = {**value, **{k: v for k, v in raw[key].items() if v is not None}}
            else:
                raw.setdefault(key, value)
    return cluster_from_dict(raw)


def _read(name_or_path: str, directory: Path) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.suffix:
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(
            f"cluster {name_or_path!r} not found; choose one of {cluster_names(directory)} "
            "or give a YAML path"
        )
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    raw.setdefault("name", path.stem)
    return raw
