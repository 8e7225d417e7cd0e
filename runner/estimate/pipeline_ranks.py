"""What each pipeline rank holds, as the memory model counts it (torch-free): its (dense, moe) blocks, the
microbatches whose activations it keeps at its peak under the schedule, and torch's PipelineStage receive buffers.

runner.estimate.pipeline gives the schedules and stage splits as plain numbers; this reads them for one config and
layout, for runner.estimate.memory.
"""

from __future__ import annotations

import functools

from runner.estimate import flops, pipeline
from runner.schema import RunConfig
from runner.schema.layout import Layout


def stage_blocks(cfg: RunConfig, lay: Layout) -> list[tuple[int, int]]:
    """(dense, moe) blocks held by each pipeline rank (its virtual stages together)."""
    m, p = cfg.model, cfg.parallelism
    v = p.pp_virtual_stages if lay.pp > 1 else 1
    dense = m.num_dense_layers if flops.is_moe(m) else m.num_layers
    v_shape = v > 1 and p.pp_schedule in ("ZBVZeroBubble", "DualPipeV")
    return _blocks_per_rank(m.num_layers, dense, lay.pp, v, v_shape, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers)


@functools.lru_cache(maxsize=4096)
def _blocks_per_rank(num_layers: int, dense: int, pp: int, v: int, v_shape: bool, first: int, last: int) -> list[tuple[int, int]]:
    """Cached: mode=search asks for the same split for thousands of candidates."""
    split = pipeline.stage_layers(num_layers, pp * v, first, last)
    dense_left, out = dense, [[0, 0] for _ in range(pp)]
    for i, n in enumerate(split):
        rank = min(i, 2 * pp - 1 - i) if v_shape else i % pp
        d = min(n, dense_left)
        dense_left -= d
        out[rank][0] += d
        out[rank][1] += n - d
    return [tuple(x) for x in out]


def in_flight(cfg: RunConfig, lay: Layout, micro: int, stage: int) -> int:
    """Microbatches whose activations pipeline stage `stage` holds at its peak (1F1B family: pp - stage)."""
    if lay.pp == 1:
        return 1
    if cfg.parallelism.pp_schedule in ("GPipe", "LoopedBFS"):
        return micro
    return min(micro, lay.pp - stage)


def looped_held(cfg: RunConfig, lay: Layout, micro: int, st: int) -> list[int] | None:
    """Interleaved1F1B: the microbatches each of rank `st`'s virtual stages (st, st + pp, ...) holds at its peak. Before
    its first backward the rank runs torch's warm-up, (v - 1) x the microbatches of a round + 2 (pp - 1 - st) forwards,
    a round of each virtual stage in turn, then one more forward as the steady state starts (Qwen3-235B pp8 v2, rank 0:
    15 and 8, the dry run's 7.86 GB; the last rank: 8 of its blocks' stage, 1 of the head's). None for other schedules."""
    p = cfg.parallelism
    if lay.pp == 1 or p.pp_schedule != "Interleaved1F1B":
        return None
    v = p.pp_virtual_stages
    per_round = micro // max(1, micro // lay.pp)
    warmup = min((v - 1) * per_round + 2 * (lay.pp - 1 - st), micro * v)
    held = [0] * v
    for k in range(min(warmup + 1, micro * v)):
        held[(k // per_round) % v] += 1
    return held


def chunk_blocks(cfg: RunConfig, lay: Layout, st: int) -> list[tuple[int, int]]:
    """(dense, moe) blocks of each of rank `st`'s virtual stages in a looped schedule (stage st + c x pp)."""
    m, p = cfg.model, cfg.parallelism
    split = pipeline.stage_layers(m.num_layers, lay.pp * p.pp_virtual_stages, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers)
    dense_left, out = m.num_dense_layers if flops.is_moe(m) else m.num_layers, []
    for i, n in enumerate(split):
        d = min(n, dense_left)
        dense_left -= d
        if i % lay.pp == st:
            out.append((d, n - d))
    return out


def receive_buffers(cfg: RunConfig, lay: Layout, st: int, first: bool, last: bool) -> int:
    """Receive buffers per microbatch of rank `st`: torch's PipelineStage makes, per virtual stage, one for its input
    (all but the model's first stage) and one for its output's gradient (all but the last), kept across steps. A looped
    schedule's rank holds stages st, st + pp, ...; a V schedule's (single-stage count kept) is not checked yet."""
    if lay.pp == 1 or pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style != "loop":
        return (not first) + (not last)
    n = lay.pp * cfg.parallelism.pp_virtual_stages
    return sum((s != 0) + (s != n - 1) for s in range(st, n, lay.pp))
