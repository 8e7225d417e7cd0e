"""Validation rules of the `monitor` and `distributed` groups (torch-free; called by validate.check)."""

from __future__ import annotations

import math

from runner.schema import GuardAction, MismatchAction, RunConfig
from runner.schema.problems import Problem

HEARTBEATS_PER_TIMEOUT = 4  # a frozen rank's record must be visibly stale before its peers time out


def _straggler(cfg: RunConfig, out: list[Problem]) -> None:
    s = cfg.monitor.straggler
    for name in ("interval", "windows"):
        if getattr(s, name) < 1:
            out.append(Problem(f"monitor.straggler.{name}", getattr(s, name), "must be >= 1", f"set monitor.straggler.{name} to N >= 1"))
    if not s.factor > 1:
        out.append(Problem("monitor.straggler.factor", s.factor, "a slowdown factor must exceed 1", "use e.g. 1.3 (30 % above the median)"))
    if s.min_seconds < 0:
        out.append(Problem("monitor.straggler.min_seconds", s.min_seconds, "must be >= 0", "use 0 to judge every phase"))
    if s.min_excess_s < 0:
        out.append(Problem("monitor.straggler.min_excess_s", s.min_excess_s, "must be >= 0", "use e.g. 0.005 (5 ms), or 0 for no floor"))
    if not 0 <= s.min_step_frac < 1:
        out.append(
            Problem(
                "monitor.straggler.min_step_frac",
                s.min_step_frac,
                "a fraction of the step must be in [0, 1)",
                "use e.g. 0.02 (2 % of the step), or 0 for no floor",
            )
        )
    if not 0 < s.last_frac <= 1:
        out.append(Problem("monitor.straggler.last_frac", s.last_frac, "a fraction of steps must be in (0, 1]", "use e.g. 0.6"))
    if s.min_late_s < 0:
        out.append(Problem("monitor.straggler.min_late_s", s.min_late_s, "must be >= 0", "use e.g. 0.01 (10 ms of waiting per step)"))


def _integrity(cfg: RunConfig, out: list[Problem]) -> None:
    g = cfg.monitor.integrity
    for name in ("interval", "replay_interval"):
        if getattr(g, name) < 0:
            out.append(Problem(f"monitor.integrity.{name}", getattr(g, name), "must be >= 0", "use 0 (off) or N steps, e.g. 100"))
    if g.on_mismatch == MismatchAction.rewind and not cfg.checkpoint.enable:
        out.append(
            Problem(
                "monitor.integrity.on_mismatch", "rewind", "rewinding needs checkpoints to rewind to", "add checkpoint=local, or use stop"
            )
        )


def _moe_load(cfg: RunConfig, out: list[Problem]) -> None:
    m = cfg.monitor.moe_load
    for name, example in (("hot_factor", "2.0 (twice the mean expert's tokens)"), ("rank_factor", "1.25 (25 % above the fair share)")):
        if not getattr(m, name) > 1:
            why = "a load factor must exceed 1 (balance is 1)"
            out.append(Problem(f"monitor.moe_load.{name}", getattr(m, name), why, f"use e.g. {example}"))
    if m.windows < 1:
        out.append(Problem("monitor.moe_load.windows", m.windows, "must be >= 1", "set monitor.moe_load.windows to N >= 1, e.g. 3"))
    if m.min_tokens < 1:
        out.append(Problem("monitor.moe_load.min_tokens", m.min_tokens, "must be >= 1 (a dead expert is one with no token)", "use e.g. 16"))


def _guard(cfg: RunConfig, out: list[Problem]) -> None:
    g = cfg.monitor.guard
    if not g.factor > 1:
        out.append(Problem("monitor.guard.factor", g.factor, "a spike factor must exceed 1", "use e.g. 3.0"))
    for name, low in (("window", 1), ("warmup_steps", 0), ("max_consecutive", 1)):
        if getattr(g, name) < low:
            out.append(Problem(f"monitor.guard.{name}", getattr(g, name), f"must be >= {low}", f"set monitor.guard.{name} >= {low}"))
    if g.enable and g.window >= 1 and g.warmup_steps > g.window:  # the median holds at most `window` steps (runner.observe.monitor)
        out.append(
            Problem(
                "monitor.guard.warmup_steps",
                g.warmup_steps,
                f"exceeds monitor.guard.window = {g.window}: the running median never holds more than window accepted steps, "
                "so it never reaches warmup_steps and spike detection never starts",
                f"use monitor.guard.warmup_steps <= {g.window}, or monitor.guard.window >= {g.warmup_steps}",
            )
        )
    if g.action == GuardAction.rewind and not cfg.checkpoint.enable:
        out.append(
            Problem(
                "monitor.guard.action", "rewind", "rewinding needs checkpoints to rewind to", "add checkpoint=local, or use action=skip"
            )
        )


def _inject(cfg: RunConfig, ws: int | None, out: list[Problem]) -> None:
    i, steps = cfg.monitor.inject, cfg.training.steps
    for name in ("delay_rank", "hang_rank", "kill_rank", "flip_rank", "replay_rank", "fault_rank"):
        r = getattr(i, name)
        if r < -1 or (ws is not None and r >= ws):
            out.append(Problem(f"monitor.inject.{name}", r, f"not a rank of this job (world size {ws})", "use -1 (off) or a rank number"))
    if i.delay_frac < 0:
        out.append(Problem("monitor.inject.delay_frac", i.delay_frac, "must be >= 0", "use e.g. 0.5 for 50 % extra forward time"))
    for rank, step in (
        ("hang_rank", "hang_at_step"),
        ("kill_rank", "kill_at_step"),
        ("flip_rank", "flip_at_step"),
        ("fault_rank", "fault_at_step"),
    ):
        if getattr(i, rank) >= 0 and not 1 <= getattr(i, step) <= steps:
            out.append(Problem(f"monitor.inject.{step}", getattr(i, step), f"outside steps 1..{steps}", f"use a step in 1..{steps}"))
    if i.hang_s < 0:
        out.append(Problem("monitor.inject.hang_s", i.hang_s, "time.sleep refuses a negative time", "use e.g. 3600"))
    bad = [s for s in i.corrupt_steps if not 1 <= s <= steps]
    if bad:
        out.append(Problem("monitor.inject.corrupt_steps", bad, f"outside steps 1..{steps}", f"use steps in 1..{steps}"))
    if not 0 <= i.norm_shift_step <= steps:
        out.append(
            Problem(
                "monitor.inject.norm_shift_step", i.norm_shift_step, f"outside steps 0..{steps}", f"use 0 (off) or a step in 1..{steps}"
            )
        )
    if not i.norm_shift_scale > 0:
        out.append(Problem("monitor.inject.norm_shift_scale", i.norm_shift_scale, "must be > 0", "use e.g. 4"))
    if i.node_names and ws is not None and len(i.node_names) != ws:
        why = f"names {len(i.node_names)} ranks' nodes, the job has {ws}"
        out.append(Problem("monitor.inject.node_names", i.node_names, why, f"name one node per rank ({ws}), or [] for the hosts"))
    what, _, arg = i.lose_local.partition(":")
    rank = arg.isdigit() and int(arg) in range(ws or 0)
    ok = {"": not arg, "node": arg in i.node_names, "shard": rank, "flip": rank}
    if not ok.get(what, False):
        fix = "use node:<a name in monitor.inject.node_names>, shard:<rank> or flip:<rank>, or '' (off)"
        out.append(Problem("monitor.inject.lose_local", i.lose_local, "is not a part of the local tier to destroy", fix))


def _distributed(cfg: RunConfig, out: list[Problem]) -> None:
    d = cfg.distributed
    if not (d.timeout_s > 0 and math.isfinite(d.timeout_s)):
        out.append(Problem("distributed.timeout_s", d.timeout_s, "must be a positive number of seconds", "use e.g. 600"))
    elif not 0 < d.heartbeat_s * HEARTBEATS_PER_TIMEOUT <= d.timeout_s:
        out.append(
            Problem(
                "distributed.heartbeat_s",
                d.heartbeat_s,
                f"must be > 0 and at most distributed.timeout_s / {HEARTBEATS_PER_TIMEOUT} = {d.timeout_s / HEARTBEATS_PER_TIMEOUT:g}, "
                "so a frozen rank's record is stale before its peers time out",
                f"use heartbeat_s <= {d.timeout_s / HEARTBEATS_PER_TIMEOUT:g} or a longer timeout",
            )
        )
    if d.shutdown_timeout_s < 0:
        out.append(Problem("distributed.shutdown_timeout_s", d.shutdown_timeout_s, "must be >= 0", "use e.g. 30 (torch's own wait)"))
    if d.flight_recorder.enable and d.flight_recorder.buffer_size < 1:  # off, it records nothing
        out.append(
            Problem(
                "distributed.flight_recorder.buffer_size",
                d.flight_recorder.buffer_size,
                "must be >= 1",
                "use e.g. 2000, or flight_recorder.enable=false",
            )
        )


def check(cfg: RunConfig, ws: int | None, out: list[Problem]) -> None:
    _straggler(cfg, out)
    _guard(cfg, out)
    _inject(cfg, ws, out)
    _integrity(cfg, out)
    _moe_load(cfg, out)
    _distributed(cfg, out)
