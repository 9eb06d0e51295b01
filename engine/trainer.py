"""The training loop: micro-batches, DP gradient sync, clipping, precision, eval, logging."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from rich.markup import escape

import parallel_state
from engine import comm, flops
from engine.bootstrap import bootstrap_rank
from engine.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from engine.checkpoint.tokenizer import tokenizer_record
from engine.config import Config, parallel_dims, resolve_precision
from engine.data.loader import DataIterator
from engine.data.pipeline import build_pipeline
from engine.data_parallel import DynamicLossScaler, build_data_parallel
from engine.generate import generate
from engine.launching import share_cores
from engine.mesh_report import describe_mesh
from engine.models import build_model
from engine.models.base import to_device
from engine.observe import RunLogger, format_step_line, maybe_profile, window_metrics
from engine.optim import lr_at, schedule_change
from engine.pipeline import PipelineRunner, pipeline_runner
from engine.resilience.guard import BadStepGuard
from engine.resilience.preemption import EXIT_PREEMPTED, StopRequests
from engine.resilience.watchdog import Watchdog
from engine.step_timer import StepTimer, breakdown_metrics, format_breakdown
from parallel_state import ParallelState
from parallel_state.launcher import detect_launch

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tensorboard_dir(cfg: Config) -> str | None:
    """Where the run's TensorBoard scalars go (``None``: off): beside its checkpoints, the
    directory every resume of the run shares, not Hydra's per-launch folder."""
    return os.path.join(checkpoint_dir(cfg), "tensorboard") if cfg.trainer.tensorboard else None


@torch.no_grad()
def fixed_set_loss(
    model,
    valid: DataIterator,
    ps: ParallelState,
    batches: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> float:
    """Mean loss over micro-batches ``0 .. batches - 1`` of ``valid`` (a one-micro-batch-per-
    step iterator): micro-batch j runs on DP rank j mod dp_size and the mean is over
    micro-batches, so the result does not depend on dp_size. Every rank gets it.

    Every DP rank runs the same number of forward passes, ⌈batches / dp_size⌉: a rank past
    the last micro-batch runs one again and drops its loss, because under FSDP each forward
    gathers parameters over the DP group and all its ranks must take part."""
    model.eval()
    total = 0.0
    for j in range(ps.dp_rank, -(-batches // ps.dp_size) * ps.dp_size, ps.dp_size):
        valid.consumed_samples = (j % batches) * valid.global_batch
        for micro in valid.next_step():  # one micro-batch
            with autocast():
                loss = model.loss(to_device(micro, ps.device)).float().item()
            total += loss if j < batches else 0.0
    model.train()
    return comm.mean(total, ps.dp_group, ps.device) * ps.dp_size / batches


def cap_device_memory(cap_gib: float, device: torch.device) -> None:
    """Hold a GPU rank to ``trainer.memory_cap_gib`` (its allocator then raises an
    out-of-memory error past it, as a smaller GPU would). CPU ranks have no allocator cap:
    there the preflight holds the estimate to it and the log's peak_mem shows the use."""
    if cap_gib > 0 and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward's autocast for a resolved ``precision`` (none for fp32)."""
    if precision not in _AUTOCAST:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_AUTOCAST[precision])


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(50) rather than overflowing for a diverged model."""
    return math.exp(min(loss, 50.0))


class Trainer:
    """Pre-trains ``cfg.model`` on this rank's part of the mesh.

    bf16/fp16 run the forward under autocast; gradients, their DP reduction and the
    optimizer are fp32. The data-parallel strategy (``self.dp``, chosen once from
    ``optim.distributed``) reduces gradients and steps the optimizer: the bucketed
    all-reduce keeps fp32 parameters, ZeRO-1 keeps bf16 ones beside fp32 master slices
    when training in bf16. fp16 adds dynamic loss scaling with mesh-wide overflow
    detection. A resumable
    checkpoint is saved every ``checkpoint.every`` steps and at the end, and a new run
    continues from the newest one (at any layout).
    """

    def __init__(self, cfg: Config, ps: ParallelState, watch: Watchdog | None = None) -> None:
        self.cfg, self.ps, self.device = cfg, ps, ps.device
        self.threads = share_cores(ps)  # before any compute; said under the mesh line
        self.watch = watch or Watchdog(0, rank=ps.rank, run_dir=cfg.run_dir)
        self.precision = resolve_precision(cfg.trainer.precision, ps.device.type)
        cap_device_memory(cfg.trainer.memory_cap_gib, ps.device)
        ps.seed(cfg.trainer.seed)
        self.model = build_model(cfg.model, ps, device=ps.device)
        self.pipeline: PipelineRunner | None = None  # pp_size > 1: this rank's stages
        if ps.pp_size > 1:
            self.pipeline = pipeline_runner(self.model, cfg, ps)
            self.model = self.pipeline.model
        self.dp = build_data_parallel(
            self.model,
            cfg.optim,
            dp_group=ps.dp_group,
            tp_group=ps.tp_group,
            device=ps.device,
            bucket_size_mb=cfg.trainer.grad_bucket_mb,
            overlap=cfg.trainer.overlap_grad_reduce,
            low_precision=torch.bfloat16 if self.precision == "bf16" else None,
            dp_shard=ps.dims.dp_shard,
            compile_backend=cfg.model.compile_backend if cfg.model.compile else None,
        )
        self.params = self.dp.params  # FSDP registers sharded parameters of its own
        self.scaler = (
            DynamicLossScaler(cfg.trainer.loss_scale_init) if self.precision == "fp16" else None
        )
        self.data = build_pipeline(cfg, ps.dp_rank, ps.dp_size)
        # Recorded in every checkpoint (path and SHA-256) so that generation and evaluation
        # find the tokenizer and notice if the file there is replaced.
        self._tokenizer = tokenizer_record(cfg.data.tokenizer) if ps.rank == 0 else None
        self.flops_per_step = flops.model_flops_per_step(cfg)
        peak_dtype = _AUTOCAST.get(self.precision, torch.float32)
        self.peak_flops = flops.peak_flops(ps.device, peak_dtype)
        self.timer = StepTimer(
            ps.device,
            enabled=cfg.trainer.step_timing,
            flops_per_step=self.flops_per_step,
            tokens_per_step=cfg.trainer.global_batch * cfg.data.seq_len,
            world_size=ps.world_size,
            time_tp=not cfg.model.compile,
        )
        self.timer.attach(self.model, self.dp)
        self.logger = RunLogger(
            enabled=ps.rank == 0,
            run_dir=cfg.run_dir,
            max_steps=cfg.trainer.max_steps,
            tensorboard=tensorboard_dir(cfg),
            wandb_project=cfg.trainer.wandb_project,
            config=asdict(cfg),
            progress=cfg.trainer.progress,
        )
        self.guard = BadStepGuard(cfg.trainer.max_bad_steps, ps.device, self.logger.print)
        self.step = self._saved_step = 0
        self._last_eval: dict[str, float] | None = None
        self.history: list[tuple[int, float]] = []
        if cfg.checkpoint.resume:
            self._resume()

    def _autocast(self):
        return autocast_for(self.precision, self.device.type)

    def _loss(self, batch) -> torch.Tensor:
        return self.model.loss(to_device(batch, self.device))

    def _mark(self, what: str, group: str, step: int | None = None) -> None:
        """Tell the watchdog what this rank does now and which group it may wait on."""
        if group == "model":  # the model's collectives: TP, and DP (its buckets at tp=1,
            # FSDP's gathers in every forward and backward)
            fsdp = self.ps.dims.dp_shard in ("gradients", "full") and self.ps.dp_size > 1
            group = "tp" if self.ps.tp_size > 1 else "dp"
            group = "tp and dp" if fsdp and self.ps.tp_size > 1 else group
        ranks = {
            "tp": self.ps.tp_ranks,
            "dp": self.ps.dp_ranks,
            "pp": self.ps.pp_ranks,
            "tp and dp": sorted({*self.ps.tp_ranks, *self.ps.dp_ranks}),
        }
        members = ranks.get(group, list(range(self.ps.world_size)))
        self.watch.mark(what, self.step if step is None else step, group, members)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns this rank's step metrics."""
        self._mark("forward/backward", "model", self.step + 1)
        self.timer.start()
        micro_batches = self.data.train.next_step()
        self.timer.lap()
        total = self._forward_backward(micro_batches)
        self.timer.lap()
        self._mark("gradient all-reduce", "dp", self.step + 1)
        grads = self.dp.finish_grads()
        if self.pipeline is not None:
            self._mark("tied embedding gradient sum", "pp", self.step + 1)
            self.model.sum_tied_grads()
        self.timer.lap()
        skipped = False
        self._mark("gradient norm and optimizer step", "model", self.step + 1)
        if self.scaler is not None:
            groups = (self.ps.tp_group, self.ps.dp_group, self.ps.pp_group)
            skipped = self.scaler.found_overflow(grads, groups)
            if not skipped:
                self.scaler.unscale_(grads)
            self.scaler.update(skipped)
        norm = self.dp.grad_norm()
        if self.pipeline is not None:  # every stage's share: the whole model's norm
            norm = self.pipeline.global_norm(norm)
        lr = lr_at(self.step, self.cfg.optim, self.cfg.trainer.max_steps)
        scale = self.scaler and self.scaler.scale
        self._mark("bad-step check", "world", self.step + 1)
        if not self.guard.check(
            self.step + 1, total.item(), norm.item(), overflow=skipped, loss_scale=scale
        ):
            self.dp.step(lr=lr, max_norm=self.cfg.optim.clip_grad, norm=norm)
        self.dp.zero_grad()
        self.timer.lap()
        stages = self.pipeline.timings() if self.pipeline and self.timer.enabled else {}
        record = self.timer.finish(step=self.step + 1, loss=total.item(), **stages)
        return {
            **record,
            "grad_norm": norm.item(),
            "lr": lr,
            "skipped": float(skipped),
            "step_time": record["step_time_s"],
            "dp_comm": record["dp_comm_exposed_s"],
        }

    def _forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (gradients accumulated, the DP
        reduction launched on the last); returns their mean loss, detached."""
        if self.pipeline is not None:  # the schedule's micro-batches are the accumulation
            stage = ", ".join(str(s) for s in self.model.stage_ids)
            self._mark(f"pipeline schedule (stage {stage})", "pp", self.step + 1)
            scale = self.scaler.scale if self.scaler else 1.0
            with self.dp.no_sync(), self._autocast():
                loss = self.pipeline.train(micro_batches, loss_scale=scale)
            return torch.tensor(loss, dtype=torch.float32, device=self.device)
        total = torch.zeros((), device=self.device)
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.dp.no_sync():
                with self._autocast():
                    loss = self._loss(micro) / len(micro_batches)
                (loss * self.scaler.scale if self.scaler else loss).backward()
            total += loss.detach().float()
        return total

    def _dp_mean(self, value: float) -> float:
        self._mark("loss average", "dp")
        return comm.mean(value, self.ps.dp_group, self.device)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean validation loss (and perplexity) over a fixed set of sequences.

        The set is the validation split's first ``trainer.eval_batches`` micro-batches,
        the same at every layout; micro-batch j runs on DP rank j mod dp_size, and the
        mean is over micro-batches, so the result does not depend on dp_size.
        """
        t = self.cfg.trainer
        if self.data.valid is None or t.eval_batches < 1:
            return None
        self._mark("evaluation", "model")
        if self.pipeline is not None:
            with self._autocast():
                loss = self.pipeline.fixed_set_loss(self.data.valid, t.eval_batches)
        else:
            loss = fixed_set_loss(
                self.model, self.data.valid, self.ps, t.eval_batches, self._autocast
            )
        return {"valid/loss": loss, "valid/ppl": perplexity(loss)}

    def _log(self, window: list[dict[str, float]]) -> None:
        loss = self._dp_mean(sum(m["loss"] for m in window) / len(window))
        self.history.append((self.step, loss))
        t = self.cfg.trainer
        metrics = window_metrics(
            window,
            loss=loss,
            tokens_per_step=t.global_batch * self.cfg.data.seq_len,
            flops_per_step=self.flops_per_step,
            world_size=self.ps.world_size,
            peak_flops=self.peak_flops,
            device=self.device,
        )
        line = format_step_line(self.step, t.max_steps, metrics)
        metrics |= breakdown_metrics(window)
        line += format_breakdown(metrics)
        if self.scaler:
            skipped = int(sum(m["skipped"] for m in window))
            line += f"  (skipped {skipped} overflow steps, loss scale {self.scaler.scale:g})"
        self.logger.print(line)
        self.logger.scalars(self.step, metrics)

    def fit(self) -> dict:
        """Train for ``trainer.max_steps`` steps, evaluate, save and sample; return a summary."""
        t = self.cfg.trainer
        self.logger.print(
            f"[bold]meshtron[/bold] {self.cfg.name}: {self.cfg.model.arch} "
            f"h={self.cfg.model.hidden_size} l={self.cfg.model.num_layers}  tp={self.ps.tp_size} "
            f"dp={self.ps.dp_size}{self._pp_note()}  precision={self.precision}  global batch {t.global_batch} = "
            f"{t.micro_batch} micro × {self.ps.dp_size} dp × {self.data.train.accum_steps} accum"
        )
        mesh = describe_mesh(self.ps)  # a collective: every rank takes part
        self.logger.print(mesh, markup=False)
        if self.threads:
            self.logger.print(self.threads, markup=False)
        if self.step >= t.max_steps:
            self.logger.print(
                f"already at step {self.step} >= trainer.max_steps={t.max_steps}: nothing to "
                "train (raise trainer.max_steps to continue)"
            )
        if self.data.valid_note:
            label = "validation" if self.data.valid is not None else "no validation"
            self.logger.print(f"[yellow]{label}:[/yellow] {escape(self.data.valid_note)}")
        # Handlers stay installed to the end: a stop signal after the last step lets the
        # (nearly done) run finish instead of killing it mid-save.
        with StopRequests(self.device, announce=self.ps.rank == 0) as stop:
            if self._train_loop(stop):
                return self._stop_now(stop)
            return self._finish()

    def _pp_note(self) -> str:
        if self.pipeline is None:
            return ""
        p = self.cfg.pipeline
        return f" pp={self.ps.pp_size} ({p.schedule}, {self.pipeline.model.num_stages} stages)"

    def _finish(self) -> dict:
        """The final checkpoint, evaluation, model export and sample."""
        t = self.cfg.trainer
        self.guard.check_any_good()
        if self.cfg.checkpoint.every and self._saved_step != self.step:
            self._save_checkpoint()
        evaluated_now = t.eval_every and self.step % t.eval_every == 0
        summary = {
            "history": self.history,
            "eval": self._last_eval if evaluated_now else self._report_eval(),
        }
        self._write_metrics(summary)
        summary["checkpoint"] = self._save()
        summary["sample"] = self._sample()
        self.logger.close()  # last: the final evaluation's scalars still go to TensorBoard
        return summary

    def _train_loop(self, stop: StopRequests) -> bool:
        """Steps until ``trainer.max_steps``; True if a stop signal (on any rank) ended it."""
        t, window = self.cfg.trainer, []
        with maybe_profile(t.profile_steps, self.cfg.run_dir, self.ps.rank) as profiler_step:
            while self.step < t.max_steps:
                window.append(self.train_step())
                self.step += 1
                profiler_step()
                self.logger.advance(self.step, f"loss {window[-1]['loss']:.3f}")
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    self._log(window)
                    window = []
                if t.eval_every and self.step % t.eval_every == 0:
                    self._report_eval()
                self._maybe_fail()
                if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                    self._save_checkpoint()
                if self.step < t.max_steps and stop.should_stop():
                    return True
        return False

    def _stop_now(self, stop: StopRequests) -> dict:
        """Save where all ranks stopped and say how to go on; skip eval, export and sample."""
        if self._saved_step != self.step:
            self._save_checkpoint()
        self.logger.print(
            f"stopped by {stop.name} after step {self.step}/{self.cfg.trainer.max_steps}: "
            f"checkpoint saved in {checkpoint_dir(self.cfg)}; run the same command to resume"
        )
        self.logger.close()
        return {"history": self.history, "stopped_by": stop.name, "step": self.step}

    def _write_metrics(self, summary: dict) -> None:
        """``trainer.metrics_file``: every step's time breakdown (the scaling study reads it)."""
        t = self.cfg.trainer
        if not t.metrics_file or self.ps.rank != 0:
            return
        header = {
            "workload": "pretrain",
            "tp_size": self.ps.tp_size,
            "dp_size": self.ps.dp_size,
            "world_size": self.ps.world_size,
            "micro_batch": t.micro_batch,
            "global_batch": t.global_batch,
        }
        extras = {
            "seq_len": self.cfg.data.seq_len,
            "precision": self.precision,
            "lr": self.cfg.optim.lr,
            "step_timing": t.step_timing,
            "history": self.history,
            "eval": summary["eval"],
        }
        self.timer.write(t.metrics_file, header, extras)

    def _report_eval(self) -> dict[str, float] | None:
        result = self.evaluate()
        if result is not None:
            self.logger.print(
                f"step {self.step:>5}  validation loss {result['valid/loss']:.4f}  "
                f"perplexity {result['valid/ppl']:.2f}"
            )
            self.logger.scalars(self.step, result)
        self._last_eval = result
        return result

    def _train_state(self) -> dict:
        """What besides tensors a bitwise resume needs (RNG states go with each rank)."""
        scaler = self.scaler and self.scaler.state_dict()
        return {
            "data": self.data.train.state_dict(),
            "loss_scaler": scaler,
            "config": asdict(self.cfg),
            "tokenizer": self._tokenizer,
        }

    def _save_checkpoint(self) -> None:
        self._mark("checkpoint save", "world")
        self.dp.wait_params()
        if not self.guard.may_save(self.step, self.params):
            return
        start = time.perf_counter()
        path = save_checkpoint(
            checkpoint_dir(self.cfg),
            self.step,
            model=self.model,
            optimizer=self.dp,
            ps=self.ps,
            state=self._train_state(),
            keep=self.cfg.checkpoint.keep,
            log=lambda msg: self.logger.print(msg, markup=False),
        )
        self._saved_step = self.step
        self.logger.print(f"saved checkpoint {path} in {time.perf_counter() - start:.2f} s")

    def _resume(self) -> None:
        """Continue from the newest usable checkpoint, resharding if the layout changed."""
        start = time.perf_counter()
        self._mark("checkpoint load", "world")
        loaded = load_checkpoint(
            checkpoint_dir(self.cfg),
            model=self.model,
            optimizer=self.dp,
            ps=self.ps,
            log=self.logger.print,
        )
        if loaded is None:
            return
        self.step = self._saved_step = loaded.step
        self.logger.resumed_at(loaded.step)
        self.data.train.load_state_dict(loaded.state["data"])
        if self.scaler is not None and loaded.state.get("loss_scaler"):
            self.scaler.load_state_dict(loaded.state["loss_scaler"])
        was, note = loaded.layout, ""
        if (was["tp_size"], was["dp_size"]) != (self.ps.tp_size, self.ps.dp_size):
            note = f", resharded from tp={was['tp_size']} dp={was['dp_size']}"
        if was.get("pp_size", 1) != self.ps.pp_size:
            note += f", resharded from pp={was.get('pp_size', 1)}"
        if not loaded.rng_restored:  # other ranks, other streams: fresh ones from this step
            self.ps.seed(self.cfg.trainer.seed + loaded.step)
            note += ", RNG reseeded"
        self.logger.print(
            f"resuming from step {loaded.step} ({loaded.path}{note}, "
            f"loaded in {time.perf_counter() - start:.2f} s)"
        )
        change = schedule_change(
            loaded.state.get("config", {}), self.cfg.optim, self.cfg.trainer.max_steps
        )
        if change:
            self.logger.print(change, markup=False)

    def _maybe_fail(self) -> None:
        """Fault injection for restart tests: rank 1 dies once after ``trainer.fail_at_step``.

        Before that step's checkpoint, so the restart must recompute from an older one; a
        marker file in the checkpoint directory makes it happen only once.
        """
        if self.step != self.cfg.trainer.fail_at_step:
            return
        marker = os.path.join(checkpoint_dir(self.cfg), f".failed_at_step_{self.step}")
        if self.ps.rank == min(1, self.ps.world_size - 1) and not os.path.exists(marker):
            os.makedirs(checkpoint_dir(self.cfg), exist_ok=True)
            open(marker, "w").close()
            os._exit(17)

    def _save(self) -> str | None:
        self._mark("final model export", "world")
        self.dp.wait_params()
        if not self.cfg.checkpoint.save_final or not self.guard.may_save(self.step, self.params):
            return None
        from engine.checkpoint.format import save_model

        directory = os.path.join(checkpoint_dir(self.cfg), "final")
        save_model(self.model, directory, tokenizer=self.cfg.data.tokenizer)
        self.logger.print(f"saved the final model to {directory}")
        return directory

    def _sample(self) -> str | None:
        t = self.cfg.trainer
        if not self.cfg.model.causal or t.sample_tokens < 1:
            return None
        if self.pipeline is not None:
            self.logger.print("no sample: generation runs unpipelined (pp_size=1)")
            return None
        self._mark("sampling", "model")
        tokenizer = self.data.tokenizer
        prompt = tokenizer.encode(t.sample_prompt).ids
        ids = generate(
            self.model,
            prompt,
            t.sample_tokens,
            temperature=t.sample_temperature,
            top_k=t.sample_top_k,
            seed=t.seed,
        )
        text = tokenizer.decode(ids)
        self.logger.print("[bold]sample:[/bold]")
        self.logger.print(text, markup=False)
        return text


def run_worker(cfg: Config) -> dict:
    """Entry of every rank: build the mesh, train, tear down."""
    ps = bootstrap_rank(
        lambda world: parallel_dims(cfg, world),
        device=cfg.trainer.device,
        rendezvous_timeout_s=cfg.trainer.rendezvous_timeout_s,
        run_dir=cfg.run_dir,
    )
    watch = Watchdog(cfg.trainer.collective_timeout_s, rank=ps.rank, run_dir=cfg.run_dir)
    try:
        with watch.active():
            summary = Trainer(cfg, ps, watch).fit()
    finally:
        watch.close()
        parallel_state.destroy()
    if summary.get("stopped_by") and detect_launch().launcher == "torchrun":
        # Exit now rather than return to torch's elastic agent: an agent that is itself
        # shutting down on the signal never collects the return value, and its worker
        # would wait for that until the agent kills it, 30 s later.
        raise SystemExit(EXIT_PREEMPTED)
    # Every rank reports a stop, so each launcher-started process can exit with its code.
    return summary if ps.rank == 0 else {k: v for k, v in summary.items() if k == "stopped_by"}
