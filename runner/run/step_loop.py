"""One step of the step loop, top to bottom: data -> forward/backward per microbatch (or the pipeline schedule) ->
global-norm clip -> the step's one host read and one host collective -> the loss guard's verdict -> the optimizer update,
deferred to the next step -> evaluation, checkpoint, the row. Built from TorchTitan's parts (runner/run/titan/); each phase
is a method of StepLoop so monitors can time and trace it. A run of steps (build, resume, the end) is runner.run.train.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.formats import checkpoint, runfiles
from runner.formats.metrics_row import StepRow
from runner.observe import attribution, integrity, layer_stats, loss_guard, plan_check
from runner.observe.monitor import StepMonitor
from runner.outputs import breakdown
from runner.outputs.timeline import Timeline
from runner.run import evaluate, expert_load, ft, loader, preempt, profiling, step_sync, titan, token_data
from runner.run.accounting import Accounting, CompileClock, row
from runner.run.checkpointer import Checkpointer
from runner.run.device import DevicePolicy
from runner.run.metrics import Sink
from runner.schema import MismatchAction, RunConfig
from runner.schema.layout import Layout


def forward_backward(built: titan.Built, loss_fn, microbatches, global_tokens: torch.Tensor, mon: StepMonitor) -> torch.Tensor:
    """Accumulate gradients over this rank's microbatches; return its share of the loss (with CP,
    the share of its sequence chunks: the loss divides by the global token count either way)."""
    losses = []
    for mb in microbatches:
        inputs, labels, extra = titan.model_inputs(built, mb.inputs, mb.labels, positions=mb.positions)
        with mon.phase("forward"):
            pred = built.parts[0](inputs, **extra)
            mon.faults.after_forward()  # TEST-ONLY injection (runner.observe.fault_injection); nothing otherwise
            loss, _ = loss_fn(pred, labels, global_tokens, **titan.loss_inputs(extra, labels))
            loss = mon.faults.corrupt(loss)
        del pred
        with mon.phase("backward"):
            loss.backward()
        losses.append(loss.detach())
    return titan.local_value(sum(losses))  # left on the device: the step reads it once, with the grad norm (DevicePolicy.read)


def on_device(microbatches: list[loader.Microbatch], device: torch.device) -> list[loader.Microbatch]:
    """The data streams produce CPU tensors; the model, the loss and the pipeline schedule take them on the
    compute device (TorchTitan's own train step moves its labels the same way)."""
    return [loader.Microbatch(*(None if t is None else t.to(device, non_blocking=True) for t in mb)) for mb in microbatches]


@dataclass
class Hooks:
    """What a caller may observe inside the step loop (the parity harness does): `before_clip(step, parts)` once the
    gradients are complete, before the global-norm clip; `after_init(record)` with what this rank read of model.init_from
    (titan.load_hf's record), once the weights are in."""

    before_clip: Callable[[int, list[torch.nn.Module]], None] | None = None
    after_init: Callable[[dict[str, Any]], None] | None = None


@dataclass
class StepLoop:
    """The step loop's state: the model and data, the optimizer, the observers, and what carries from one step to the
    next (the deferred update, the rows). runner.run.train.build makes one, and its `run` calls `step` until the last."""

    cfg: RunConfig
    lay: Layout
    built: titan.Built
    data: loader.SyntheticData | loader.TextData | token_data.TokenData
    acc: Accounting
    sinks: list[Sink]
    hooks: Hooks
    policy: DevicePolicy
    opt: titan.Optimizers  # one optimizer per model part (runner.run.titan.build_optimizer)
    sched: titan.LRSchedulers  # its learning-rate schedule
    loss_fn: titan.BaseLoss
    global_tokens: torch.Tensor
    timer: plan_check.StageTimer | None  # a pipeline's stage timer (None without one)
    mon: StepMonitor
    guard: loss_guard.LossGuard
    ckpt: Checkpointer
    watch: preempt.RankWatch
    run_dir: Path
    integrity: integrity.Checker
    # the held-out split (runner.run.loader, split="eval"); None when eval.interval is 0
    eval_data: loader.SyntheticData | loader.TextData | token_data.TokenData | None = None
    feed: loader.Prefetch | None = None
    # fault_tolerance=torchft: this replica group's torchft Manager (runner.run.ft.Replica); no-ops when off
    ft: ft.Off | ft.Replica = ft.OFF
    experts: expert_load.ExpertLoad | expert_load.Off = expert_load.OFF  # MoE models: token counts at logged steps
    layers: layer_stats.LayerStats | layer_stats.Off = layer_stats.OFF  # per-block statistics at logged and flagged steps
    stopped: bool = False  # SLURM's warning signal: checkpointed after the last step, the job is requeued
    pending: bool = False  # the last step was accepted and its optimizer step is still to run (apply_update)
    rows: list[dict[str, Any]] = field(default_factory=list)
    timeline: Timeline | None = None  # rank 0 of a launched run: each step and the end (runner.outputs.timeline)

    prof: profiling.Session | None = None  # profile.* (None when off and profile.memory is off)
    # training.gc_every: TorchTitan's GarbageCollection, every rank collecting at the same steps
    collector: titan.GarbageCollection | None = None
    compiling: CompileClock | None = None  # training.compile: compilation inside each step (goodput's own part)
    attributor: attribution.Attributor | None = None  # replays the guard's flagged steps (None: not attributed)
    # this step's RNG state and batch on the device: what a flagged step is replayed from
    replay_from: tuple[tuple[torch.Tensor, torch.Tensor | None], list[loader.Microbatch]] | None = None
    replayed: dict[str, list] | None = None  # the per-block statistics of the last attribution replay

    # --- one step, top to bottom ---------------------------------------------------------------------------------

    def step(self, step: int) -> int:
        """Train `step` (or leave it out after a rewind); returns the next step."""
        guard, policy = self.guard, self.policy
        started, p0 = time.time(), time.monotonic()  # the step's overhead: its own clock, apart from dt's
        if step in guard.bad_steps:  # replaying after a rewind: this batch already spiked, leave it out
            self.left_out(step)
            self.apply_update()
            self.sched.step()
            return step + 1
        syncs = policy.host_syncs
        r, verdict, stop = self.measure(step)
        spent = {"overhead_s": time.monotonic() - p0 - r.step_time_s}  # outside dt: the batch check, the monitors, the row
        if preempt.requeued():
            r.slurm_restart = preempt.restart_count()
        if verdict.spike:
            r.spike, r.action = verdict.spike, verdict.action
        if verdict.action == "accept" and dist.get_rank() == 0:
            print(guard.describe(step, verdict), flush=True)
        found = self.integrity.take()
        r.integrity = found or None
        if r.rewound_to is None:  # else the replicas disagreed and the run rewound already
            if verdict.action == "rewind":
                r.rewound_to, r.bad_steps = self.rewind(), sorted(guard.bad_steps)
            elif self.eval_data is not None and evaluate.due(self.cfg.eval.interval, step, self.cfg.training.steps):
                r.add(self.evaluate())
        if r.rewound_to is None and not self.stop_for_slurm(step, r, stop) and self.ckpt.due(step) and self.ft.saves():
            r.checkpoint_s = self.ckpt.save(step, self.built, self.opt, self.sched, self.data, guard)
            r.checkpoint_tier = self.ckpt.last_tier
        if self.collector is not None:
            g0 = time.monotonic()
            if self.collector.run(step):  # at multiples of training.gc_every, on every rank alike
                r.gc_s = time.monotonic() - g0
        r.host_syncs = policy.host_syncs - syncs  # the step's host synchronizations with the device (DevicePolicy.host_syncs)
        self.publish(step, r, bool(verdict.spike or r.stragglers or found or r.profiled), started, spent)
        return r.rewound_to + 1 if r.rewound_to is not None else self.ft.next_step(step)

    def measure(self, step: int) -> tuple[StepRow, loss_guard.Verdict, bool]:
        """Train the step and judge it: its metrics row, the guard's verdict, whether the ranks stop for SLURM. Outside
        logging and check steps this is the step's one host synchronization and its one host collective."""
        mon, policy = self.mon, self.policy
        mon.begin_step(step)
        self.ft.begin(step)
        lanes = loader.digest_lanes(self.data, step - 1)
        if self.prof is not None:
            self.log_terms(self.prof.enter(step))
        if self.compiling is not None:
            self.compiling.take()  # compiled outside a step (an evaluation pass): its own part's time, not this step's
        t0 = time.perf_counter()
        self.apply_update()  # the last step's accepted update, timed with this step
        mon.faults.flip(step, self.built.parts)  # TEST-ONLY injection, as faults.shifted below
        local, norm = self.train_step(step)
        stats = self.layers.take()  # at logged steps: the per-block table, read with the rest
        # waits for the step's kernels (the update's too)
        share, grad_norm, *counts = policy.read(local, norm, *stats, *self.experts.collect(step))
        blocks, counts = (self.layers.row(counts), counts[4 * self.layers.n :]) if stats else (None, counts)
        extra = self.experts.summands(step, counts)  # at logged steps of an MoE model: its experts' token counts
        first = (share, grad_norm)
        with mon.phase("loss"):
            shared = step_sync.exchange(policy, self.lay, dist.get_rank(), share, lanes, self.watch.signalled, extra)
        dt = time.perf_counter() - t0
        if self.prof is not None:
            self.prof.end(step, dt)
        loss = self.ft.global_loss(shared.loss)
        grad_norm = mon.faults.shifted(step, grad_norm)  # as read, unless a test shifts it
        verdict = self.guard.check(step, loss, grad_norm)  # loss and norm are global: every rank decides alike
        found = self.attribute(step, verdict, first)  # a flagged step: the data or the hardware, before the optimizer acts
        blocks = self.replayed or blocks  # a flagged step's blocks as its replay saw them
        if blocks is not None and verdict.action in ("ok", "accept"):
            self.layers.accept(blocks)
        lr = titan.current_lr(self.opt)  # the rate this step's update uses
        self.decide_update(step, verdict, shared.stop, self.ft.should_commit())  # torchft's vote (always True with it off)
        replicas = self.check_replicas(step) if self.integrity.check_due(step) else {}
        if found is not None and found["verdict"] == attribution.HARDWARE and "rewound_to" not in replicas:
            replicas = self.mismatch(step, found["mismatches"], self.attributor.path)
        flagged = mon.end_step()
        r = StepRow(
            **row(step, loss, grad_norm, dt, lr, self.cfg, self.acc, policy.max_memory_gb()),
            skipped_steps=self.guard.skipped,
            straggler_windows=mon.windows_judged,
            integrity_checks=self.integrity.checks,
            replay_checks=self.integrity.replays,
            data_hash=shared.data_hash,
            data_s=self.feed.waited_s,  # how long the step waited for its batch (read ahead in a background thread)
            stragglers=flagged or None,
        )
        if self.compiling is not None:
            r.compile_s = self.compiling.take()  # inside dt: counted apart from productive time (runner.outputs.goodput)
        if found is not None:
            r.verdict, r.verdict_ranks = found["verdict"], found["ranks"]
        if blocks is not None:
            r.layers = blocks  # per-block statistics (runner.observe.layer_stats)
        if self.prof is not None and profiling.profiled(self.cfg.profile, step):
            r.profiled = True  # the profiler ran: left out of the medians
        r.add(self.ft.row(step, r, self.built.parts)).add(self.experts.row(step, shared.extra))
        return r.add(replicas), verdict, shared.stop

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward (twice at a replay check) and the clip; returns this rank's loss share and the global grad norm,
        both on the device."""
        built, mon = self.built, self.mon
        with torch.profiler.record_function(breakdown.DATA_SPAN):
            microbatches = on_device(self.feed.get(step - 1), self.policy.compute_device())
        self.replay_from = (self.policy.rng_state(), microbatches) if self.attributor is not None else None
        self.layers.arm(step % self.cfg.logging.log_every == 0 or step == self.cfg.training.steps)
        if self.integrity.replay_due(step):
            local = self.integrity.replay(
                step, lambda: self.compute(microbatches), built.parts, lambda: self.opt.zero_grad(set_to_none=True), mon
            )
        else:
            local = self.compute(microbatches)
        self.layers.gather()
        if self.hooks.before_clip is not None:
            self.hooks.before_clip(step, built.parts)
        with mon.phase("optimizer"):
            grad_norm = titan.clip_grad_norm_tensor(built.parts, self.cfg.training.max_norm, built.parallel_dims)
        return local, titan.local_value(grad_norm)

    def attribute(self, step: int, verdict: loss_guard.Verdict, first: tuple[float, float]) -> dict[str, Any] | None:
        """A flagged step replayed from its batch and RNG state (runner.observe.attribution). A hardware verdict takes the
        step back from the guard (it says nothing of the data) and leaves it unapplied; `mismatch` then decides."""
        self.replayed = None
        if not verdict.spike or self.attributor is None or self.ft is not ft.OFF:  # torchft: replica groups are separate jobs
            return None
        rng, microbatches = self.replay_from
        zero_grad = lambda: self.opt.zero_grad(set_to_none=True)  # noqa: E731
        again, samples = (lambda: self.recompute(microbatches)), (lambda: self.data.step_samples(step - 1))
        blame = lambda: self.layers.blame(self.replayed) if self.replayed else None  # noqa: E731
        found = self.attributor.judge(step, verdict, first, again, self.built.parts, zero_grad, rng, self.mon, samples, blame)
        if found["verdict"] == attribution.HARDWARE:
            self.guard.revert()
            verdict.action = attribution.HARDWARE
        return found

    def recompute(self, microbatches) -> tuple[float, float]:
        """The step's forward/backward and clip again; this rank's loss share and the global grad norm on the host. The
        replay's per-block statistics, read with them, are `replayed`."""
        self.layers.arm(True)
        local = self.compute(microbatches)
        self.layers.gather()
        with self.mon.phase("optimizer"):
            norm = titan.clip_grad_norm_tensor(self.built.parts, self.cfg.training.max_norm, self.built.parallel_dims)
        stats = self.layers.take()
        share, grad_norm, *values = self.policy.read(local, titan.local_value(norm), *stats)
        self.replayed = self.layers.row(values) if stats else None
        return share, grad_norm

    def compute(self, microbatches) -> torch.Tensor:
        """Forward/backward (or the pipeline schedule); returns this rank's loss share."""
        built, mon = self.built, self.mon
        self.layers.begin()
        if built.schedule is None:
            return forward_backward(built, self.loss_fn, microbatches, self.global_tokens, mon)
        span = mon.timeline.start()  # the schedule on the policy's timeline clock, beside its stages' busy time
        with mon.phase("pipeline"):
            local = titan.pipeline_step(built, microbatches, self.global_tokens)
        mon.pipeline(mon.timeline.stop(span), self.timer)
        return local

    # --- the optimizer update, one step late ---------------------------------------------------------------------

    def apply_update(self) -> None:
        """The optimizer step of the last step, once the guard accepted it. It runs one step late, at the start of the next
        step (or at once when something reads the weights: decide_update): the verdict needs the global loss and grad norm
        on the host, which costs the step's one host synchronization (DevicePolicy.read); run after the verdict in the same
        step, the update would need a second one before dt. So a step's dt holds one update and one forward/backward, and
        a spike still never reaches the weights."""
        if not self.pending:
            return
        self.pending = False
        self.ckpt.staged()  # an async checkpoint's copy of the weights is taken before they change
        with self.mon.phase("optimizer"):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()

    def decide_update(self, step: int, verdict: loss_guard.Verdict, stop: bool, committed: bool) -> None:
        """An accepted step's update waits for the next step (apply_update); a spike's gradients are dropped now, and so
        are a step's that torchft's quorum did not commit (its schedule does not advance either)."""
        self.pending = verdict.action in ("ok", "accept") and committed
        if not self.pending:
            self.opt.zero_grad(set_to_none=True)  # a spike's gradients never reach the weights
            titan.clear_counts(self.built.parts)  # nor its experts' token counts the next expert-bias update
            if committed:
                self.sched.step()
        elif self.reads_weights(step, stop):
            self.apply_update()

    def reads_weights(self, step: int, stop: bool) -> bool:
        """Whether anything reads the weights after `step` before the next step updates them. Under torchft the next
        step's quorum may send them to a recovering group, so the update is never deferred there."""
        cfg = self.cfg
        evaluating = self.eval_data is not None and evaluate.due(cfg.eval.interval, step, cfg.training.steps)
        due = step >= cfg.training.steps or stop or evaluating or self.ckpt.due(step) or self.integrity.check_due(step)
        return due or self.ft is not ft.OFF

    # --- after the step: checks, evaluation, SLURM, the row ------------------------------------------------------

    def left_out(self, step: int) -> None:
        """Record the batch a rewind leaves out (left_out.jsonl, rank 0): its global samples and where each comes from."""
        if dist.get_rank() == 0:
            with open(self.run_dir / runfiles.LEFT_OUT, "a") as fh:
                fh.write(json.dumps({"step": step, "samples": self.data.step_samples(step - 1)}) + "\n")

    def rewind(self) -> int:
        """Reload the whole state from the last checkpoint before the spike streak; the guard keeps its bad steps."""
        guard = self.guard
        self.ckpt.wait()
        back = self.ckpt.restore(self.built, self.opt, self.sched, self.data, guard, before=guard.streak_start)
        if back is None:
            raise RuntimeError(
                f"loss guard: {guard.cfg.max_consecutive} spikes in a row and no checkpoint before step {guard.streak_start}"
            )
        return back

    def check_replicas(self, step: int) -> dict[str, Any]:
        """At monitor.integrity.interval: compare replicas; on a mismatch stop, or rewind (row fields of the step)."""
        found = self.integrity.check(step, self.built.parts)
        return self.mismatch(step, found, self.integrity.path) if found else {}

    def mismatch(self, step: int, found: list[dict[str, Any]], report: Path) -> dict[str, Any]:
        """monitor.integrity.on_mismatch: stop, or rewind to the newest checkpoint at or before the step."""
        where = f"report in {report}"
        if self.cfg.monitor.integrity.on_mismatch == MismatchAction.stop:
            raise integrity.IntegrityError(f"{integrity.describe(found[0])} ({len(found)} mismatches); stopping ({where})")
        self.ckpt.wait()
        back = self.ckpt.restore(self.built, self.opt, self.sched, self.data, self.guard, before=step + 1)
        if back is None:
            raise integrity.IntegrityError(f"{integrity.describe(found[0])}: no checkpoint to rewind to at or before step {step} ({where})")
        return {"rewound_to": back}

    def evaluate(self) -> dict[str, float]:
        """One evaluation pass (runner.run.evaluate) on the weights after this step's update: its loss, perplexity and time."""
        t0, device = time.perf_counter(), self.policy.compute_device()
        batches = (on_device(self.eval_data.microbatches(k), device) for k in range(self.cfg.eval.steps))
        local = evaluate.local_loss(self.built, self.loss_fn, batches, self.global_tokens)  # the eval batch is the training batch
        return evaluate.row(evaluate.global_loss(local, self.lay, self.policy) / self.cfg.eval.steps, time.perf_counter() - t0)

    def stop_for_slurm(self, step: int, r: StepRow, agreed: bool) -> bool:
        """SLURM's warning signal reached some rank: every rank stops after this step with a synchronous,
        published checkpoint (runner.run.preempt). Without checkpoints there is nothing to resume from: the
        job trains on until SLURM ends it."""
        if self.stopped or step >= self.cfg.training.steps or not agreed:  # the last step just finishes
            return False
        if not self.ckpt.enabled:
            if dist.get_rank() == 0 and not self.watch.warned:
                print(f"preempt: {preempt.SIGNAL.name} at step {step}, but checkpoint.enable=false: nothing to resume from, no requeue")
            self.watch.warned = True
            return False
        t0 = time.perf_counter()
        self.ckpt.save(step, self.built, self.opt, self.sched, self.data, self.guard, shared=True)
        self.ckpt.wait()  # written and published before the ranks exit
        saved = time.perf_counter() - t0
        r.checkpoint_s, r.preempted = saved, preempt.SIGNAL.name
        if dist.get_rank() == 0:
            path = checkpoint.final_path(self.ckpt.folder, step)
            entry = preempt.record(self.run_dir, step, path, saved, self.watch.signalled_at)
            print(
                f"preempt: {entry['signal']}: stopped after step {step}, checkpoint {path} ({saved:.2f} s); the job is requeued", flush=True
            )
        self.stopped = True
        return True

    def publish(self, step: int, r: StepRow, notable: bool, started: float, spent: dict[str, float]) -> None:
        """After the step's save: publish a finished async save, log the row when due, record the step on the timeline."""
        p2 = time.monotonic()
        self.ckpt.poll()
        p3 = time.monotonic()
        spent["publish_s"] = p3 - p2
        logged = r.as_json()
        self.rows.append(logged)
        if step % self.cfg.logging.log_every == 0 or step == self.cfg.training.steps or notable or r.eval_loss is not None or self.stopped:
            for s in self.sinks:
                s.log(logged)
        self.mon.finished_step()
        spent["overhead_s"] += time.monotonic() - p3
        if self.timeline is not None:
            self.timeline.step(logged, started, **spent)

    def log_terms(self, found: dict[str, Any] | None) -> None:
        """A traced step's terms (the busiest traced rank's) to the sinks that chart them per step (W&B)."""
        if found is not None:
            for s in self.sinks:
                s.log_breakdown(found)
