"""Start local worker processes the way ``torchrun`` would, for entry points run without one.

``python -m engine.pretrain`` and ``python -m engine.classify`` call :func:`launch_workers`
when no launcher (torchrun, srun, mpirun) started them. One node uses a standalone c10d
rendezvous on a free localhost port; several nodes use torchrun's static rendezvous: each
node runs the same command with its own ``node_rank``, and node 0's ``master_addr:port``
hosts the store.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any


def launch_workers(
    fn: Callable[..., Any],
    *args: Any,
    nproc_per_node: int,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    max_restarts: int = 0,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc_per_node`` processes here; return results by global rank.

    Workers get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), so
    ``parallel_state.initialize`` finds them as it would under torchrun.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if num_nodes == 1:
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=str(uuid.uuid4()))
    else:  # every node must name the same run and endpoint: nothing random here
        rdzv = dict(rdzv_backend="static", rdzv_endpoint=f"{master_addr}:{master_port}",
                    run_id="meshtron", rdzv_configs={"rank": node_rank})  # fmt: skip
    config = LaunchConfig(
        min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=nproc_per_node,
        max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn", **rdzv,
    )  # fmt: skip
    if max_restarts:
        # The agent otherwise shares one TCPStore across restarts, where the restarted
        # workers' gloo rendezvous reads the dead workers' stale addresses; a store per
        # attempt (hosted by the new rank 0) starts each attempt clean.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return elastic_launch(config, fn)(*args)


def share_cores(ps) -> None:
    """Give each CPU rank its share of this machine's cores, as torchrun does, unless
    OMP_NUM_THREADS says otherwise: oversubscribed intra-op threads spin against each
    other and can slow a step down several-fold. ``ps``: the rank's ParallelState."""
    import torch

    from parallel_state.launcher import detect_launch

    if ps.device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    info = detect_launch()
    # No launcher (a test harness, a notebook): assume every rank shares this machine.
    local = ps.world_size if info.launcher == "none" else info.local_world_size or 1
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
