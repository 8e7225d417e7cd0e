"""Rules for profile.* (torch-free): which steps and ranks are traced (runner.run.profiling)."""

from __future__ import annotations

from runner.schema import RunConfig
from runner.schema.problems import Problem


def check(cfg: RunConfig, ws: int | None, out: list[Problem]) -> None:
    p, steps = cfg.profile, cfg.training.steps
    late = [s for s in p.steps if not 1 <= s <= steps]
    if late:
        out.append(Problem("profile.steps", p.steps, f"steps {late} are not steps of this run (1..{steps})", f"trace steps in 1..{steps}"))
    if p.warmup < 0:
        out.append(Problem("profile.warmup", p.warmup, "must be >= 0", "use e.g. profile.warmup=1, or 0 to record from the first step"))
    if p.active < 1:
        out.append(Problem("profile.active", p.active, "a cycle of profile.every traces at least one step", "use profile.active=1"))
    if p.every < 0 or (p.every and p.every < p.warmup + p.active):
        out.append(
            Problem(
                "profile.every",
                p.every,
                f"a cycle holds profile.warmup + profile.active = {p.warmup + p.active} steps (torch.profiler.schedule), and 0 is off",
                f"use profile.every>={max(1, p.warmup + p.active)}, or 0 to trace only profile.steps",
            )
        )
    foreign = [r for r in p.ranks or [] if ws is not None and not 0 <= r < ws]
    if foreign:
        why = f"ranks {foreign} are not ranks of this run (0..{ws - 1})"
        out.append(Problem("profile.ranks", p.ranks, why, "list ranks of the run, or null for rank 0 and one rank of each stage"))
