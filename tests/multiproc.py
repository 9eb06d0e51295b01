"""Run a test body on N real ranks (separate processes, gloo) and bring back results or errors.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo
process group in each through a FileStore (no port to collide on), calls
``fn(*args, **kwargs)`` and returns the per-rank results in rank order. A failing rank's
traceback is re-raised in the test; a run that does not finish in ``timeout`` seconds is
killed with a message naming the ranks that were still running.

``fn`` must be a module-level function (it is pickled by name). Processes come from a
forkserver that has torch preloaded, so each rank starts in milliseconds rather than
paying a fresh ``import torch``.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy"])


class RankFailure(AssertionError):
    """A rank raised; the message carries its traceback."""


def _worker(rank, world_size, store_path, fn, args, kwargs, results, collective_timeout):
    os.environ.pop("RANK", None)  # never let a surrounding launcher's variables leak in
    torch.set_num_threads(1)  # several ranks share 2 cores: avoid oversubscription
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        out = fn(*args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import parallel_state

        parallel_state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank."""
    with tempfile.TemporaryDirectory(prefix="meshtron-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        results = _CTX.Queue()
        procs = [
            _CTX.Process(
                target=_worker,
                args=(r, world_size, store_path, fn, args, kwargs, results, timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        try:
            while len(outputs) < world_size:
                try:
                    rank, status, payload = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                        "(a collective is probably waiting on a rank that took another path)"
                    ) from None
                if status == "error":
                    raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
                outputs[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        return [outputs[r] for r in range(world_size)]
