"""bootstrap_rank: how every entry point joins the mesh, in one place.

The trainer, the classifier, evaluation, generation and the studies each used to pick a
backend, initialize parallel_state and split the cores in their own way. Here the run's
:class:`ParallelDims` (built once from the config or command line) becomes a
:class:`ParallelState`: the backend from the device choice, the rendezvous bounded by its
timeout (a one-line stop, not a hang), and each CPU rank's share of the cores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import parallel_state
from engine.launching import share_cores, watch_launcher
from engine.resilience.rendezvous import rendezvous
from parallel_state import ParallelDims, ParallelState
from parallel_state.launcher import detect_launch

__all__ = ["bootstrap_rank"]


def world_size() -> int:
    """Ranks in the job: the existing default group's (a test harness, a notebook), else
    the launcher's (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else detect_launch().world_size


def bootstrap_rank(
    dims: ParallelDims | Callable[[int], ParallelDims],
    *,
    device: str = "auto",
    backend: str | None = None,
    rendezvous_timeout_s: float | None = None,
    run_dir: str | None = None,
    timeout_key: str = "trainer.rendezvous_timeout_s",
    say: Callable[[ParallelState, str], None] | None = None,
    warn: bool = False,
    split_cores: bool = True,
    max_threads: int | None = None,
) -> ParallelState:
    """This rank's ParallelState for ``dims``: one call per process, before any compute.

    ``dims`` is the layout, or a function from the world size to it (for ``dp_size=auto``).

    ``device`` ("auto", "cuda", "cpu") chooses the backend unless ``backend`` names one.
    With ``rendezvous_timeout_s`` the join is bounded (config key ``timeout_key`` named in
    the line; the run log in ``run_dir``). ``say(ps, line)`` receives the thread-split line, if any;
    ``warn``: say when GPUs are there but too few (one process of the job should);
    ``split_cores=False`` leaves the thread count alone (a benchmark that sets its own);
    ``max_threads`` caps a rank's share of the cores.
    """
    if callable(dims):
        dims = dims(world_size())
    local = detect_launch().local_world_size
    backend = backend or parallel_state.backend_for(device, local, warn=warn)

    def join() -> ParallelState:
        return parallel_state.initialize(dims, backend=backend)

    if rendezvous_timeout_s is None:
        ps = join()
    else:
        ps = rendezvous(join, timeout_s=rendezvous_timeout_s, run_dir=run_dir, key=timeout_key)
    watch_launcher(ps.rank)  # self-launched: end with the process that started this rank
    threads = share_cores(ps, max_threads=max_threads) if split_cores else None
    if threads and say is not None:
        say(ps, threads)
    return ps


def cap_device_memory(cap_gib: float, device: torch.device) -> None:
    """Hold a GPU rank to ``trainer.memory_cap_gib`` (its allocator then raises an
    out-of-memory error past it, as a smaller GPU would). CPU ranks have no allocator cap:
    there the preflight holds the estimate to it and the log's peak_mem shows the use."""
    if cap_gib > 0 and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
