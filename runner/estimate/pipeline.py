"""Pipeline schedules, stage splits and bubbles as plain numbers (torch-free).

The rules mirror what torch.distributed.pipelining (torch 2.13) and TorchTitan 0.3.0's
pipeline_llm enforce at start-up, so validation rejects a layout before any process starts
instead of a rank failing in the schedule's constructor. runner/run/titan/ checks at build
time that `stage_layers` agrees with TorchTitan's own split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str
    """Name torch.distributed.pipelining.get_schedule_class knows."""
    style: str
    """single (one stage per rank), loop (stage s on rank s mod pp) or v (rank r holds stages r and 2pp-1-r)."""
    zero_bubble: bool = False
    """Splits backward into input- and weight-gradient work that fills the warm-up/cool-down bubble."""


SCHEDULES = {
    s.name: s
    for s in (
        Schedule("1F1B", "single"),
        Schedule("GPipe", "single"),
        Schedule("Interleaved1F1B", "loop"),
        Schedule("LoopedBFS", "loop"),
        Schedule("InterleavedZeroBubble", "loop", zero_bubble=True),
        Schedule("ZBVZeroBubble", "v", zero_bubble=True),
        Schedule("DualPipeV", "v", zero_bubble=True),
    )
}


def virtual_stages_rule(schedule: str, v: int) -> str | None:
    """Why `v` stages per rank cannot run `schedule` (None when it can)."""
    style = SCHEDULES[schedule].style
    if style == "single" and v != 1:
        return f"{schedule} runs one stage per rank"
    if style == "loop" and v < 2:
        return f"{schedule} is a looped schedule and needs at least 2 stages per rank"
    if style == "v" and v != 2:
        return f"{schedule} is a V-shaped schedule and needs exactly 2 stages per rank"
    return None


def microbatch_rule(schedule: str, pp: int, v: int, m: int) -> tuple[str, int | None] | None:
    """(why, smallest m that works or None) when `m` microbatches cannot run `schedule` (torch's own checks)."""
    stages = pp * v
    if schedule == "1F1B" and m < pp:
        return f"1F1B needs at least as many microbatches as stages ({pp})", pp
    if schedule == "DualPipeV" and m < stages:
        return f"DualPipeV needs at least as many microbatches as stages (pp x v = {stages})", stages
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            return f"{schedule} runs m // pp = {rounds} rounds and needs m to be a multiple of them", None
    return None


def stage_layers(num_layers: int, num_stages: int, first_less: int, last_less: int) -> list[int]:
    """Transformer layers in each pipeline stage, as TorchTitan's _generate_llm_fqn_per_model_part
    splits them: the embedding counts as `first_less` layers and norm + head as `last_less`, the
    total is spread evenly and the first stages take the remainder. Raises ValueError where
    TorchTitan would. Cached (mode=search asks for the same split thousands of times); a new list each call."""
    return list(_stage_layers(num_layers, num_stages, first_less, last_less))


@functools.lru_cache(maxsize=4096)
def _stage_layers(num_layers: int, num_stages: int, first_less: int, last_less: int) -> tuple[int, ...]:
    if num_stages == 1:
        return (num_layers,)
    effective = num_layers + first_less + last_less
    per, extra = divmod(effective, num_stages)
    if per == 0:
        raise ValueError(f"{num_stages} stages for {effective} effective layers would leave stages empty")
    if first_less > per or last_less > per:
        raise ValueError(f"the first/last stage would hold fewer than 0 layers ({per} effective layers per stage)")
    out, left = [], num_layers
    for s in range(num_stages):
        want = per + (1 if s < extra else 0) - (first_less if s == 0 else 0) - (last_less if s == num_stages - 1 else 0)
        take = min(want, left)
        out.append(take)
        left -= take
    return tuple(out)


def bubble(pp: int, m: int, schedule: str, v: int) -> tuple[float, str]:
    """Idle fraction of a pipeline step and the formula used.

    1F1B/GPipe: (p-1)/(m+p-1). Looped schedules with v stages per rank shrink each warm-up slot
    to 1/v of a stage: (p-1)/(v*m+p-1) (Narayanan et al. 2021). Zero-bubble schedules fill part
    of it with weight-gradient work, so that formula is their upper bound.
    """
    if pp == 1:
        return 0.0, "no pipeline"
    if v == 1:
        return (pp - 1) / (m + pp - 1), f"(p-1)/(m+p-1) = {pp - 1}/{m + pp - 1}"
    text = f"(p-1)/(v*m+p-1) = {pp - 1}/{v * m + pp - 1}, v={v}"
    if SCHEDULES.get(schedule, SCHEDULES["Interleaved1F1B"]).zero_bubble:
        text += " (upper bound: the schedule fills part of it with weight-gradient work)"
    return (pp - 1) / (v * m + pp - 1), text


def microbatches_in_flight(schedule: str, pp: int, m: int) -> int:
    """Microbatches whose activations the first rank holds at once: all of them with GPipe and
    LoopedBFS (every forward before any backward), at most pp with the 1F1B family."""
    if pp == 1:
        return 1
    return m if schedule in ("GPipe", "LoopedBFS") else min(m, pp)
