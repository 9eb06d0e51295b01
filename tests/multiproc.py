"""Run a test body on N real ranks (separate processes, gloo) and bring back results or errors.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo
process group in each through a FileStore (no port to collide on), calls
``fn(*args, **kwargs)`` and returns the per-rank results in rank order. A failing rank's
traceback is re-raised in the test; a run that does not finish in ``timeout`` seconds is
killed with a message naming the ranks that were still running.

``fn`` must be a module-level function (it is pickled by name). Processes come from a
forkserver that has torch and the engine's worker preloaded, so each rank starts in
milliseconds rather than paying a fresh ``import torch`` and ``import engine.worker``
(several CPU seconds each, per rank: most of a small multi-rank test's cost).

``env`` names environment variables the ranks must see from their first line, before
``import torch``: e.g. ``TRITON_INTERPRET=1``, which triton honours only if it is set when
triton is first imported (and on a CUDA machine ``import torch`` may import triton). When
the forkserver already has them (it inherited this process's environment) it is used;
otherwise the ranks are spawned fresh with them.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_SPAWN = mp.get_context("spawn")
# A preload that fails to import (the forkserver started outside the checkout) is skipped
# by multiprocessing; the ranks then import it themselves, as before. torch._dynamo: a
# rank's first optimizer imports it (torch.optim wraps its methods in
# torch._disable_dynamo), 1.4 CPU seconds in every rank otherwise.
_CTX.set_forkserver_preload(
    ["torch", "torch.distributed", "numpy", "engine.worker", "torch._dynamo"]
)


class RankFailure(AssertionError):
    """A rank raised; the message carries its traceback."""


def _to_bytes(out: Any) -> bytes:
    """A rank's result as plain bytes. A tensor put on a queue as itself travels as a file
    descriptor to shared memory, which a busy machine can close before the parent reads it
    ("received 0 items of ancdata"); bytes are copied through the pipe."""
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def _worker(rank, world_size, store_path, fn, args, kwargs, results, collective_timeout):
    os.environ.pop("RANK", None)  # never let a surrounding launcher's variables leak in
    # One intra-op thread per rank, whatever the machine's core count: several ranks share
    # the cores, and the same thread count gives the same sums everywhere. OMP_NUM_THREADS
    # tells the trainer's share_cores to keep it.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        out = fn(*args, **kwargs)
        if dist.is_initialized():
            # No rank tears down while another is still inside the body: gloo's full-mesh
            # connect of a new group fails with "Connection closed by peer" on a rank whose
            # peer already finished its part of the connect and exited (seen under load).
            dist.barrier()
        results.put((rank, "ok", _to_bytes(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import parallel_state

        parallel_state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(env: dict[str, str]):
    """The forkserver when this process already has ``env`` (set before the forkserver
    started, as conftest does), else spawn, whose children inherit ``os.environ`` at start."""
    return _CTX if all(os.environ.get(k) == v for k, v in env.items()) else _SPAWN


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cpu_only(env: dict[str, str]) -> dict[str, str]:
    """Ranks that interpret the Triton kernels compute on CPU tensors. On a CUDA machine
    they are shown no GPU, so that neither triton's driver nor a lazy CUDA init reaches one
    mid-forward (activation checkpointing refuses a device initialized there)."""
    hide = env.get("TRITON_INTERPRET") == "1" and "CUDA_VISIBLE_DEVICES" not in env
    return {**env, "CUDA_VISIBLE_DEVICES": ""} if hide and torch.cuda.is_available() else env


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    A run in which a rank was killed by a signal (a crash inside native code: twice in the
    full suite on a loaded 2-core machine, a SIGSEGV in gloo's transport, the other ranks
    then failing with "Connection closed by peer") runs once more, saying so on stderr; a
    rank that raises, or a second crash, fails the test."""
    try:
        return _run_ranks(fn, world_size, args, kwargs, timeout, env)
    except _Crashed as crash:
        print(f"run_ranks: {crash}; running the {world_size} ranks once more", file=sys.stderr)
        try:
            return _run_ranks(fn, world_size, args, kwargs, timeout, env)
        except _Crashed as again:
            raise RankFailure(f"{again} (and in the run before: {crash})") from again.__cause__


class _Crashed(Exception):
    """A rank died by a signal; the error the run raised is the cause."""


def _run_ranks(fn, world_size, args, kwargs, timeout, env) -> list[Any]:
    env = _cpu_only(env or {})
    ctx = _context(env)
    with tempfile.TemporaryDirectory(prefix="meshtron-store-") as tmp, _environ(env):
        store_path = os.path.join(tmp, "store")
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, fn, args, kwargs, results, timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        failure: BaseException | None = None
        try:
            deadline = time.monotonic() + timeout
            while len(outputs) < world_size:
                try:
                    rank, status, payload = results.get(timeout=1.0)
                except queue.Empty:
                    _raise_if_gone(procs, outputs)
                    if time.monotonic() < deadline:
                        continue
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                        "(a collective is probably waiting on a rank that took another path)"
                    ) from None
                deadline = time.monotonic() + timeout
                if status == "error":
                    raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        except (RankFailure, TimeoutError) as err:
            failure = err
            raise
        finally:
            for p in procs:
                p.join(timeout=5)
            # Exit codes before any kill: a negative one is a signal the rank died of.
            signals = {r: -p.exitcode for r, p in enumerate(procs) if (p.exitcode or 0) < 0}
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            if failure is not None and signals:
                names = ", ".join(f"rank {r} by {_signal_name(n)}" for r, n in signals.items())
                raise _Crashed(f"killed: {names}") from failure
        return [outputs[r] for r in range(world_size)]


def _raise_if_gone(procs: list, outputs: dict) -> None:
    """RankFailure if a rank that has not reported was killed by a signal (a crash kills a
    rank before it can say anything; waiting for it would only time out). A rank that
    raises reports first and exits normally."""
    for rank, p in enumerate(procs):
        if rank not in outputs and (p.exitcode or 0) < 0:
            raise RankFailure(
                f"rank {rank} of {len(procs)} was killed by {_signal_name(-p.exitcode)} "
                "before reporting"
            )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def subprocess_env(root: str | os.PathLike) -> dict[str, str]:
    """``os.environ`` with ``root`` put first on PYTHONPATH, keeping what was there (a
    replaced PYTHONPATH loses the packages an environment puts on it)."""
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
