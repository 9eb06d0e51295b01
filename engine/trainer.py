"""The training loop: steps, DP gradient sync, clipping, precision, eval, logging.

How a step runs its micro-batches (on this rank alone, or through pipeline stages) is the
step runner's (``engine.runner``), chosen once; the loop never asks which."""

from __future__ import annotations

from dataclasses import asdict

import torch
from rich.markup import escape

from engine import comm, flops, moe_observe
from engine.bootstrap import cap_device_memory
from engine.checkpoint.run import RunCheckpoints, tensorboard_dir
from engine.config import Config, resolve_precision
from engine.data.run_data import build_run_data
from engine.data_parallel import DataParallel, DynamicLossScaler, build_data_parallel
from engine.generate import sample_text
from engine.inference import initial_weights
from engine.mesh_report import describe_mesh
from engine.models import build_model
from engine.observe import RunLogger, format_step_line, maybe_profile, perplexity, window_metrics
from engine.optim import lr_at, resume_notes
from engine.resilience.faults import fail_once_at
from engine.resilience.guard import BadStepGuard
from engine.resilience.preemption import StopRequests
from engine.resilience.watchdog import Watchdog
from engine.runner import AUTOCAST_DTYPES, autocast_for, build_step_runner
from engine.step_timer import StepTimer, breakdown_metrics, format_breakdown
from parallel_state import ParallelState


def model_groups(ps: ParallelState) -> tuple[str, ...]:
    """The roles and axes whose groups the model's own collectives use: TP's, and the
    gradient group's where it works inside forward and backward (its buckets at tp=1,
    FSDP's gathers when DP shards gradients or parameters), the MoE ep all-to-alls' expert."""
    fsdp = ps.dims.dp_shard in ("gradients", "full") and ps.size("grad") > 1
    names = ("grad",) if ps.size("tp") == 1 else (("tp", "grad") if fsdp else ("tp",))
    return (*names, "expert") if ps.size("expert") > 1 else names


class Trainer:
    """Pre-trains ``cfg.model`` on this rank's part of the mesh.

    bf16/fp16 run the forward under autocast; gradients, their DP reduction and the optimizer
    are fp32. The data-parallel strategy (``self.dp``, chosen once from ``parallel.dp_shard``)
    reduces gradients and steps the optimizer: the bucketed all-reduce keeps fp32 parameters,
    ZeRO-1 keeps bf16 ones beside fp32 master slices when training in bf16. fp16 adds dynamic
    loss scaling with mesh-wide overflow detection. The step runner (``self.runner``) runs each
    step's micro-batches. A resumable checkpoint is saved every ``checkpoint.every`` steps and
    at the end, and a new run continues from the newest one (at any layout).
    """

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        watch: Watchdog | None = None,
        *,
        threads: str | None = None,
    ) -> None:
        """``threads``: the bootstrap's core-split line, said under the mesh line."""
        self.cfg, self.ps, self.device, self.threads = cfg, ps, ps.device, threads
        self.watch = watch or Watchdog(0, rank=ps.rank, run_dir=cfg.run_dir)
        self.precision = resolve_precision(cfg.trainer.precision, ps.device.type)
        cap_device_memory(cfg.trainer.memory_cap_gib, ps.device)
        ps.seed(cfg.trainer.seed)
        model = build_model(cfg.model, ps, device=ps.device)
        started = initial_weights(cfg, model, ps)  # checkpoint.init_from, if set and used
        self.runner = build_step_runner(model, cfg, ps, autocast=self._autocast)
        self.model = self.runner.model  # under a pipeline: this rank's stages
        self.dp = self._build_data_parallel()
        self.params = self.dp.params  # FSDP registers sharded parameters of its own
        self.scaler = (
            DynamicLossScaler(cfg.trainer.loss_scale_init) if self.precision == "fp16" else None
        )
        self.data = build_run_data(cfg, ps.rank_in("batch"), ps.size("batch"))
        self._build_observers()
        self.step = 0
        self.checkpoints = RunCheckpoints(
            cfg, model=self.model, optimizer=self.dp, ps=ps, say=self.logger.print
        )
        self._last_eval: dict[str, float] | None = None
        self.history: list[tuple[int, float]] = []
        self._resume(started)

    def _build_data_parallel(self) -> DataParallel:
        """The DP strategy of ``optim.distributed``, reducing over the gradient groups."""
        cfg, ps = self.cfg, self.ps
        return build_data_parallel(
            self.model,
            cfg.optim,
            grad_group=ps.group("grad"),
            tp_group=ps.group("tp"),
            device=ps.device,
            expert_groups=(ps.group("expert"), ps.group("expert_grad")),
            bucket_size_mb=cfg.trainer.grad_bucket_mb,
            overlap=cfg.trainer.overlap_grad_reduce,
            low_precision=torch.bfloat16 if self.precision == "bf16" else None,
            dp_shard=ps.dims.dp_shard,
            compile_backend=cfg.model.compile_backend if cfg.model.compile else None,
            hybrid_groups=(ps.group("fsdp_shard"), ps.group("fsdp_replicate")),
            offload=cfg.parallel.offload,
        )

    def _build_observers(self) -> None:
        """The step timer, the run logger and the bad-step guard."""
        cfg, ps = self.cfg, self.ps
        self.flops_per_step = flops.model_flops_per_step(cfg)
        peak_dtype = AUTOCAST_DTYPES.get(self.precision, torch.float32)
        self.peak_flops = flops.peak_flops(ps.device, peak_dtype)
        self.timer = StepTimer(
            ps.device,
            enabled=cfg.trainer.step_timing,
            flops_per_step=self.flops_per_step,
            tokens_per_step=cfg.trainer.global_batch * cfg.data.seq_len,
            world_size=ps.world_size,
            dp_size=ps.size("grad"),
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

    def _autocast(self):
        return autocast_for(self.precision, self.device.type)

    def _mark(self, what: str, group: str, step: int | None = None) -> None:
        """Tell the watchdog what this rank does now and whose group it may wait on: a role
        or axis of the mesh, "model" (the model's own collectives) or "world"."""
        if group == "world":
            label, members = group, list(range(self.ps.world_size))
        else:
            names = model_groups(self.ps) if group == "model" else (group,)
            label = " and ".join(self.ps.dims.live_axes(*names))
            members = sorted({r for n in names for r in self.ps.ranks(n)})
        self.watch.mark(what, self.step if step is None else step, label, members)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns this rank's step metrics."""
        step = self.step + 1
        self._mark(*self.runner.waits_on(), step)
        self.timer.start()
        micro_batches = self.data.train.next_step()
        self.timer.lap()
        loss_scale = self.scaler.scale if self.scaler else 1.0
        total = self.runner.forward_backward(micro_batches, self.dp, loss_scale=loss_scale)
        self.timer.lap()
        self._mark("gradient all-reduce", "grad", step)
        grads = self.dp.finish_grads()
        for what, group, hook in self.runner.post_reduction(self.dp):
            self._mark(what, group, step)
            hook()
        self.timer.lap()
        self._mark("gradient norm and optimizer step", "model", step)
        skipped = self._unscale(grads)
        norm = self.runner.global_norm(self.dp.grad_norm())
        lr = lr_at(self.step, self.cfg.optim, self.cfg.trainer.max_steps)
        scale = self.scaler and self.scaler.scale
        self._mark("bad-step check", "world", step)
        if not self.guard.check(
            step, total.item(), norm.item(), overflow=skipped, loss_scale=scale
        ):
            self.dp.step(lr=lr, max_norm=self.cfg.optim.clip_grad, norm=norm)
        self.dp.zero_grad()
        self.timer.lap()
        extra = self.runner.timings() if self.timer.enabled else {}
        record = self.timer.finish(step=step, loss=total.item(), **extra)
        return {
            **record,
            "grad_norm": norm.item(),
            "lr": lr,
            "skipped": float(skipped),
            "step_time": record["step_time_s"],
            "dp_comm": record["dp_comm_exposed_s"],
        }

    def _unscale(self, grads: list[torch.Tensor]) -> bool:
        """fp16: whether any rank's gradients overflowed (the step is then skipped), else
        unscale them; either way the loss scale adapts. Without fp16: False."""
        if self.scaler is None:
            return False
        return self.scaler.skip_or_unscale(grads, [self.ps.group(n) for n in ("tp", "grad", "pp")])

    def _loss_mean(self, value: float) -> float:
        self._mark("loss average", "loss")
        return comm.mean(value, self.ps.group("loss"), self.device)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean validation loss (and perplexity) over a fixed set of sequences.

        The set is the validation split's first ``trainer.eval_batches`` micro-batches,
        the same at every layout; micro-batch j runs on batch rank j mod the batch group's
        size, and the mean is over micro-batches, so the result does not depend on it.
        """
        t = self.cfg.trainer
        if self.data.valid is None or t.eval_batches < 1:
            return None
        self._mark("evaluation", "model")
        loss = self.runner.fixed_set_loss(self.data.valid, t.eval_batches)
        return {"valid/loss": loss, "valid/ppl": perplexity(loss)}

    def _log(self, window: list[dict[str, float]]) -> None:
        loss = self._loss_mean(sum(m["loss"] for m in window) / len(window))
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
        metrics |= breakdown_metrics(window)
        line = format_step_line(self.step, t.max_steps, metrics) + format_breakdown(metrics)
        if self.scaler:
            skipped = int(sum(m["skipped"] for m in window))
            line += f"  (skipped {skipped} overflow steps, loss scale {self.scaler.scale:g})"
        self.logger.print(line)
        self.logger.scalars(self.step, metrics)
        moe_observe.log_moe(self.runner, self.step, self.logger)  # MoE runs: a line more

    def fit(self) -> dict:
        """Train for ``trainer.max_steps`` steps, evaluate, save and sample; return a summary."""
        t, dp = self.cfg.trainer, self.ps.size("batch")
        self.logger.print(
            f"[bold]meshtron[/bold] {self.cfg.name}: {self.cfg.model.arch} "
            f"h={self.cfg.model.hidden_size} l={self.cfg.model.num_layers}  tp={self.ps.size('tp')} "
            f"dp={dp}{self.runner.console_note()}  precision={self.precision}  "
            f"global batch {t.global_batch} = {t.micro_batch} micro × {dp} dp × "
            f"{self.data.train.accum_steps} accum"
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
        with StopRequests(self.device, announce=self.ps.rank == 0) as stop, self.checkpoints:
            if self._train_loop(stop):
                return self._stop_now(stop)
            return self._finish()

    def _finish(self) -> dict:
        """The final checkpoint, evaluation, model export and sample."""
        t = self.cfg.trainer
        self.guard.check_any_good()
        if self.cfg.checkpoint.every and self.checkpoints.saved_step != self.step:
            self._save_checkpoint()
        evaluated_now = t.eval_every and self.step % t.eval_every == 0
        summary = {
            "history": self.history,
            "eval": self._last_eval if evaluated_now else self._report_eval(),
        }
        self._write_metrics(summary)
        summary["checkpoint"] = self._save()
        summary["sample"] = self._sample(summary["checkpoint"])
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
                self.logger.advance(self.step, window[-1]["loss"])
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    self._log(window)
                    window = []
                if t.eval_every and self.step % t.eval_every == 0:
                    self._report_eval()
                fail_once_at(self.step, t.fail_at_step, self.checkpoints.directory, self.ps)
                if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                    self._save_checkpoint()
                if self.step < t.max_steps and stop.should_stop():
                    return True
        return False

    def _stop_now(self, stop: StopRequests) -> dict:
        """Save where all ranks stopped and say how to go on; skip eval, export and sample."""
        if self.checkpoints.saved_step != self.step:
            self._save_checkpoint()
        self.logger.print(
            f"stopped by {stop.name} after step {self.step}/{self.cfg.trainer.max_steps}: "
            f"checkpoint saved in {self.checkpoints.directory}; run the same command to resume"
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
            "tp_size": self.ps.size("tp"),
            "dp_size": self.ps.size("dp"),
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
        self.timer.write(t.metrics_file, header, extras | moe_observe.moe_metrics(self.runner))

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

    def _save_checkpoint(self) -> None:
        self._mark("checkpoint save", "world")
        self.dp.wait_params()
        if self.guard.may_save(self.step, self.params):
            scaler = self.scaler and self.scaler.state_dict()
            self.checkpoints.save(self.step, data=self.data.train.state_dict(), loss_scaler=scaler)

    def _resume(self, started: list[str]) -> None:
        """Say what ``started`` the weights; continue from the newest usable checkpoint."""
        self._mark("checkpoint load", "world")
        for line in started:
            self.logger.print(line, markup=False)
        resumed = self.checkpoints.load() if self.cfg.checkpoint.resume else None
        if resumed is None:
            return
        loaded, line = resumed
        self.step = loaded.step
        self.logger.resumed_at(loaded.step)
        self.data.train.load_state_dict(loaded.state["data"])
        if self.scaler is not None and loaded.state.get("loss_scaler"):
            self.scaler.load_state_dict(loaded.state["loss_scaler"])
        self.logger.print(line)
        saved, consumed = loaded.state.get("config", {}), self.data.train.consumed_samples
        for note in resume_notes(saved, self.cfg, consumed):
            self.logger.print(note, markup=False)

    def _save(self) -> str | None:
        self._mark("final model export", "world")
        self.dp.wait_params()
        if not self.cfg.checkpoint.save_final or not self.guard.may_save(self.step, self.params):
            return None
        return self.checkpoints.export()

    def _sample(self, final: str | None) -> str | None:
        t = self.cfg.trainer
        if not self.cfg.model.causal or t.sample_tokens < 1:
            return None
        if self.runner.sample_refusal:  # the exported model (``final``) samples at any layout
            how = f"; python tools/generate.py --ckpt {final} samples it" if final else ""
            self.logger.print(self.runner.sample_refusal + how, markup=False)
            return None
        self._mark("sampling", "model")
        text = sample_text(self.model, self.data.tokenizer, t)
        self.logger.print("[bold]sample:[/bold]")
        self.logger.print(text, markup=False)
        return text
