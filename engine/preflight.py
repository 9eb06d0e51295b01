"""Checks that need more than the config's own values, made before any worker starts.

- Memory: a run whose parameters, gradients, optimizer state and activations cannot fit
  in the device's memory is refused with the numbers, rather than dying in an allocation
  (or swapping the machine to a halt) after the workers started.
- Resume: a checkpoint directory that holds another model's run is named, rather than
  each rank raising its own traceback when it loads it.
- Output paths: the checkpoint directory and the metrics file are test-written, and what
  the test created is removed again, so that a refused run leaves nothing on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import Config, resolve_precision
from engine.flops import params_count
from engine.formulas import fsdp_in_flight_bytes, state_bytes_per_param
from engine.models.activation_memory import formula_bytes
from parallel_state.dims import resolve_dp_shard

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for training, by kind, on its device; ``host``: what
    ``parallel.offload=optimizer`` keeps in host memory instead (not in ``total``)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    host: float = 0.0

    @property
    def total(self) -> float:
        """Everything together."""
        return self.params + self.grads + self.optimizer + self.activations


def estimate_rank_bytes(
    cfg: Config, dp_size: int, *, fp32_activations: bool, bf16: bool = False
) -> MemoryEstimate:
    """What one rank holds while training ``cfg`` at ``tp_size`` × ``dp_size``.

    Parameters are split over TP (the few replicated LayerNorm and bias vectors are
    ignored) and, by ``parallel.dp_shard``, over DP (engine.formulas; under HSDP over the
    dp ÷ ``parallel.dp_replicate`` ranks of one replica); under FSDP the units gathered in
    flight count as parameters. Activations per layer follow the family's
    formula (``costs.layer_activation_bytes``: 16-bit activations; doubled for fp32 ones),
    plus the fp32 logits of one micro-batch
    over this rank's vocabulary shard. It is a floor, not a bound: allocator slack and
    temporaries come on top, so a config refused here could never run.

    ``parallel.offload=optimizer`` moves the optimizer term (masters and moments) to the
    host, with ZeRO-1's host copy of its gradient slice (4/dp); under FSDP torch's
    ``CPUOffloadPolicy`` moves the sharded gradients too (the gathered units stay).
    """
    m, t = cfg.model, cfg.parallel.tp
    params = params_count(m) / t
    root = params_count(dataclasses.replace(m, num_layers=0)) / t  # embeddings, norm, head
    s, b = cfg.data.seq_len, cfg.trainer.micro_batch
    per_layer = formula_bytes(m, seq_len=s, batch_size=b, tp_size=t)
    logits = 4 * s * b * m.padded_vocab_size(t) / t
    activations = per_layer * m.num_layers * (2 if fp32_activations else 1) + logits
    precision = "bf16" if bf16 else "fp32"
    mode = _dp_shard(cfg)
    shards = max(1, dp_size // max(1, cfg.parallel.dp_replicate))  # ranks a shard splits over
    weights, grads, optimizer = state_bytes_per_param(precision, mode, shards)
    layer = (params - root) / max(1, m.num_layers)
    in_flight = fsdp_in_flight_bytes(layer, root, precision, mode)  # FSDP's gathered units
    host = 0.0
    if cfg.parallel.offload == "optimizer" and mode != "none":
        moved_grads = grads if mode in ("gradients", "full") else 4.0 / shards
        host, optimizer = (optimizer + moved_grads) * params, 0.0
        grads = 0.0 if mode in ("gradients", "full") else grads
    return MemoryEstimate(
        weights * params + in_flight, grads * params, optimizer * params, activations, host
    )


def models_fit_problem(
    cfg, *, copies: int = 1, tp: int = 1, dp: int = 1, on_gpu: bool = False, bytes_per_param=16
) -> str | None:
    """Why ``copies`` trainable copies of model ``cfg`` (fp32 weights, a gradient and Adam's
    two moments: ``bytes_per_param``, activations aside) split over ``tp`` ranks and held by
    ``dp`` replicas cannot fit this machine, else None: per GPU on a GPU, the whole host's
    free RAM on a CPU (every rank is a process here). A benchmark's guard, in one line,
    before anything is allocated."""
    from engine.flops import params_count

    n = params_count(cfg)
    per_rank = bytes_per_param * n * copies / tp
    if on_gpu:
        have, need, where = torch.cuda.get_device_properties(0).total_memory, per_rank, "per GPU"
    else:
        have, need, where = available_ram_bytes(), per_rank * tp * dp, "of free RAM"
    if have is None or need <= have:
        return None
    many = f" × {copies} models" if copies > 1 else ""
    return (
        f"{n / 1e9:.2f} B parameters{many} need about {need / GIB:.1f} GiB for weights and "
        f"AdamW state, and this machine has {have / GIB:.1f} GiB {where}: choose a smaller model"
    )


def available_ram_bytes() -> int | None:
    """Memory the kernel says new allocations can get (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg: Config, local_ranks: int, *, on_gpu: bool) -> list[str]:
    """One line when ``cfg`` cannot fit in this machine's device memory, or in
    ``trainer.memory_cap_gib`` per rank when that is set, else nothing.

    ``on_gpu``: every rank has a GPU of its own; else the ``local_ranks`` processes on
    this machine share its free RAM.
    """
    cuda = on_gpu
    precision = resolve_precision(cfg.trainer.precision, "cuda" if cuda else "cpu")
    fp32, bf16 = precision == "fp32", precision == "bf16"
    need = estimate_rank_bytes(cfg, int(cfg.parallel.dp), fp32_activations=fp32, bf16=bf16)
    total = need.total
    if cuda:
        have, sharing, where = torch.cuda.get_device_properties(0).total_memory, 1, "GPU"
    else:  # the host is the device: what is offloaded takes the same RAM
        have, sharing, where = available_ram_bytes(), max(1, local_ranks), "free RAM"
        total += need.host
    cap = cfg.trainer.memory_cap_gib * GIB
    if cap > 0 and (have is None or cap * sharing <= have):
        have, sharing, where = cap, 1, "cap (trainer.memory_cap_gib)"
    if have is None or total * sharing <= have:
        return []
    ranks = f" × {sharing} ranks on this machine" if sharing > 1 else ""
    return [
        f"the model cannot fit: about {total / GIB:.2f} GiB per rank (parameters "
        f"{need.params / GIB:.2f} + gradients {need.grads / GIB:.2f} + optimizer "
        f"{need.optimizer / GIB:.2f} + activations {need.activations / GIB:.2f} GiB"
        f"{_host_part(need)}; "
        f"model.hidden_size={cfg.model.hidden_size} model.num_layers={cfg.model.num_layers} "
        f"trainer.micro_batch={cfg.trainer.micro_batch} data.seq_len={cfg.data.seq_len} "
        f"parallel.dp_shard={_dp_shard(cfg)} dp_size={cfg.parallel.dp})"
        f"{ranks}, but the {where} is {have / GIB:.2f} GiB per {'machine' if ranks else 'rank'}; "
        "use a smaller model or micro-batch, a larger tp_size, or shard over DP "
        "(parallel.dp_shard=optimizer, gradients or full)"
    ]


def _host_part(need: MemoryEstimate) -> str:
    """The offloaded bytes, as the memory line says them (nothing when none are)."""
    if not need.host:
        return ""
    return f", and {need.host / GIB:.2f} GiB of optimizer state in host memory (parallel.offload)"


def _dp_shard(cfg: Config) -> str:
    """The DP sharding mode of ``cfg`` (its ``optim.distributed`` spelling resolved)."""
    return resolve_dp_shard(cfg.parallel.dp_shard, cfg.optim.distributed)


def probe_writable(path: Path, *, directory: bool) -> str | None:
    """None when ``path`` (a directory, or a file) can be created and written, else why.

    Leaves the disk as it found it: the missing parents made for the test, and the probe
    file, are removed again (the run creates them for real once nothing refused it).
    """
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        kind = "a file; give a directory" if directory else "a directory; give a file path"
        return f"{path} is {kind}"
    made, parent = [], path if directory else path.parent
    while not parent.exists() and parent != parent.parent:
        made.append(parent)
        parent = parent.parent
    # Appending to an existing file changes nothing; a new one is removed after the test.
    probe = path / f".write-test-{os.getpid()}" if directory else path
    new_probe = not probe.exists()
    # The ranks a launcher starts probe the same path at once: a folder another rank made
    # (or removed again) between our steps is no reason to refuse, so retry a few times.
    for attempt in range(5):
        try:
            for p in reversed(made):
                p.mkdir(exist_ok=True)
            with open(probe, "a"):
                pass
            return None
        except FileNotFoundError as err:
            if attempt == 4:
                return f"{err.filename or path} cannot be written ({err.strerror or err})"
        except OSError as err:
            return f"{err.filename or path} cannot be written ({err.strerror or err})"
        finally:
            for p in ([probe] if new_probe else []) + made:  # made: the deepest first
                with contextlib.suppress(OSError):
                    p.rmdir() if p.is_dir() else p.unlink()
    return None
