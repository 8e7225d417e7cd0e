"""Batch and pipeline rules: what torch's schedules and TorchTitan's pipeline_llm would refuse
at start-up (runner/estimate/pipeline.py). Torch-free; called by validate.check."""

from __future__ import annotations

from runner.estimate import pipeline
from runner.schema import RunConfig
from runner.schema.layout import Layout
from runner.schema.problems import Problem


def schedule_name(cfg: RunConfig, out: list[Problem]) -> bool:
    """Whether parallelism.pp_schedule names a schedule (checked at any pp: a typo must not wait for pp > 1)."""
    p = cfg.parallelism
    if p.pp_schedule in pipeline.SCHEDULES:
        return True
    out.append(
        Problem(
            "parallelism.pp_schedule",
            p.pp_schedule,
            "not a pipeline schedule torch.distributed.pipelining provides",
            f"use one of {', '.join(pipeline.SCHEDULES)}",
        )
    )
    return False


def batch(cfg: RunConfig, lay: Layout | None, schedule_ok: bool, out: list[Problem]) -> None:
    """The global batch splits into whole microbatches per DP rank; with PP, into a schedulable m."""
    p, t = cfg.parallelism, cfg.training
    if lay is None or t.microbatch_size < 1 or t.global_batch_size < 1:
        return
    unit = lay.dp * t.microbatch_size
    if t.global_batch_size % unit:
        out.append(
            Problem(
                "training.global_batch_size",
                t.global_batch_size,
                f"must be divisible by DP degree {lay.dp} x training.microbatch_size {t.microbatch_size} = {unit}",
                f"use a multiple of {unit}",
            )
        )
        return
    if p.pp > 1 and schedule_ok:
        if _schedule(cfg, t.global_batch_size // unit, unit, out):
            _split(cfg, out)


def _schedule(cfg: RunConfig, m: int, unit: int, out: list[Problem]) -> bool:
    """Stages per rank and microbatches per pipeline against the schedule; False when v is wrong for it."""
    p = cfg.parallelism
    v = p.pp_virtual_stages
    why = pipeline.virtual_stages_rule(p.pp_schedule, v)
    if why:
        want = "1 (or a looped schedule such as Interleaved1F1B)" if pipeline.SCHEDULES[p.pp_schedule].style == "single" else "2"
        out.append(Problem("parallelism.pp_virtual_stages", v, why, f"set parallelism.pp_virtual_stages={want}"))
        return False
    rule = pipeline.microbatch_rule(p.pp_schedule, p.pp, v, m)
    if rule:
        why, least = rule
        if least:
            fix = f"use global_batch_size >= {least * unit} or a smaller training.microbatch_size"
        else:
            fix = f"make m a multiple of pp = {p.pp}, e.g. training.global_batch_size={p.pp * unit * max(1, m // p.pp)}"
        out.append(
            Problem("training.global_batch_size", cfg.training.global_batch_size, f"gives m = {m} microbatches per pipeline; {why}", fix)
        )
    return True


def _split(cfg: RunConfig, out: list[Problem]) -> None:
    """The transformer layers split into pp x v stages, the first and last ones lighter."""
    p, mo = cfg.parallelism, cfg.model
    first, last = p.pp_first_stage_less_layers, p.pp_last_stage_less_layers
    for name, value in (("pp_first_stage_less_layers", first), ("pp_last_stage_less_layers", last)):
        if value < 0:
            out.append(Problem(f"parallelism.{name}", value, "must be >= 0", "use 0 for an even split of the transformer layers"))
    if first < 0 or last < 0 or p.pp_virtual_stages < 1 or mo.num_layers < 1:
        return
    v = p.pp_virtual_stages
    try:
        pipeline.stage_layers(mo.num_layers, p.pp * v, first, last)
    except ValueError as e:
        out.append(
            Problem(
                "parallelism.pp",
                p.pp,
                f"model.num_layers = {mo.num_layers} (+ {first} for the embedding, + {last} for the head) cannot be split "
                f"into pp x pp_virtual_stages = {p.pp * v} stages: {e}",
                "use fewer stages (pp or pp_virtual_stages), or lower parallelism.pp_first_stage_less_layers/pp_last_stage_less_layers",
            )
        )
