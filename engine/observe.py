"""What a run shows: a rich console with a progress bar, TensorBoard scalars, wandb, traces."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import resource
import sys
from collections.abc import Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from engine.resilience.watchdog import run_log_path
from parallel_state.launcher import detect_launch


def console_streams() -> None:
    """stdout written line by line, also into a pipe or a file (where Python buffers it by
    blocks, and a run's lines would arrive in bursts or at its end), and stdout and stderr
    that outlive their reader (:class:`OutlivesReader`)."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    if not isinstance(sys.stdout, OutlivesReader):
        sys.stdout = OutlivesReader(sys.stdout)
    if not isinstance(sys.stderr, OutlivesReader):
        sys.stderr = OutlivesReader(sys.stderr)


class OutlivesReader:
    """A console stream whose reader may leave (``pretrain | head``, a ``tee`` killed, a
    closed terminal): the first write that finds it gone points the stream at /dev/null,
    and the run goes on. The console is a view; the run log keeps every line. Everything
    but writing and flushing is the wrapped stream's."""

    _GONE = (errno.EPIPE, errno.EIO)  # a closed pipe; a hung-up terminal

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._drop_reader(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._drop_reader(err)

    def _drop_reader(self, err: OSError) -> None:
        if err.errno not in self._GONE:
            raise err
        with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(50) rather than overflowing for a diverged model."""
    return math.exp(min(loss, 50.0))


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def window_metrics(
    window: list[dict[str, float]],
    *,
    loss: float,
    tokens_per_step: int,
    flops_per_step: float,
    world_size: int,
    peak_flops: float | None,
    device: torch.device,
) -> dict[str, float | None]:
    """Scalars for a logging window of steps (each a ``Trainer.train_step`` result).

    TFLOP/s is per rank, from model FLOPs (docs/PERFMODEL.md); MFU is None when the device's
    peak is unknown; the DP share is the time spent waiting for the gradient all-reduce.
    """
    step_time = sum(m["step_time"] for m in window) / len(window)
    tflops = flops_per_step / step_time / world_size / 1e12
    last = window[-1]
    dp = [m["dp_comm"] for m in window]  # None: the DP collectives are not timed (FSDP)
    dp_share = None if None in dp else sum(dp) / (step_time * len(window))
    return {
        "train/loss": loss,
        "train/lr": last["lr"],
        "train/grad_norm": last["grad_norm"],
        "perf/tokens_per_s": tokens_per_step / step_time,
        "perf/tflops_per_rank": tflops,
        "perf/mfu": tflops * 1e12 / peak_flops if peak_flops else None,
        "perf/dp_comm_share": dp_share,
        "perf/peak_mem_gib": peak_memory_gib(device),
    }


def format_step_line(step: int, max_steps: int, m: dict[str, float | None]) -> str:
    """The console's one line per logging window."""
    mfu = "n/a" if m["perf/mfu"] is None else f"{100 * m['perf/mfu']:5.1f}%"
    dp = m["perf/dp_comm_share"]
    dp = "  n/a" if dp is None else f"{100 * dp:4.1f}%"
    return (
        f"step {step:>5}/{max_steps}  loss {m['train/loss']:7.4f}  lr {m['train/lr']:.2e}  "
        f"grad_norm {m['train/grad_norm']:7.3f}  {m['perf/tokens_per_s']:9.0f} tok/s  "
        f"{m['perf/tflops_per_rank']:.3g} TFLOP/s/rank  MFU {mfu}  "
        f"dp_comm {dp}  "
        f"peak_mem {m['perf/peak_mem_gib']:.2f} GiB"
    )


class RunLogger:
    """Console, progress bar and metric sinks; only the first rank prints and writes.

    Every console line also goes, as plain text, to the run log (``pretrain.log`` in the
    run directory, the file Hydra names after the job).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        run_dir: str,
        max_steps: int,
        tensorboard: str | None,
        wandb_project: str | None,
        config: dict,
        progress: bool,
    ) -> None:
        self.enabled = enabled
        # mpirun gives each rank a pseudo-terminal that it relays into a log or a pipe:
        # that is no screen, so no colors or progress bar (their escape codes would land
        # in the captured log). Elsewhere rich decides from isatty, NO_COLOR and TERM.
        screen = None if detect_launch().launcher != "mpi" else False
        self.console = Console(stderr=False, highlight=False, force_terminal=screen)
        self.writer = self.wandb = None
        self.progress = self.log_file = None
        self.tensorboard_dir, self.first_step = tensorboard, 1
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.log_file = open(run_log_path(run_dir), "a")  # noqa: SIM115 - closed in close()
        self.file_console = Console(
            file=self.log_file, color_system=None, highlight=False, force_terminal=False
        )
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, config=config, dir=run_dir)
        if progress and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("train", total=max_steps, status="")
            self.progress.start()

    def print(self, *args, **kwargs) -> None:
        """Print on the first rank only (above the progress bar)."""
        if self.enabled:
            self.console.print(*args, soft_wrap=True, **kwargs)  # log lines stay one line
            if not self.log_file.closed:
                self.file_console.print(*args, soft_wrap=True, **kwargs)
                self.log_file.flush()

    def advance(self, step: int, loss: float) -> None:
        """Move the bar to ``step``, showing that step's loss on this rank: the mean over
        its own micro-batches, not the step lines' mean over ranks and logged steps."""
        if self.progress is not None:
            status = f"step loss {loss:.3f} (rank 0's batches)"  # the bar is rank 0's
            self.progress.update(self.task, completed=step, status=status)

    def resumed_at(self, step: int) -> None:
        """The run continues after ``step``: TensorBoard drops what a run that died after
        that checkpoint logged past it, so the curves stay one line."""
        self.first_step = step + 1

    def _open_writer(self) -> None:
        # Opened at the first scalars (after any resume), in the run's own directory that
        # every resume shares: one TensorBoard run per training run, not one per launch.
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.tensorboard_dir, purge_step=self.first_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write scalars to TensorBoard / wandb."""
        if not self.enabled:
            return
        if self.writer is None and self.tensorboard_dir:
            self._open_writer()
        for key, value in values.items():
            if self.writer is not None and value is not None:
                self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.log_file is not None:
            self.log_file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


@contextlib.contextmanager
def maybe_profile(steps: list[int], run_dir: str, rank: int) -> Iterator[callable]:
    """A torch.profiler trace of steps ``[first, last]`` (chrome trace per rank), or nothing.

    Yields a ``step()`` callback to call after every optimizer step.
    """
    if not steps:
        yield lambda: None
        return
    first, last = steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = os.path.join(run_dir, f"trace_rank{rank}.json")
    schedule = torch.profiler.schedule(
        wait=max(0, first - 1), warmup=1 if first > 0 else 0, active=last - first + 1, repeat=1
    )
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        record_shapes=True,
        on_trace_ready=lambda prof: prof.export_chrome_trace(path),
    ) as prof:
        yield prof.step
