"""What a step and a run leave behind: the step's row published (sinks, goodput's timeline) and the run's summary.

`loop` is the step loop's state (runner.run.train's _Loop).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from runner.observe import plan_check
from runner.run import evaluate
from runner.run.accounting import summarize


def publish(loop, step: int, r: dict[str, Any], notable: bool, started: float, spent: dict[str, float]) -> None:
    """After the step's save: publish a finished async save, log the row when due, record the step on the timeline."""
    p2 = time.monotonic()
    loop.ckpt.poll()
    p3 = time.monotonic()
    spent["publish_s"] = p3 - p2
    loop.rows.append(r)
    if step % loop.cfg.logging.log_every == 0 or step == loop.cfg.training.steps or notable or "eval_loss" in r or loop.stopped:
        for s in loop.sinks:
            s.log(r)
    loop.mon.finished_step()
    spent["overhead_s"] += time.monotonic() - p3
    if loop.timeline is not None:
        loop.timeline.step(r, started, **spent)


def log_terms(loop, found: dict[str, Any] | None) -> None:
    """A traced step's terms (the busiest traced rank's) to the sinks that chart them per step (W&B)."""
    if found is not None:
        for s in loop.sinks:
            s.log_breakdown(found)


def summary(loop) -> dict[str, Any]:
    """The run's summary (gathered over ranks): medians, monitors, evaluation, peak memory, the plan checked against
    the measured step time, and the traced steps' breakdown."""
    cfg, lay, rows, acc = loop.cfg, loop.lay, loop.rows, loop.acc
    guard = loop.guard
    summary = summarize(rows, cfg, lay, acc)
    guarded = {"skipped_steps": guard.skipped, "rewinds": guard.rewinds, "bad_steps": sorted(guard.bad_steps)}
    summary["monitor"] = loop.mon.summary() | guarded | loop.integrity.summary()
    summary |= evaluate.summary(rows)
    policy = loop.policy
    peak_mem = policy.all_reduce(torch.tensor([max(r["memory_gb"] for r in rows)], dtype=torch.float64), op=dist.ReduceOp.MAX)
    summary["memory_gb_max"] = float(peak_mem)
    idle = loop.mon.idle
    bubble = plan_check.mean_over_ranks(policy, statistics.median(idle[1:] or idle)) if idle else None
    found = loop.prof.write() if loop.prof is not None else None
    summary["plan_check"] = plan_check.compare(
        cfg,
        lay,
        policy,
        acc.peak_flops_total / lay.world_size / 1e12,
        plan_check.allreduce_gbs(policy),
        summary["step_time_s_median"],
        bubble,
        found,
    )
    if found:
        summary["profile"] = {k: found[k] for k in ("busiest_rank", "steps", "step_s", "terms_s", "unattributed_share", "largest")}
    return summary
