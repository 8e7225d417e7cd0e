"""The step loop: data -> forward/backward per microbatch -> global-norm clip -> AdamW.

Built from TorchTitan's parts (see runner/run/titan/); each phase is its own function so
monitors can time and trace it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.config import checkpoint
from runner.config.layout import Layout
from runner.config.schema import MismatchAction, RunConfig
from runner.observe import integrity, monitor, plan_check
from runner.observe.monitor import StepMonitor
from runner.run import evaluate, ft, loader, preempt, titan
from runner.run.accounting import Accounting, row, summarize
from runner.run.checkpointer import Checkpointer, restarted
from runner.run.device import DevicePolicy
from runner.run.metrics import Sink


def build_optimizer(cfg: RunConfig, parts: list[torch.nn.Module]):
    t = cfg.training
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay, foreach=True)
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
    return titan.local_value(sum(losses)).cpu()  # one conversion per step, not per microbatch


def on_device(microbatches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The data streams produce CPU tensors; the model, the loss and the pipeline schedule take them on the
    compute device (TorchTitan's own train step moves its labels the same way)."""
    return [(inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)) for inputs, labels in microbatches]


def global_loss(local: torch.Tensor, lay: Layout, policy: DevicePolicy) -> float:
    """Sum of the per-rank shares = mean token loss. Ranks of a TP group hold the same share,
    so only TP rank 0 contributes; non-last pipeline stages hold zero."""
    share = local if lay.coords(dist.get_rank())["tp"] == 0 else torch.zeros_like(local)
    return float(policy.all_reduce(share))


@dataclass
class Hooks:
    """What a caller may observe inside the step loop (the parity harness does)."""

    before_clip: Callable[[int, list[torch.nn.Module]], None] | None = None
    """Called with the step and the model parts once the gradients are complete, before the global-norm clip."""


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
    eval_data: Any = None
    """The held-out split (runner.run.loader, split="eval"); None when eval.interval is 0."""
    feed: loader.Prefetch = None
    ft: Any = ft.OFF
    """fault_tolerance=torchft: this replica group's torchft Manager (runner.run.ft.Replica); no-ops when off."""
    stopped: bool = False  # SLURM's warning signal: checkpointed after the last step, the job is requeued
    idle: list[float] = field(default_factory=list)  # per step: this rank's idle fraction inside the pipeline schedule
    rows: list[dict[str, Any]] = field(default_factory=list)


def _compute(loop: _Loop, microbatches) -> torch.Tensor:
    """Forward/backward (or the pipeline schedule); returns this rank's loss share."""
    built, mon = loop.built, loop.mon
    if built.schedule is not None:
        t_pp, c_pp = time.perf_counter(), mon.clock.now()
        with mon.phase("pipeline"):
            local = titan.pipeline_step(built, microbatches, loop.global_tokens)
        total, busy = time.perf_counter() - t_pp, loop.timer.take()
        loop.idle.append(1 - busy / total)
        mon.add("pp_compute", mon.clock.now() - c_pp if mon.clock.measures_cpu_time else busy)  # see StepMonitor.clock
        mon.add("pp_wait", total - busy)
    else:
        local = forward_backward(built, loop.loss_fn, microbatches, loop.global_tokens, mon)
    return local


def _train_step(loop: _Loop, step: int) -> tuple[torch.Tensor, float]:
    """Forward/backward (twice at a replay check) and the clip; returns this rank's loss share and the global grad norm."""
    built, mon = loop.built, loop.mon
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
        grad_norm = titan.clip_grad_norm(built.parts, loop.cfg.training.max_norm, built.parallel_dims)
    return local, grad_norm


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
    step = 1
    if loop.cfg.checkpoint.resume or restarted() or preempt.requeued():
        done = loop.ckpt.restore(loop.built, loop.opt, loop.sched, loop.data, loop.guard)
        step = 1 if done is None else done + 1
        loop.ft.resume_at(step)
        if done is None and dist.get_rank() == 0:
            print(f"checkpoint: nothing to resume in {loop.ckpt.folder}; starting at step 1", flush=True)
    line = loader.check_inputs(loop.data, loop.lay.dp_rank, step - 1, loop.policy)
    if dist.get_rank() == 0:
        print(line, flush=True)
    return step


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
    mon = StepMonitor(cfg.monitor, policy, lay.coords, dist.get_rank(), recorder, run_dir)
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
        timer=plan_check.StageTimer(built.schedule) if built.schedule is not None else None,
        mon=mon,
        guard=monitor.LossGuard(cfg.monitor.guard),
        ckpt=Checkpointer(
            cfg.checkpoint, checkpoint.folder(cfg.checkpoint, run_dir), num_steps=t.steps, origin=checkpoint.origin(cfg, lay), policy=policy
        ),
        eval_data=eval_data,
        feed=loader.Prefetch(data, pin=policy.pins_host_batches),
        watch=preempt.rank_watch(),
        run_dir=run_dir,
        integrity=integrity.Checker(cfg.monitor.integrity, cfg.monitor.inject, lay, dist.get_rank(), policy, run_dir, mon.who),
        ft=ft.replica(cfg, built.parts, opt, sched, policy, run_dir),
    )


def _step(loop: _Loop, step: int) -> int:
    """Train `step` (or leave it out after a rewind); returns the next step."""
    mon, guard, opt = loop.mon, loop.guard, loop.opt
    mon.begin_step(step)
    loop.ft.begin(step)
    loop.integrity.begin_step(step, loop.built.parts)
    if step in guard.bad_steps:  # replaying after a rewind: this batch already spiked, leave it out
        loop.sched.step()
        return step + 1
    digest = loader.global_digest(loop.data, step - 1, loop.policy)
    t0 = time.perf_counter()
    local, grad_norm = _train_step(loop, step)
    with mon.phase("loss"):
        loss = loop.ft.global_loss(global_loss(local, loop.lay, loop.policy))
    verdict = guard.check(step, loss, grad_norm)  # loss and norm are global: every rank decides alike
    lr = opt.param_groups[0]["lr"]
    committed = loop.ft.should_commit()  # torchft's vote (always True with fault tolerance off)
    if verdict.action == "ok" and committed:
        loop.ckpt.staged()  # an async checkpoint's copy of the weights is taken before they change
        with mon.phase("optimizer"):
            opt.step()
    opt.zero_grad(set_to_none=True)  # a spike's gradients never reach the weights
    if committed:
        loop.sched.step()
    replicas = _check_replicas(loop, step) if loop.integrity.check_due(step) else {}
    loop.policy.sync()  # the step's kernels, the optimizer's last, have run: dt times the work, not its launch
    dt = time.perf_counter() - t0
    flagged = mon.end_step()
    r = row(step, loss, grad_norm, dt, lr, loop.cfg, loop.acc, loop.policy.max_memory_gb())
    r |= {"skipped_steps": guard.skipped, "straggler_windows": mon.windows_judged}
    r |= {"integrity_checks": loop.integrity.checks, "replay_checks": loop.integrity.replays}
    r["data_hash"] = digest
    r["data_s"] = loop.feed.waited_s  # how long the step waited for its batch (read ahead in a background thread)
    if preempt.requeued():
        r["slurm_restart"] = preempt.restart_count()
    if verdict.spike:
        r |= {"spike": verdict.spike, "action": verdict.action}
    if flagged:
        r["stragglers"] = flagged
    found = loop.integrity.take()
    if found:
        r["integrity"] = found
    r |= loop.ft.row(step, r, loop.built.parts)
    if replicas:
        r |= replicas
    elif verdict.action == "rewind":
        r |= {"rewound_to": _rewind(loop), "bad_steps": sorted(guard.bad_steps)}
    elif loop.eval_data is not None and evaluate.due(loop.cfg.eval.interval, step, loop.cfg.training.steps):
        r |= _evaluate(loop)
    if "rewound_to" not in r and not _stop_for_slurm(loop, step, r) and loop.ckpt.due(step) and loop.ft.saves():
        r["checkpoint_s"] = loop.ckpt.save(step, loop.built, opt, loop.sched, loop.data, guard)
    loop.ckpt.poll()
    loop.rows.append(r)
    logged = step % loop.cfg.logging.log_every == 0 or step == loop.cfg.training.steps or verdict.spike or flagged
    if logged or "eval_loss" in r or loop.stopped or found:
        for s in loop.sinks:
            s.log(r)
    return r["rewound_to"] + 1 if "rewound_to" in r else loop.ft.next_step(step)


def _evaluate(loop: _Loop) -> dict[str, float]:
    """One evaluation pass (runner.run.evaluate) on the weights after this step's update: its loss, perplexity and time."""
    t0, device = time.perf_counter(), loop.policy.compute_device()
    batches = (on_device(loop.eval_data.microbatches(k), device) for k in range(loop.cfg.eval.steps))
    local = evaluate.local_loss(loop.built, loop.loss_fn, batches, loop.global_tokens)  # the eval batch is the training batch
    return evaluate.row(global_loss(local, loop.lay, loop.policy) / loop.cfg.eval.steps, time.perf_counter() - t0)


def _stop_for_slurm(loop: _Loop, step: int, r: dict[str, Any]) -> bool:
    """SLURM's warning signal reached some rank: every rank stops after this step with a synchronous,
    published checkpoint (runner.run.preempt). Without checkpoints there is nothing to resume from: the
    job trains on until SLURM ends it."""
    if loop.stopped or step >= loop.cfg.training.steps or not loop.watch.agreed(loop.policy):  # the last step just finishes
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
    cfg, lay, rows, acc = loop.cfg, loop.lay, loop.rows, loop.acc
    loop.ckpt.wait()  # an async save in flight is written and published before the run ends
    loop.feed.close()
    if cfg.checkpoint.enable and cfg.checkpoint.export_final_model:
        loop.ckpt.export_model(loop.built)
    if not rows:
        raise RuntimeError(f"nothing to train: the checkpoint resumed from is at step {step - 1} >= training.steps {cfg.training.steps}")
    guard = loop.guard
    summary = summarize(rows, cfg, lay, acc)
    guarded = {"skipped_steps": guard.skipped, "rewinds": guard.rewinds, "bad_steps": sorted(guard.bad_steps)}
    summary["monitor"] = loop.mon.summary() | guarded | loop.integrity.summary()
    summary |= evaluate.summary(rows)
    policy = loop.policy
    peak_mem = policy.all_reduce(torch.tensor([max(r["memory_gb"] for r in rows)], dtype=torch.float64), op=dist.ReduceOp.MAX)
    summary["memory_gb_max"] = float(peak_mem)
    idle = loop.idle
    bubble = plan_check.mean_over_ranks(policy, statistics.median(idle[1:] or idle)) if idle else None
    summary["calibration"] = plan_check.compare(
        cfg,
        lay,
        policy,
        acc.peak_flops_total / lay.world_size / 1e12,
        plan_check.allreduce_gbs(policy),
        summary["step_time_s_median"],
        bubble,
    )
    return summary


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
) -> list[dict[str, Any]]:
    """Train cfg.training.steps steps (from a checkpoint when resuming), evaluating on `eval_data` (the held-out split)
    every eval.interval steps; every rank returns its rows."""
    loop = _setup(cfg, lay, built, data, acc, sinks, run_dir, recorder, hooks, policy, eval_data)
    step = _start(loop)
    while step <= cfg.training.steps and not loop.stopped:
        step = _step(loop, step)
    if loop.stopped:  # requeued: the summary is the finished run's
        loop.feed.close()
        return loop.rows
    summary = _finish(loop, step)
    loop.ft.close()
    for s in sinks:
        s.close(summary)
    return loop.rows
