"""One rank of ``python -m apps.classify``: train the MLP until the test accuracy target.

Every optimizer step takes a global batch of ``batch_size × dp_size`` images from this
epoch's permutation and gives DP rank r the r-th contiguous block of ``batch_size``, so a
run at dp = 2 computes exactly the step of dp = 1 with twice the per-rank batch. The TP
ranks of one DP replica see the same images. After each epoch the test images are split
over DP into contiguous blocks, and (correct, seen) counts are summed over the DP group.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from apps.classify_config import ClassifyConfig
from engine import comm
from engine.config import sized_dims
from engine.data import fashion_mnist
from engine.data_parallel import GradSync
from engine.models.mlp import MLPClassifier
from engine.observe import peak_memory_gib
from parallel_state import ParallelState

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def local_batch(perm: torch.Tensor, step: int, batch_size: int, dp_rank: int, dp_size: int):
    """Indices of DP rank ``dp_rank``'s share of global step ``step`` of permutation ``perm``."""
    start = (step * dp_size + dp_rank) * batch_size
    return perm[start : start + batch_size]


def steps_per_epoch(num_images: int, batch_size: int, dp_size: int) -> int:
    """Whole global batches in one pass (the remainder is dropped, as every rank must step)."""
    return num_images // (batch_size * dp_size)


@torch.no_grad()
def evaluate(model: MLPClassifier, x: torch.Tensor, y: torch.Tensor, ps: ParallelState) -> float:
    """Accuracy on (x, y): each DP rank scores its contiguous block, the counts are summed."""
    blocks = torch.tensor_split(torch.arange(x.shape[0], device=x.device), ps.size("batch"))
    mine = blocks[ps.rank_in("batch")]
    counts = torch.zeros(2, dtype=torch.float64, device=x.device)  # correct, seen
    for block in torch.split(mine, 2048):
        pred = model(x[block]).argmax(dim=-1)
        counts[0] += (pred == y[block]).sum()
        counts[1] += len(block)
    comm.sum_(counts, ps.group("loss"))
    return float(counts[0] / counts[1])


@dataclass
class Timings:
    """Per-step records in the metrics-file layout (CONTRACTS: null where not measured)."""

    records: list[dict] = field(default_factory=list)

    def add(
        self,
        step: int,
        parts: dict[str, float],
        images: int,
        flops: float,
        loss: float,
        device: torch.device,
    ) -> None:
        total = sum(parts.values())
        self.records.append(
            {
                "step": step,
                "step_time_s": total,
                **parts,
                "tp_comm_s": None,
                "dp_comm_total_s": None,
                "tokens_per_s": None,
                "images_per_s": images / total,
                "tflops_per_rank": flops / total / 1e12,
                "peak_mem_gib": peak_memory_gib(device),
                "loss": loss,
            }
        )


def _images(cfg: ClassifyConfig, device: torch.device, dtype: torch.dtype) -> tuple:
    """The training and test images (in ``dtype``) and labels of ``cfg.data``, on ``device``."""
    data = fashion_mnist.load(cfg.data.dir)
    train_x, train_y = _subset(data.train_x, data.train_y, cfg.data.train_subset)
    test_x, test_y = _subset(data.test_x, data.test_y, cfg.data.test_subset)
    train_x, test_x = (x.to(device, dtype) for x in (train_x, test_x))
    return train_x, train_y.to(device), test_x, test_y.to(device)


def train(cfg: ClassifyConfig, ps: ParallelState) -> dict:
    """Train until the target or the epoch cap; the summary (the same on every rank)."""
    t, dtype = cfg.trainer, DTYPES[cfg.model.dtype]
    train_x, train_y, test_x, test_y = _images(cfg, ps.device, dtype)
    ps.seed(t.seed)
    run = _Run(
        cfg,
        ps,
        MLPClassifier(cfg.model.hidden_size, tp_group=ps.tp_group, dtype=dtype, device=ps.device),
    )
    steps = steps_per_epoch(train_x.shape[0], t.batch_size, ps.size("batch"))
    say = _printer(ps)
    say(
        f"classify: {train_x.shape[0]} training / {test_x.shape[0]} test images, tp={ps.tp_size} "
        f"dp={ps.size('batch')}, batch {t.batch_size}/rank ({t.batch_size * ps.size('batch')} global), "
        f"lr {run.lr:g}, {steps} steps/epoch, target {t.target_accuracy}"
    )
    curve, train_time, accuracy = [], 0.0, 0.0
    start = time.perf_counter()
    for epoch in range(1, t.epochs + 1):
        gen = torch.Generator().manual_seed(t.seed + epoch)
        perm = torch.randperm(train_x.shape[0], generator=gen)
        epoch_start = time.perf_counter()
        loss = run.epoch(train_x, train_y, perm, steps, epoch)
        epoch_time = time.perf_counter() - epoch_start
        train_time += epoch_time
        accuracy = evaluate(run.model, test_x, test_y, ps)
        elapsed = time.perf_counter() - start
        rate = steps * t.batch_size * ps.size("batch") / epoch_time
        curve.append(
            {
                "epoch": epoch,
                "test_accuracy": accuracy,
                "elapsed_s": elapsed,
                "train_loss": loss,
                "images_per_s": rate,
            }
        )
        say(
            f"epoch {epoch:>2}  test accuracy {accuracy:.4f}  train loss {loss:.4f}  "
            f"elapsed {elapsed:6.2f} s  {rate:8.0f} images/s"
        )
        if accuracy >= t.target_accuracy:
            break
    run.grad_sync.remove()
    reached = accuracy >= t.target_accuracy
    summary = {
        "reached": reached,
        "target_accuracy": t.target_accuracy,
        "test_accuracy": accuracy,
        "epochs": len(curve),
        "time_to_accuracy_s": curve[-1]["elapsed_s"] if reached else None,
        "elapsed_s": curve[-1]["elapsed_s"],
        "images_per_s": len(curve) * steps * t.batch_size * ps.size("batch") / train_time,
        "lr": run.lr,
        "curve": curve,
    }
    if t.metrics_file and ps.rank == 0:
        write_metrics(t.metrics_file, cfg, ps, run.timings, summary)
    return summary


class _Run:
    """The model, its optimizer and gradient sync, and the step records of one rank."""

    def __init__(self, cfg: ClassifyConfig, ps: ParallelState, model: MLPClassifier) -> None:
        t = cfg.trainer
        self.cfg, self.ps, self.model, self.timings = cfg, ps, model, Timings()
        self.lr = t.lr * (ps.size("batch") if t.lr_scaling == "linear" else 1)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=t.momentum)
        self.grad_sync = GradSync(
            model.parameters(),
            grad_group=ps.group("grad"),
            tp_group=ps.tp_group,
            bucket_size_mb=t.grad_bucket_mb,
        )
        self.flops = model.flops_per_image() * t.batch_size * ps.size("batch") / ps.world_size

    def epoch(self, x, y, perm: torch.Tensor, steps: int, epoch: int) -> float:
        """One pass; rank 0's mean training loss over it (no extra collective per step)."""
        ps, batch, total = self.ps, self.cfg.trainer.batch_size, 0.0
        progress = self._progress(steps, epoch)
        for step in range(steps):
            t0 = time.perf_counter()
            idx = local_batch(perm, step, batch, ps.rank_in("batch"), ps.size("batch"))
            idx = idx.to(x.device)
            xb, yb = x[idx], y[idx]
            t1 = time.perf_counter()
            loss = F.cross_entropy(self.model(xb), yb)
            loss.backward()
            t2 = time.perf_counter()
            self.grad_sync.finish()  # waits for the bucketed DP all-reduces still in flight
            t3 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            value = float(loss.detach())
            total += value
            if ps.rank == 0:
                parts = {
                    "data_s": t1 - t0,
                    "compute_s": t2 - t1,
                    "dp_comm_exposed_s": t3 - t2,
                    "optimizer_s": t4 - t3,
                }
                step_no = (epoch - 1) * steps + step + 1
                self.timings.add(
                    step_no, parts, batch * ps.size("batch"), self.flops, value, ps.device
                )
            if progress is not None:
                progress.advance(progress.task_ids[0])
        if progress is not None:
            progress.stop()
        return total / max(steps, 1)

    def _progress(self, steps: int, epoch: int):
        """A transient rich bar on global rank 0, on a terminal only (logs stay clean)."""
        if self.ps.rank != 0 or not self.cfg.trainer.progress or not os.isatty(2):
            return None
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.add_task(f"epoch {epoch}", total=steps)
        bar.start()
        return bar


def _printer(ps: ParallelState):
    return (lambda msg: print(msg, flush=True)) if ps.rank == 0 else (lambda msg: None)


def _subset(x: torch.Tensor, y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (x[:n], y[:n]) if n > 0 else (x, y)


def write_metrics(
    path: str, cfg: ClassifyConfig, ps: ParallelState, timings: Timings, summary: dict
) -> None:
    """The per-run metrics JSON, written atomically (temporary file, then rename)."""
    payload = {
        "workload": "classify",
        "tp_size": ps.tp_size,
        "dp_size": ps.size("batch"),
        "world_size": ps.world_size,
        "micro_batch": cfg.trainer.batch_size,
        "global_batch": cfg.trainer.batch_size * ps.size("batch"),
        "steps": timings.records,
        "summary": summary,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_worker(cfg: ClassifyConfig) -> dict:
    """Entry of every rank: build the mesh, train, tear down; the summary."""
    from engine.bootstrap import bootstrap_rank
    from engine.resilience.watchdog import RunStopped
    from parallel_state.launcher import detect_launch

    try:
        mesh = bootstrap_rank(
            lambda world: sized_dims(cfg.tp_size, cfg.dp_size, world),
            rendezvous_timeout_s=cfg.launch.rendezvous_timeout_s,
            run_dir=None,  # the classifier keeps no run log
            timeout_key="launch.rendezvous_timeout_s",
            warn=detect_launch().rank == 0,
            say=lambda ps, line: _printer(ps)(line),
            max_threads=cfg.trainer.threads or None,
        )
    except RunStopped as err:
        print(err, file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    with mesh as ps:
        return train(cfg, ps)
