"""A run of the step loop: build it (optimizer, monitors, checkpointer, integrity checker, torchft), start it (resume from a
checkpoint, or the weights of model.init_from or checkpoint.init_from), train step after step
(runner.run.step_loop.StepLoop), and end it (the last save published, the model exported, the summary gathered over
ranks, the goodput line; or, when SLURM's warning stopped it, the requeue's closing line)."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.formats import checkpoint, hf_folder, runfiles
from runner.observe import attribution, integrity, layer_stats, loss_guard, plan_check, rank_recorder
from runner.observe.monitor import StepMonitor
from runner.outputs import goodput
from runner.outputs.timeline import Timeline
from runner.run import evaluate, expert_load, ft, loader, peak, preempt, profiling, titan, token_data
from runner.run.accounting import Accounting, CompileClock, summarize
from runner.run.checkpointer import Checkpointer, restarted
from runner.run.device import DevicePolicy
from runner.run.metrics import Sink
from runner.run.step_loop import Hooks, StepLoop
from runner.schema import FaultTolerance, RunConfig
from runner.schema.layout import Layout, group_of


def run(
    cfg: RunConfig,
    lay: Layout,
    built: titan.Built,
    data: loader.SyntheticData | loader.TextData | token_data.TokenData,
    acc: Accounting,
    sinks: list[Sink],
    run_dir: Path,
    policy: DevicePolicy,
    recorder=None,
    hooks: Hooks | None = None,
    eval_data: loader.SyntheticData | loader.TextData | None = None,
    timeline: Timeline | None = None,
) -> list[dict[str, Any]]:
    """Train cfg.training.steps steps (from a checkpoint when resuming), evaluating on `eval_data` (the held-out split)
    every eval.interval steps; every rank returns its rows. Rank 0 of a launched run records its steps and its end in
    `timeline` and closes with the goodput line (runner.outputs.goodput)."""
    loop = build(cfg, lay, built, data, acc, sinks, run_dir, recorder, hooks, policy, eval_data, timeline)
    step = start(loop)
    loop.collector = titan.garbage_collection(cfg.training.gc_every)  # automatic collection off until the loop ends
    try:
        with profiling.oom_dump(loop.prof and loop.prof.memory, dist.get_rank()):
            while step <= cfg.training.steps and not loop.stopped:
                step = loop.step(step)
    finally:
        if loop.collector is not None:
            gc.enable()
    if loop.prof is not None:
        loop.log_terms(loop.prof.close(step - 1))
    return stop(loop) if loop.stopped else finish(loop, step)


def build(
    cfg: RunConfig,
    lay: Layout,
    built: titan.Built,
    data: loader.SyntheticData | loader.TextData | token_data.TokenData,
    acc: Accounting,
    sinks: list[Sink],
    run_dir: Path,
    recorder: rank_recorder.RankRecorder | None,
    hooks: Hooks | None,
    policy: DevicePolicy,
    eval_data: loader.SyntheticData | loader.TextData | token_data.TokenData | None = None,
    timeline: Timeline | None = None,
) -> StepLoop:
    t = cfg.training
    opt, sched = titan.build_optimizer(cfg, built.parts)
    titan.register_optimizer_hooks(built, opt)
    mon = StepMonitor(cfg.monitor, policy, lay.coords, dist.get_rank(), recorder, run_dir, compiled=t.compile)
    policy.count_syncs()
    return StepLoop(
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
        timer=plan_check.StageTimer(titan.pipeline_stages(built.schedule), mon.timeline) if built.schedule is not None else None,
        mon=mon,
        guard=loss_guard.LossGuard(cfg.monitor.guard),
        ckpt=Checkpointer(
            cfg.checkpoint,
            checkpoint.folder(cfg.checkpoint, run_dir),
            num_steps=t.steps,
            origin=checkpoint.origin(cfg, lay),
            policy=policy,
            shared=cfg.fault_tolerance.name != FaultTolerance.none,  # a restarting replica group leaves the live one's save alone
            inject=cfg.monitor.inject,
        ),
        eval_data=eval_data,
        feed=loader.Prefetch(data, pin=policy.pins_host_batches),
        watch=preempt.rank_watch(),
        run_dir=run_dir,
        integrity=integrity.Checker(cfg.monitor.integrity, lay, dist.get_rank(), policy, run_dir, mon.who),
        attributor=attribution.Attributor(policy, mon.who, dist.get_rank(), run_dir, cfg.monitor.integrity.on_mismatch, tp_groups(lay)),
        ft=ft.replica(cfg, built.parts, opt, sched, policy, run_dir),
        experts=expert_load.of(cfg, lay, dist.get_rank(), policy, built.parts, run_dir),
        layers=layer_stats.of(cfg, lay, built.parts, policy.compute_device()),
        timeline=timeline,
        compiling=CompileClock().install() if t.compile else None,
    )


def tp_groups(lay: Layout) -> list[list[int]]:
    """The ranks of each tensor-parallel group: their loss shares must agree (runner.observe.attribution)."""
    return [list(g) for g in sorted({tuple(group_of(lay, r, "tp")) for r in range(lay.world_size)})]


def start(loop: StepLoop) -> int:
    """First step to run: after the newest complete checkpoint when resuming (by hand or after an elastic restart); else
    step 1, from model.init_from's or checkpoint.init_from's weights when set."""
    cfg = loop.cfg
    step, done = 1, None
    if cfg.checkpoint.resume or restarted() or preempt.requeued():
        done = loop.ckpt.restore(loop.built, loop.opt, loop.sched, loop.data, loop.guard)
        step = 1 if done is None else done + 1
        loop.ft.resume_at(step)
        if done is None and dist.get_rank() == 0:
            print(f"checkpoint: nothing to resume in {loop.ckpt.folder}; starting at step 1", flush=True)
    if done is None and cfg.model.init_from:  # the run's own checkpoint takes precedence
        load_hf(loop)
    elif done is None and cfg.checkpoint.init_from:  # validation refuses both
        load_weights(loop)
    line = loader.check_inputs(loop.data, loop.lay.dp_rank, step - 1, loop.policy)
    profiled = profiling.enabled(cfg.profile) or cfg.profile.memory
    if dist.get_rank() == 0:
        print(line, flush=True)
        if profiled:
            print("\n".join(profiling.console_lines(cfg.profile, loop.lay, loop.run_dir, loop.policy)), flush=True)
    if profiled:
        loop.prof = profiling.Session(cfg.profile, loop.lay, dist.get_rank(), loop.run_dir, loop.policy, step)
    if loop.timeline is not None:
        loop.timeline.mark("restored", step=step - 1, **loop.ckpt.restored_from)
    return step


def load_hf(loop: StepLoop) -> None:
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


def load_weights(loop: StepLoop) -> None:
    """Step 0: the model weights of checkpoint.init_from's checkpoint (a new phase), resharded onto this layout; the
    optimizer, learning-rate schedule and data position start fresh, as built."""
    c = loop.cfg.checkpoint
    t0 = time.perf_counter()
    path, info = loop.ckpt.load_weights(loop.built, c.init_from)
    if dist.get_rank() == 0:
        rec = c.init_record or checkpoint.weights_record(path)  # pinned when frozen; an in-process run computes it
        print(
            f"step 0: started from the model weights of checkpoint {path} (step {rec['step']}, layout {info.get('layout')}; "
            f"{checkpoint.MARKER} files sha256 {rec['files_sha256']}; {time.perf_counter() - t0:.1f} s); optimizer, "
            "learning-rate schedule and data position start fresh",
            flush=True,
        )


def stop(loop: StepLoop) -> list[dict[str, Any]]:
    """Requeued after SLURM's warning: the steps so far; the summary is the finished run's."""
    loop.feed.close()
    loop.layers.remove()
    if loop.compiling is not None:
        loop.compiling.remove()
    if loop.timeline is not None:
        figures = loop.timeline.end(time.time(), 0.0, stopped=True)
        print(goodput.line(figures, loop.run_dir / runfiles.GOODPUT, " so far (the job is requeued)"), flush=True)
    return loop.rows


def finish(loop: StepLoop, step: int) -> list[dict[str, Any]]:
    """Publish the last checkpoint, export the model, write the run's summary to the sinks and close them; every rank
    returns its rows."""
    cfg = loop.cfg
    loop.apply_update()  # the last step's update ran at once (StepLoop.reads_weights); this is the guarantee
    t0 = time.perf_counter()
    loop.ckpt.wait()  # an async save in flight is written and published before the run ends
    if loop.ckpt.local is not None and not loop.stopped:  # the run's local checkpoints are the job's: gone when it ends well
        loop.ckpt.local.remove()
    loop.feed.close()
    loop.layers.remove()
    if loop.compiling is not None:
        loop.compiling.remove()
    if cfg.checkpoint.enable and cfg.checkpoint.export_final_model:
        loop.ckpt.export_model(loop.built)
    if cfg.checkpoint.enable and cfg.checkpoint.export_hf:
        loop.ckpt.export_hf(cfg)
    final_checkpoint_s = time.perf_counter() - t0
    finish_from = time.time()  # once the last save is written: the finish part of goodput starts
    if not loop.rows:
        raise RuntimeError(f"nothing to train: the checkpoint resumed from is at step {step - 1} >= training.steps {cfg.training.steps}")
    s = summary(loop)
    if loop.timeline is not None:
        s["goodput"] = loop.timeline.end(finish_from, final_checkpoint_s)  # summary.json and W&B keep it
    loop.ft.close()
    for sink in loop.sinks:
        sink.close(s)
    if loop.timeline is not None:
        print(goodput.line(s["goodput"], loop.run_dir / runfiles.GOODPUT), flush=True)
    return loop.rows


def summary(loop: StepLoop) -> dict[str, Any]:
    """The run's summary (gathered over ranks): medians, monitors, evaluation, peak memory, the plan checked against
    the measured step time, and the traced steps' breakdown."""
    cfg, lay, rows, acc, policy, guard = loop.cfg, loop.lay, loop.rows, loop.acc, loop.policy, loop.guard
    out = summarize(rows, cfg, lay, acc)
    guarded = {"skipped_steps": guard.skipped, "rewinds": guard.rewinds, "bad_steps": sorted(guard.bad_steps)}
    out["monitor"] = loop.mon.summary() | guarded | loop.integrity.summary() | loop.attributor.summary()
    out |= evaluate.summary(rows)
    peak_mem = policy.all_reduce(torch.tensor([max(r["memory_gb"] for r in rows)], dtype=torch.float64), op=dist.ReduceOp.MAX)
    out["memory_gb_max"] = float(peak_mem)
    idle = loop.mon.idle
    bubble = plan_check.mean_over_ranks(policy, statistics.median(idle[1:] or idle)) if idle else None
    found = loop.prof.write() if loop.prof is not None else None
    out["plan_check"] = plan_check.compare(
        cfg,
        lay,
        peak.profile_source(cfg, policy),
        acc.peak_flops_total / lay.world_size / 1e12,
        plan_check.allreduce_gbs(policy),
        out["step_time_s_median"],
        bubble,
        found,
    )
    if found:
        out["profile"] = {k: found[k] for k in ("busiest_rank", "steps", "step_s", "terms_s", "unattributed_share", "largest")}
    return out
