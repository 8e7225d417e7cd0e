"""The step loop: data -> forward/backward per microbatch -> global-norm clip -> AdamW, built from TorchTitan's parts
(runner/run/titan/); each phase is its own function so monitors can time and trace it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.config import checkpoint, hf_folder, runfiles
from runner.config.layout import Layout
from runner.config.schema import FaultTolerance, MismatchAction, RunConfig
from runner.observe import integrity, monitor, plan_check
from runner.observe.monitor import StepMonitor
from runner.outputs import breakdown, goodput
from runner.run import evaluate, ft, loader, preempt, profiling, report, step_sync, titan, update
from runner.run.accounting import Accounting, row
from runner.run.checkpointer import Checkpointer, restarted
from runner.run.device import DevicePolicy
from runner.run.metrics import Sink


def build_optimizer(cfg: RunConfig, parts: list[torch.nn.Module]):
    t = cfg.training
    # fused, TorchTitan's default: foreach's ten kernels each paid DTensor's first sharding propagation (+0.4-0.7 s, update 1)
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay, fused=True)
    warmup = t.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return opt, sched


def forward_backward(built: titan.Built, loss_fn, microbatches, global_tokens: torch.Tensor, mon: StepMonitor) -> torch.Tensor:
    """Accumulate gradients over this rank's microbatches; return its share of the loss (with CP,
    the share of its sequence chunks: the loss divides by the global token count either way)."""
    losses = []
    for full_inputs, full_labels in microbatches:
        inputs, labels, extra = titan.model_inputs(built, full_inputs, full_labels)
        with mon.phase("forward"):
            pred = built.parts[0](inputs, **extra)
            mon.after_forward()
            loss, _ = loss_fn(pred, labels, global_tokens)
            loss = mon.corrupt(loss)
        del pred
        with mon.phase("backward"):
            loss.backward()
        losses.append(loss.detach())
    return titan.local_value(sum(losses))  # left on the device: the step reads it once, with the grad norm (DevicePolicy.read)


def on_device(microbatches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The data streams produce CPU tensors; the model, the loss and the pipeline schedule take them on the
    compute device (TorchTitan's own train step moves its labels the same way)."""
    return [(inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)) for inputs, labels in microbatches]


@dataclass
class Hooks:
    """What a caller may observe inside the step loop (the parity harness does): `before_clip(step, parts)` once the
    gradients are complete, before the global-norm clip; `after_init(record)` with what this rank read of model.init_from
    (titan.load_hf's record), once the weights are in."""

    before_clip: Callable[[int, list[torch.nn.Module]], None] | None = None
    after_init: Callable[[dict[str, Any]], None] | None = None


@dataclass
class _Loop:
    """What one run of the step loop holds: the model and data, the optimizer, the observers."""

    cfg: RunConfig
    lay: Layout
    built: titan.Built
    data: Any
    acc: Accounting
    sinks: list[Sink]
    hooks: Hooks
    policy: DevicePolicy
    opt: Any
    sched: Any
    loss_fn: Any
    global_tokens: torch.Tensor
    timer: Any
    mon: StepMonitor
    guard: monitor.LossGuard
    ckpt: Checkpointer
    watch: preempt.RankWatch
    run_dir: Path
    integrity: integrity.Checker
    eval_data: Any = None  # the held-out split (runner.run.loader, split="eval"); None when eval.interval is 0
    feed: loader.Prefetch = None
    ft: Any = ft.OFF  # fault_tolerance=torchft: this replica group's torchft Manager (runner.run.ft.Replica); no-ops when off
    stopped: bool = False  # SLURM's warning signal: checkpointed after the last step, the job is requeued
    pending: bool = False  # the last step was accepted and its optimizer step is still to run (_update)
    rows: list[dict[str, Any]] = field(default_factory=list)
    timeline: goodput.Timeline | None = None  # rank 0 of a launched run: each step and the end (runner.outputs.goodput)
    final_checkpoint_s: float = 0.0  # the end: waiting for the last async save, exporting the model
    finish_from: float = 0.0  # wall clock once the last save is written: the finish part starts (runner.outputs.goodput)
    prof: profiling.Session | None = None  # profile.* (None when off and profile.memory is off)


def _compute(loop: _Loop, microbatches) -> torch.Tensor:
    """Forward/backward (or the pipeline schedule); returns this rank's loss share."""
    built, mon = loop.built, loop.mon
    if built.schedule is None:
        return forward_backward(built, loop.loss_fn, microbatches, loop.global_tokens, mon)
    span = mon.timeline.start()  # the schedule on the policy's timeline clock, beside its stages' busy time
    with mon.phase("pipeline"):
        local = titan.pipeline_step(built, microbatches, loop.global_tokens)
    mon.pipeline(mon.timeline.stop(span), loop.timer)
    return local


def _train_step(loop: _Loop, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward (twice at a replay check) and the clip; returns this rank's loss share and the global grad norm,
    both on the device."""
    built, mon = loop.built, loop.mon
    with torch.profiler.record_function(breakdown.DATA_SPAN):
        microbatches = on_device(loop.feed.get(step - 1), loop.policy.compute_device())
    if loop.integrity.replay_due(step):
        local = loop.integrity.replay(
            step, lambda: _compute(loop, microbatches), built.parts, lambda: loop.opt.zero_grad(set_to_none=True), mon
        )
    else:
        local = _compute(loop, microbatches)
    if loop.hooks.before_clip is not None:
        loop.hooks.before_clip(step, built.parts)
    with mon.phase("optimizer"):
        grad_norm = titan.clip_grad_norm_tensor(built.parts, loop.cfg.training.max_norm, built.parallel_dims)
    return local, titan.local_value(grad_norm)


def _rewind(loop: _Loop) -> int:
    """Reload the whole state from the last checkpoint before the spike streak; the guard keeps its bad steps."""
    guard = loop.guard
    loop.ckpt.wait()
    back = loop.ckpt.restore(loop.built, loop.opt, loop.sched, loop.data, guard, before=guard.streak_start)
    if back is None:
        raise RuntimeError(f"loss guard: {guard.cfg.max_consecutive} spikes in a row and no checkpoint before step {guard.streak_start}")
    return back


def _start(loop: _Loop) -> int:
    """First step to run: after the newest complete checkpoint when resuming (by hand or after an elastic restart)."""
    step, done = 1, None
    if loop.cfg.checkpoint.resume or restarted() or preempt.requeued():
        done = loop.ckpt.restore(loop.built, loop.opt, loop.sched, loop.data, loop.guard)
        step = 1 if done is None else done + 1
        loop.ft.resume_at(step)
        if done is None and dist.get_rank() == 0:
            print(f"checkpoint: nothing to resume in {loop.ckpt.folder}; starting at step 1", flush=True)
    if done is None and loop.cfg.model.init_from:  # the run's own checkpoint takes precedence
        _from_hf(loop)
    line = loader.check_inputs(loop.data, loop.lay.dp_rank, step - 1, loop.policy)
    if dist.get_rank() == 0:
        print(line, flush=True)
        if profiling.enabled(loop.cfg.profile) or loop.cfg.profile.memory:
            print("\n".join(profiling.console_lines(loop.cfg.profile, loop.lay, loop.run_dir, loop.policy)), flush=True)
    if profiling.enabled(loop.cfg.profile) or loop.cfg.profile.memory:
        loop.prof = profiling.Session(loop.cfg.profile, loop.lay, dist.get_rank(), loop.run_dir, loop.policy, step)
    if loop.timeline is not None:
        loop.timeline.mark("restored", step=step - 1)
    return step


def _from_hf(loop: _Loop) -> None:
    """Step 0: this rank's share of model.init_from's weights. The optimizer holds no state before its first step,
    so it starts fresh on them."""
    m = loop.cfg.model
    t0 = time.perf_counter()
    got = titan.load_hf(loop.built, Path(m.init_from))
    if loop.hooks.after_init is not None:
        loop.hooks.after_init(got)
    if dist.get_rank() == 0:
        sha = (m.init_record or hf_folder.record(Path(m.init_from)))["config_sha256"]
        print(
            f"step 0: started from Hugging Face weights in {m.init_from} (config.json sha256 {sha}; rank 0 read "
            f"{len(got['keys'])} tensors in {time.perf_counter() - t0:.1f} s); optimizer state starts fresh",
            flush=True,
        )


def _check_replicas(loop: _Loop, step: int) -> dict[str, Any]:
    """At monitor.integrity.interval: compare replicas; on a mismatch stop, or rewind (row fields of the step)."""
    found = loop.integrity.check(step, loop.built.parts)
    if not found:
        return {}
    cfg = loop.cfg.monitor.integrity
    where = f"report in {loop.integrity.path}"
    if cfg.on_mismatch == MismatchAction.stop:
        raise integrity.IntegrityError(f"{integrity.describe(found[0])} ({len(found)} mismatches); stopping ({where})")
    loop.ckpt.wait()
    back = loop.ckpt.restore(loop.built, loop.opt, loop.sched, loop.data, loop.guard, before=step + 1)
    if back is None:
        raise integrity.IntegrityError(f"{integrity.describe(found[0])}: no checkpoint to rewind to at or before step {step} ({where})")
    return {"rewound_to": back}


def _setup(cfg, lay, built, data, acc, sinks, run_dir, recorder, hooks, policy, eval_data=None) -> _Loop:
    t = cfg.training
    opt, sched = build_optimizer(cfg, built.parts)
    titan.register_optimizer_hooks(built, opt)
    mon = StepMonitor(cfg.monitor, policy, lay.coords, dist.get_rank(), recorder, run_dir, compiled=t.compile)
    policy.count_syncs()
    return _Loop(
        cfg=cfg,
        lay=lay,
        built=built,
        data=data,
        acc=acc,
        sinks=sinks,
        hooks=hooks or Hooks(),
        policy=policy,
        opt=opt,
        sched=sched,
        loss_fn=titan.loss_fn(cfg),
        global_tokens=torch.tensor(float(t.global_batch_size * t.seq_len)),
        timer=plan_check.StageTimer(built.schedule, mon.timeline) if built.schedule is not None else None,
        mon=mon,
        guard=monitor.LossGuard(cfg.monitor.guard),
        ckpt=Checkpointer(
            cfg.checkpoint,
            checkpoint.folder(cfg.checkpoint, run_dir),
            num_steps=t.steps,
            origin=checkpoint.origin(cfg, lay),
            policy=policy,
            shared=cfg.fault_tolerance.name != FaultTolerance.none,  # a restarting replica group leaves the live one's save alone
        ),
        eval_data=eval_data,
        feed=loader.Prefetch(data, pin=policy.pins_host_batches),
        watch=preempt.rank_watch(),
        run_dir=run_dir,
        integrity=integrity.Checker(cfg.monitor.integrity, cfg.monitor.inject, lay, dist.get_rank(), policy, run_dir, mon.who),
        ft=ft.replica(cfg, built.parts, opt, sched, policy, run_dir),
    )


def _measure(loop: _Loop, step: int) -> tuple[dict[str, Any], monitor.Verdict, bool]:
    """Train the step and judge it: its metrics row, the guard's verdict, whether the ranks stop for SLURM. Outside
    logging and check steps this is the step's one host synchronization and its one host collective."""
    mon, policy = loop.mon, loop.policy
    mon.begin_step(step)
    loop.ft.begin(step)
    lanes = loader.digest_lanes(loop.data, step - 1)
    if loop.prof is not None:
        report.log_terms(loop, loop.prof.enter(step))
    t0 = time.perf_counter()
    update.apply(loop)  # the last step's accepted update, timed with this step
    loop.integrity.begin_step(step, loop.built.parts)
    local, norm = _train_step(loop, step)
    share, grad_norm = policy.read(local, norm)  # waits for the step's kernels (the update's too)
    with mon.phase("loss"):
        shared = step_sync.exchange(policy, loop.lay, dist.get_rank(), share, lanes, loop.watch.signalled)
    dt = time.perf_counter() - t0
    if loop.prof is not None:
        loop.prof.end(step, dt)
    loss = loop.ft.global_loss(shared.loss)
    verdict = loop.guard.check(step, loss, grad_norm)  # loss and norm are global: every rank decides alike
    lr = loop.opt.param_groups[0]["lr"]
    update.decide(loop, step, verdict, shared.stop, loop.ft.should_commit())  # torchft's vote (always True with it off)
    replicas = _check_replicas(loop, step) if loop.integrity.check_due(step) else {}
    flagged = mon.end_step()
    r = row(step, loss, grad_norm, dt, lr, loop.cfg, loop.acc, policy.max_memory_gb())
    r |= {"skipped_steps": loop.guard.skipped, "straggler_windows": mon.windows_judged}
    r |= {"integrity_checks": loop.integrity.checks, "replay_checks": loop.integrity.replays}
    r["data_hash"] = shared.data_hash
    r["data_s"] = loop.feed.waited_s  # how long the step waited for its batch (read ahead in a background thread)
    if flagged:
        r["stragglers"] = flagged
    if loop.prof is not None and profiling.profiled(loop.cfg.profile, step):
        r["profiled"] = True  # the profiler ran: left out of the medians
    r |= loop.ft.row(step, r, loop.built.parts)
    return r | replicas, verdict, shared.stop


def _step(loop: _Loop, step: int) -> int:
    """Train `step` (or leave it out after a rewind); returns the next step."""
    guard, policy = loop.guard, loop.policy
    started, p0 = time.time(), time.monotonic()  # the step's overhead: its own clock, apart from dt's
    if step in guard.bad_steps:  # replaying after a rewind: this batch already spiked, leave it out
        update.apply(loop)
        loop.sched.step()
        return step + 1
    syncs = policy.host_syncs
    r, verdict, stop = _measure(loop, step)
    spent = {"overhead_s": time.monotonic() - p0 - r["step_time_s"]}  # outside dt: the batch check, the monitors, the row
    if preempt.requeued():
        r["slurm_restart"] = preempt.restart_count()
    if verdict.spike:
        r |= {"spike": verdict.spike, "action": verdict.action}
    found = loop.integrity.take()
    if found:
        r["integrity"] = found
    if "rewound_to" not in r:  # else the replicas disagreed and the run rewound already
        if verdict.action == "rewind":
            r |= {"rewound_to": _rewind(loop), "bad_steps": sorted(guard.bad_steps)}
        elif loop.eval_data is not None and evaluate.due(loop.cfg.eval.interval, step, loop.cfg.training.steps):
            r |= _evaluate(loop)
    if "rewound_to" not in r and not _stop_for_slurm(loop, step, r, stop) and loop.ckpt.due(step) and loop.ft.saves():
        r["checkpoint_s"] = loop.ckpt.save(step, loop.built, loop.opt, loop.sched, loop.data, guard)
    r["host_syncs"] = policy.host_syncs - syncs  # the step's host synchronizations with the device (DevicePolicy.host_syncs)
    report.publish(loop, step, r, bool(verdict.spike or "stragglers" in r or found or "profiled" in r), started, spent)
    return r["rewound_to"] + 1 if "rewound_to" in r else loop.ft.next_step(step)


def _evaluate(loop: _Loop) -> dict[str, float]:
    """One evaluation pass (runner.run.evaluate) on the weights after this step's update: its loss, perplexity and time."""
    t0, device = time.perf_counter(), loop.policy.compute_device()
    batches = (on_device(loop.eval_data.microbatches(k), device) for k in range(loop.cfg.eval.steps))
    local = evaluate.local_loss(loop.built, loop.loss_fn, batches, loop.global_tokens)  # the eval batch is the training batch
    return evaluate.row(evaluate.global_loss(local, loop.lay, loop.policy) / loop.cfg.eval.steps, time.perf_counter() - t0)


def _stop_for_slurm(loop: _Loop, step: int, r: dict[str, Any], agreed: bool) -> bool:
    """SLURM's warning signal reached some rank: every rank stops after this step with a synchronous,
    published checkpoint (runner.run.preempt). Without checkpoints there is nothing to resume from: the
    job trains on until SLURM ends it."""
    if loop.stopped or step >= loop.cfg.training.steps or not agreed:  # the last step just finishes
        return False
    if not loop.ckpt.enabled:
        if dist.get_rank() == 0 and not loop.watch.warned:
            print(f"preempt: {preempt.SIGNAL.name} at step {step}, but checkpoint.enable=false: nothing to resume from, no requeue")
        loop.watch.warned = True
        return False
    t0 = time.perf_counter()
    loop.ckpt.save(step, loop.built, loop.opt, loop.sched, loop.data, loop.guard)
    loop.ckpt.wait()  # written and published before the ranks exit
    saved = time.perf_counter() - t0
    r |= {"checkpoint_s": saved, "preempted": preempt.SIGNAL.name}
    if dist.get_rank() == 0:
        path = checkpoint.final_path(loop.ckpt.folder, step)
        entry = preempt.record(loop.run_dir, step, path, saved, loop.watch.signalled_at)
        print(f"preempt: {entry['signal']}: stopped after step {step}, checkpoint {path} ({saved:.2f} s); the job is requeued", flush=True)
    loop.stopped = True
    return True


def _finish(loop: _Loop, step: int) -> dict[str, Any]:
    """Publish the last checkpoint, export the model, and the run's summary (gathered over ranks)."""
    cfg, rows = loop.cfg, loop.rows
    update.apply(loop)  # the last step's update ran at once (update.reads_weights); this is the guarantee
    t0 = time.perf_counter()
    loop.ckpt.wait()  # an async save in flight is written and published before the run ends
    loop.feed.close()
    if cfg.checkpoint.enable and cfg.checkpoint.export_final_model:
        loop.ckpt.export_model(loop.built)
    if cfg.checkpoint.enable and cfg.checkpoint.export_hf:
        loop.ckpt.export_hf(cfg.data)
    loop.final_checkpoint_s = time.perf_counter() - t0
    loop.finish_from = time.time()
    if not rows:
        raise RuntimeError(f"nothing to train: the checkpoint resumed from is at step {step - 1} >= training.steps {cfg.training.steps}")
    return report.summary(loop)


def run(
    cfg: RunConfig,
    lay: Layout,
    built: titan.Built,
    data: loader.SyntheticData | loader.TextData | loader.TokenData,
    acc: Accounting,
    sinks: list[Sink],
    run_dir: Path,
    policy: DevicePolicy,
    recorder=None,
    hooks: Hooks | None = None,
    eval_data: loader.SyntheticData | loader.TextData | None = None,
    timeline: goodput.Timeline | None = None,
) -> list[dict[str, Any]]:
    """Train cfg.training.steps steps (from a checkpoint when resuming), evaluating on `eval_data` (the held-out split)
    every eval.interval steps; every rank returns its rows. Rank 0 of a launched run records its steps and its end in
    `timeline` and closes with the goodput line (runner.outputs.goodput)."""
    loop = _setup(cfg, lay, built, data, acc, sinks, run_dir, recorder, hooks, policy, eval_data)
    loop.timeline = timeline
    step = _start(loop)
    with profiling.oom_dump(loop.prof and loop.prof.memory, dist.get_rank()):
        while step <= cfg.training.steps and not loop.stopped:
            step = _step(loop, step)
    if loop.prof is not None:
        report.log_terms(loop, loop.prof.close(step - 1))
    if loop.stopped:  # requeued: the summary is the finished run's
        loop.feed.close()
        loop.finish_from = time.time()
        if timeline is not None:
            figures = timeline.end(loop.finish_from, loop.final_checkpoint_s, stopped=True)
            print(goodput.line(figures, run_dir / runfiles.GOODPUT, " so far (the job is requeued)"), flush=True)
        return loop.rows
    summary = _finish(loop, step)
    if timeline is not None:
        summary["goodput"] = timeline.end(loop.finish_from, loop.final_checkpoint_s)  # summary.json and W&B keep it
    loop.ft.close()
    for s in sinks:
        s.close(summary)
    if timeline is not None:
        print(goodput.line(summary["goodput"], run_dir / runfiles.GOODPUT), flush=True)
    return loop.rows
