"""Where a training step's time goes: data, compute, TP and DP communication, optimizer.

The trainer marks phase boundaries (``lap``); the collectives are timed by two clocks it
hands down explicitly: ``StepTimer.tp`` is attached to the model's TP modules (they pass
it to ``layers.mappings``), ``StepTimer.dp`` to the DP strategy. Nothing global.

How exact each figure is:

- phases (data, forward+backward, DP wait, optimizer) are wall clocks between points
  where the device is synchronized, so they add up to the step time exactly;
- TP communication: every TP collective is blocking, so its wall clock (CPU) or a pair
  of CUDA events on the current stream (GPU) measures it; compute = forward+backward − TP;
- DP exposed: the wait after backward for the bucketed all-reduces or ZeRO's bucketed
  reduce-scatters, plus any blocking DP collective inside the optimizer phase (ZeRO's
  all-gathers are asynchronous: what the next forward waits for is in its compute), at
  most DP total: what of that wait no collective filled is the gradients' bookkeeping,
  counted as optimizer time;
- DP total: each asynchronous bucket collective runs from its launch to the moment its
  future completes; the collectives of one group run one after another, so the busy time
  is the union of those intervals (on CUDA the completion is seen by the host callback,
  an upper bound). It includes queueing behind compute when the CPU is shared;
- FSDP's collectives run inside its own hooks, in forward and backward: counted there,
  with no DP figures (None, not 0), and the wait after backward is its bookkeeping,
  optimizer time;
- at DP size 1 there is no DP communication: both DP figures are 0 and the phase between
  backward and the optimizer (the gradients' bookkeeping, and a pipeline's gradient
  collectives over its stages) counts as optimizer time;
- pipelined: the console and TensorBoard split the stages' wait on each other (bubble and
  hand-offs, ``pp_wait_s``) out of compute, so the parts still add up to the step.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.formulas import whole_percentages
from engine.observe import peak_memory_gib
from layers.utils import attach_comm_timer

PHASES = ("data", "forward_backward", "dp_wait", "optimizer")


class _Clock:
    """Sums the duration of blocking collectives (a ``layers.utils.CommTimer``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def begin(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def end(self, token: Any) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((token, event))
        else:
            self.seconds += time.perf_counter() - token

    def total(self) -> float:
        """Seconds so far this step (the device must be synchronized on CUDA)."""
        if self._events:
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self.seconds

    def reset(self) -> None:
        self.seconds, self._events = 0.0, []


class _DPClock(_Clock):
    """Blocking DP collectives (ZeRO) plus the busy time of asynchronous bucket all-reduces."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._async: list[list[float | None]] = []

    def launched(self, work: dist.Work) -> None:
        """Follow an asynchronous all-reduce from now until its future completes."""
        span: list[float | None] = [time.perf_counter(), None]
        self._async.append(span)

        def done(_future):
            span[1] = time.perf_counter()

        # gloo's reduce-scatter has no future: its span then ends when it is waited for.
        with contextlib.suppress(RuntimeError):
            work.get_future().then(done)

    def async_busy(self, waited: float) -> float:
        """Union of the launch→completion intervals (collectives of a group run in order).

        A completion callback that has not run yet counts as done at ``waited``, when the
        trainer's wait for every bucket returned.
        """
        busy, until = 0.0, 0.0
        for start, stop in sorted((a, waited if b is None else b) for a, b in self._async):
            busy += max(0.0, stop - max(start, until))
            until = max(until, stop)
        return busy

    def reset(self) -> None:
        super().reset()
        self._async = []


class StepTimer:
    """Per-step time breakdown; ``enabled=False`` times phases only (no collective clocks)."""

    def __init__(
        self,
        device: torch.device,
        *,
        enabled: bool = True,
        tokens_per_step: int = 0,
        flops_per_step: float = 0.0,
        world_size: int = 1,
        dp_size: int | None = None,
        time_tp: bool = True,
    ) -> None:
        """``dp_size``: ranks the gradients are reduced over (1: no DP communication to
        time; None: unknown, timed as if there were)."""
        self.device, self.enabled, self.dp_size = device, enabled, dp_size
        # False for a compiled model (model.compile): its TP collectives are graph nodes,
        # not timed (layers.utils.timed), and their waits count as compute.
        self.time_tp = time_tp
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.world_size = world_size
        self.tp, self.dp = _Clock(device), _DPClock(device)
        self.time_dp = True  # the DP strategy's collectives are on the DP clock (attach)
        self.records: list[dict[str, Any]] = []
        self._marks: list[tuple[float, float]] = []

    def attach(self, model: torch.nn.Module, data_parallel: Any) -> None:
        """Hand the clocks to whoever runs the collectives (take them back when disabled).

        ``data_parallel``: the DP strategy (``engine.data_parallel``), which passes the DP
        clock to the gradient sync or ZeRO-1 it runs.
        """
        attach_comm_timer(model, self.tp if self.enabled and self.time_tp else None)
        data_parallel.set_comm_timer(self.dp if self.enabled else None)
        self.time_dp = data_parallel.times_comm

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        """Begin a step."""
        self.tp.reset()
        self.dp.reset()
        self._marks = [(self._now(), 0.0)]

    def lap(self) -> None:
        """End the current phase (in the order of ``PHASES``)."""
        now = self._now()
        self._marks.append((now, self.dp.total() if self.enabled else 0.0))

    def finish(self, **extra: float) -> dict[str, Any]:
        """Close the step (its last lap must be done); returns and keeps its record."""
        times = [b[0] - a[0] for a, b in zip(self._marks, self._marks[1:], strict=False)]
        phase = dict(zip(PHASES, times, strict=True))
        step_time = self._marks[-1][0] - self._marks[0][0]
        record: dict[str, Any] = {"step_time_s": step_time, "data_s": phase["data"]}
        if self.dp_size == 1:  # nothing to wait for: the phase is gradient bookkeeping
            phase["optimizer"] += phase.pop("dp_wait")
            phase["dp_wait"] = 0.0
        if self.enabled:
            tp = self.tp.total()
            dp_in_optimizer = self._marks[-1][1] - self._marks[-2][1]
            waited = phase["dp_wait"] + dp_in_optimizer
            total = self.dp.async_busy(self._marks[3][0]) + self.dp.total()
            total = 0.0 if self.dp_size == 1 else total if self.time_dp else None
            # No more of the communication is exposed than there was of it: the rest of the
            # wait is the gradients' bookkeeping, optimizer time (as at dp 1).
            exposed = None if total is None else min(waited, total)
            record |= {
                "compute_s": phase["forward_backward"] - tp,
                "tp_comm_s": tp if self.time_tp else None,
                "dp_comm_exposed_s": exposed,
                "dp_comm_total_s": total,
                "optimizer_s": phase["optimizer"] - dp_in_optimizer + waited - (exposed or 0.0),
            }
        else:  # phases only; under FSDP (no DP clock) the wait is bookkeeping, as above
            waited = phase["dp_wait"] if self.time_dp else 0.0
            record |= {
                "compute_s": phase["forward_backward"],
                "tp_comm_s": None,
                "dp_comm_exposed_s": waited if self.time_dp else None,
                "dp_comm_total_s": None,
                "optimizer_s": phase["optimizer"] + phase["dp_wait"] - waited,
            }
        record |= {
            "tokens_per_s": self.tokens_per_step / step_time,
            "tflops_per_rank": self.flops_per_step / step_time / self.world_size / 1e12,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        record |= extra
        self.records.append(record)
        return record

    def write(self, path: str, header: dict[str, Any], summary: dict[str, Any]) -> None:
        """The per-run metrics JSON (written whole, then renamed into place)."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        payload = {**header, "steps": self.records, "summary": summary}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)


# The parts of a step, which add up to it, and their console names.
BREAKDOWN = {
    "data_s": "data",
    "compute_s": "compute",
    "pp_wait_s": "pp_wait",
    "tp_comm_s": "tp",
    "dp_comm_exposed_s": "dp_exposed",
    "optimizer_s": "optim",
}


def breakdown_metrics(window: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each part of a logging window (TensorBoard ``time/*``).

    A pipelined step's record counts the stages' wait on each other (``pp_wait_s``) in
    ``compute_s``; here it is split out, so ``time/compute_s`` is the stages' own work."""
    out = {}
    for key in (*BREAKDOWN, "dp_comm_total_s", "pp_bubble_ratio"):
        values = [m[key] for m in window if m.get(key) is not None]
        if values:
            out[f"time/{key}"] = sum(values) / len(values)
    if "time/pp_wait_s" in out and "time/compute_s" in out:
        out["time/compute_s"] = max(0.0, out["time/compute_s"] - out["time/pp_wait_s"])
    return out


def format_breakdown(metrics: dict[str, float]) -> str:
    """The console's share of each part of the step, e.g. ``data 1% compute 80% ...``."""
    parts = {name: metrics.get(f"time/{key}") for key, name in BREAKDOWN.items()}
    parts = {name: p for name, p in parts.items() if p is not None}
    percents = whole_percentages(list(parts.values()))
    shares = [f"{name} {pct}%" for name, pct in zip(parts, percents, strict=True)]
    dp_total = metrics.get("time/dp_comm_total_s")
    if dp_total is not None:
        shares.append(f"(dp total {1e3 * dp_total:.1f} ms)")
    bubble = metrics.get("time/pp_bubble_ratio")
    if bubble is not None:
        shares.append(f"(pp_wait = {bubble:.2f} × stage compute)")
    return "  time: " + " ".join(shares)
