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
  (runtime memory outside the model: CUDA context, NCCL buffers, library workspaces),
  ``memory_shared`` (true: ``memory_gib`` is the whole node's, which its ranks share, as
  CPU ranks share the host's RAM; a rank then has it split over the ranks on its node);
- ``efficiency: {gemm, memory, network}``: the fraction of peak a large GEMM, a streaming
  kernel and a collective reach (global per device, never per workload), and ``gemm_k0``:
  the per-tile fixed cost of a GEMM in steps of its reduction length (efficiency
  × k/(k + k0); 0 or absent: none);
- ``collectives`` (algorithms the library chooses from), ``overlap_efficiency`` (how much
  of backward can hide communication: 0 when communication needs the busy cores),
  ``precision`` (default training precision on this device), ``max_nodes`` (a single
  machine says 1);
- ``host: {link_GBps, adam_GBps}`` (optional; what ``offload=optimizer`` pays): one
  direction of each GPU's host link (default 64, PCIe Gen5 x16) and the optimizer state
  (fp32 master and two moments) one rank's CPU Adam sweeps per second (default 4: an
  assumption, a node's host memory bandwidth shared by its ranks, not a measurement);
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

from engine.data.fsutil import MISSING, file_problem
from studies.perfmodel.in_model import parse as parse_in_model

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "cluster"


# Defaults of the ``host`` section (docstring above): PCIe Gen5 x16 carries ~64 GB/s each
# way; the CPU Adam rate is an assumption (a few GB/s of state per rank), stated as such.
HOST_LINK_GBPS = 64.0
HOST_ADAM_GBPS = 4.0


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
    memory_shared: bool = False  # memory_bytes is the node's, split over its ranks (CPU hosts)
    intra_by_ranks: dict[int, Link] = field(default_factory=dict)  # measured per group size
    compute_scale: dict[int, float] = field(default_factory=dict)  # by hidden size (in_model.py)
    in_model: dict[str, tuple] = field(default_factory=dict)  # measured in training (in_model.py)
    host_link_Bps: float = HOST_LINK_GBPS * 1e9  # one direction, per GPU (optimizer offload)
    host_adam_Bps: float = HOST_ADAM_GBPS * 1e9  # optimizer state one rank's CPU Adam sweeps/s
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def rank_memory_bytes(self, gpus: int) -> float:
        """The memory one of ``gpus`` ranks may hold: a device's, or with ``memory_shared``
        the node's split evenly over the ranks on it (``gpus`` up to a node's worth)."""
        if not self.memory_shared:
            return self.memory_bytes
        return self.memory_bytes / min(gpus, self.gpus_per_node)

    def memory_words(self, gpus: int) -> str:
        """What :meth:`rank_memory_bytes` is, in words, for a "does not fit" line."""
        gib = self.rank_memory_bytes(gpus) / 2**30
        if not self.memory_shared:
            return f"the {gib:.1f} GiB of a {self.name} GPU"
        ranks = min(gpus, self.gpus_per_node)
        return (
            f"the {gib:.1f} GiB each of {ranks} rank(s) has of a {self.name} node's shared "
            f"{self.memory_bytes / 2**30:.1f} GiB"
        )


COLLECTIVES = ("ring", "tree")  # the all-reduce algorithms comm_cost prices
PRECISIONS = ("bf16", "fp16", "fp32")
# A number's allowed range: (test, words for the error line).
POSITIVE = (lambda v: v > 0, "a finite number > 0")
NON_NEGATIVE = (lambda v: v >= 0, "a finite number >= 0")
FRACTION = (lambda v: 0 < v <= 1, "a number in (0, 1]")
SHARE = (lambda v: 0 <= v <= 1, "a number in [0, 1]")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(section: dict, key: str, where: str, rule=POSITIVE, default: float | None = None):
    """``section[key]`` as a float within ``rule``; ``default`` when absent or null (None:
    required). ValueError naming ``where.key``, the value and the range otherwise."""
    value = section.get(key)
    if value is None and default is not None:
        return float(default)
    if not (_is_number(value) and rule[0](value)):
        raise ValueError(f"{where}.{key}={value!r} must be {rule[1]}")
    return float(value)


def _count(section: dict, key: str, where: str, *, required: bool = True) -> int | None:
    """``section[key]`` as an integer >= 1 (None when absent or null and not required)."""
    value = section.get(key)
    if value is None and not required:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"{where}.{key}={value!r} must be an integer >= 1")
    return value


def _section(raw: dict, key: str, where: str, *, required: bool = True) -> dict:
    """A mapping section (an empty one when absent or null and not required)."""
    value = raw.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}.{key} must be a mapping, not {value!r:.60} (see configs/cluster/)"
        )
    return value


def _by_count(value: Any, where: str, rule=POSITIVE) -> dict[int, Any]:
    """A mapping {integer >= 1: value} checked key by key; values checked by ``rule``
    (None: returned as they are, for the caller to check)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping {{integer >= 1: value}}, not {value!r:.60}")
    for k, v in value.items():
        if type(k) is not int or k < 1:
            raise ValueError(f"{where} has key {k!r}: keys must be integers >= 1")
        if rule is not None and not (_is_number(v) and rule[0](v)):
            raise ValueError(f"{where}.{k}={v!r} must be {rule[1]}")
    return value


def _by_size(value: Any, where: str) -> dict[int, float]:
    """A measured factor per size ({hidden: factor}); a lone number applies to every size
    (one entry is the nearest for any size)."""
    if value is None:
        return {}
    if _is_number(value) and value > 0:
        return {1: float(value)}
    return {k: float(v) for k, v in _by_count(value, where).items()}


def scale_for(table: dict[int, float], size: int) -> float:
    """The factor measured at the size nearest to ``size`` (in log space); 1 without any."""
    if not table:
        return 1.0
    return table[min(table, key=lambda k: abs(math.log(k / size)))]


def _link(section: dict, bandwidth: str, scale: float, where: str) -> Link:
    return Link(
        _number(section, bandwidth, where) * scale,
        _number(section, "latency_us", where, NON_NEGATIVE, 0.0) * 1e-6,
    )


def _gemm_table(rows: Any, where: str) -> tuple[tuple[int, int, int, float], ...]:
    """[m, n, k, TFLOP/s] rows as (m, n, k, FLOP/s)."""
    if rows is None:
        return ()
    ok = isinstance(rows, list) and all(
        isinstance(r, list)
        and len(r) == 4
        and all(type(d) is int and d >= 1 for d in r[:3])
        and _is_number(r[3])
        and r[3] > 0
        for r in rows
    )
    if not ok:
        raise ValueError(f"{where}.gemm_table must be a list of [m, n, k, tflops] rows")
    return tuple((m, n, k, float(tf) * 1e12) for m, n, k, tf in rows)


def _device_fields(dev: dict, where: str) -> dict[str, Any]:
    """The ClusterSpec fields of the ``device`` section."""
    memory = _number(dev, "memory_gib", where)
    reserved = _number(dev, "reserved_gib", where, NON_NEGATIVE, 0.0)
    if reserved >= memory:
        raise ValueError(f"{where}.reserved_gib={reserved} must be below memory_gib={memory}")
    shared = dev.get("memory_shared", False)
    if not isinstance(shared, bool):
        raise ValueError(f"{where}.memory_shared={shared!r} must be true or false")
    return {
        "memory_shared": shared,
        "peak_flops": _number(dev, "peak_tflops", where) * 1e12,
        "mem_bandwidth_Bps": _number(dev, "mem_bandwidth_TBps", where) * 1e12,
        "memory_bytes": memory * 2**30,
        "reserved_bytes": reserved * 2**30,
        "gemm_table": _gemm_table(dev.get("gemm_table"), where),
        "op_overhead_s": _number(dev, "op_overhead_us", where, NON_NEGATIVE, 0.0) * 1e-6,
        "cores": _count(dev, "cores", where, required=False),
        "thread_efficiency": _number(dev, "thread_efficiency", where, SHARE, 1.0),  # 0: no gain
        "rank_speed": {
            p: float(v)
            for p, v in _by_count(dev.get("rank_speed") or {}, f"{where}.rank_speed").items()
        },
        "compute_scale": _by_size(dev.get("compute_scale"), f"{where}.compute_scale"),
    }


def _options(raw: dict, name: str) -> dict[str, Any]:
    """The ClusterSpec fields outside the links and the device: efficiencies and choices."""
    eff = _section(raw, "efficiency", name, required=False)
    where = f"{name}.efficiency"
    collectives = raw.get("collectives") or list(COLLECTIVES)
    if not isinstance(collectives, list) or not set(collectives) <= set(COLLECTIVES):
        raise ValueError(f"{name}.collectives={collectives!r} must be a list of {COLLECTIVES}")
    precision = raw.get("precision", "bf16")
    if precision not in PRECISIONS:
        raise ValueError(f"{name}.precision={precision!r} must be one of {PRECISIONS}")
    host = _section(raw, "host", name, required=False)
    return {
        "host_link_Bps": _number(host, "link_GBps", f"{name}.host", POSITIVE, HOST_LINK_GBPS) * 1e9,
        "host_adam_Bps": _number(host, "adam_GBps", f"{name}.host", POSITIVE, HOST_ADAM_GBPS) * 1e9,
        "gemm_efficiency": _number(eff, "gemm", where, FRACTION, 0.8),
        "gemm_k0": _number(eff, "gemm_k0", where, NON_NEGATIVE, 0.0),
        "memory_efficiency": _number(eff, "memory", where, FRACTION, 0.8),
        "network_efficiency": _number(eff, "network", where, FRACTION, 0.8),
        "collectives": tuple(collectives),
        "overlap_efficiency": _number(raw, "overlap_efficiency", name, SHARE, 1.0),
        "precision": precision,
        "max_nodes": _count(raw, "max_nodes", name, required=False),
    }


def cluster_from_dict(raw: dict[str, Any]) -> ClusterSpec:
    """Build a ClusterSpec from a parsed YAML mapping; raise ValueError (one line) naming a
    bad field, its value and the allowed range."""
    name = str(raw.get("name", "?"))
    intra = _section(raw, "intra_node", name)
    inter = _section(raw, "inter_node", name)
    dev = _section(raw, "device", name)
    by_ranks = _by_count(intra.get("by_ranks") or {}, f"{name}.intra_node.by_ranks", None)
    return ClusterSpec(
        name=name,
        gpus_per_node=_count(raw, "gpus_per_node", name),
        intra=_link(intra, "bandwidth_GBps", 1e9, f"{name}.intra_node"),
        inter=_link(inter, "bandwidth_Gbps", 1e9 / 8, f"{name}.inter_node"),
        **_device_fields(dev, f"{name}.device"),
        **_options(raw, name),
        intra_by_ranks={
            p: _link(
                _section(by_ranks, p, f"{name}.intra_node.by_ranks"),
                "bandwidth_GBps",
                1e9,
                f"{name}.intra_node.by_ranks.{p}",
            )
            for p in by_ranks
        },
        in_model=parse_in_model(_section(raw, "in_model", name, required=False), name),
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
    "host",
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
    raw, path = _read(name_or_path, directory)
    if not base and (unset := _null_figures(raw)):
        more = f" and {len(unset) - 2} more" if len(unset) > 2 else ""
        raise ValueError(
            f"{path}: {', '.join(unset[:2])}{more} are null (measured per study): this spec "
            "describes links over another's compute; fill the rest from a calibrated spec "
            "with --compute-from (e.g. --compute-from cpu_2core)"
        )
    if base and not _null_figures(raw):  # the flag would be ignored without a word
        raise ValueError(
            f"{path}: --compute-from {base} fills the figures a spec leaves null, and this "
            "one leaves none: drop --compute-from"
        )
    if base:
        under, _ = _read(base, directory)
        for key, value in under.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                # null in the file ("measured per study") leaves the base's figure
                raw[key] = {**value, **{k: v for k, v in raw[key].items() if v is not None}}
            else:
                raw.setdefault(key, value)
    try:
        return cluster_from_dict(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _null_figures(raw: dict[str, Any]) -> list[str]:
    """``section.key`` of every null figure of a spec's sections (an emulated cluster's
    "measured per study"); their ``source`` lines aside."""
    return [
        f"{name}.{key}"
        for name, section in raw.items()
        if isinstance(section, dict)
        for key, value in section.items()
        if value is None and key != "source"
    ]


def _read(name_or_path: str, directory: Path) -> tuple[dict[str, Any], Path]:
    """The parsed mapping of a cluster YAML, and its path; ValueError (one line) naming the
    file when it is missing, unreadable, not YAML, or not a mapping."""
    path = Path(name_or_path)
    if not path.suffix:
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        problem = file_problem(name_or_path)  # what the name is where it names something
        if problem not in (None, MISSING):
            raise ValueError(
                f"cluster {name_or_path!r} {problem}, not a cluster spec; give a cluster YAML "
                f"file (e.g. configs/cluster/dgx_h100.yaml) or one of {cluster_names(directory)}"
            )
        raise ValueError(
            f"cluster {name_or_path!r} not found; choose one of {cluster_names(directory)} "
            "or give a YAML path"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, RecursionError, yaml.YAMLError) as err:
        why = " ".join(str(err).split())[:160] or type(err).__name__
        raise ValueError(f"{path}: not a readable YAML file ({why})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a YAML mapping of the cluster's keys (see configs/cluster/)")
    raw.setdefault("name", path.stem)
    return raw, path
