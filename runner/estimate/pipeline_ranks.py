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


def held_microbatches(cfg: RunConfig, lay: Layout, micro: int, st: int) -> int:
    """The most microbatches rank `st` holds activations of at once, its virtual stages' together (the plan's
    "microbatches in flight"): a V schedule's largest pair of torch's action order (DeepSeek-V3 pp 16 rank 0: 32 of
    the first stage and 1 of the last), Interleaved1F1B's warm-up, else in_flight."""
    v = v_held(cfg, lay, micro, st)
    if v is not None:
        return max(a + b for a, b in v)
    looped = looped_held(cfg, lay, micro, st)
    return sum(looped) if looped is not None else in_flight(cfg, lay, micro, st)


def looped_held(cfg: RunConfig, lay: Layout, micro: int, st: int) -> list[int] | None:
    """Interleaved1F1B: the microbatches each of rank `st`'s virtual stages (st, st + pp, ...) holds at its peak. Before
    its first backward the rank runs torch's warm-up, (v - 1) x the microbatches of a round + 2 (pp - 1 - st) forwards,
    a round of each virtual stage in turn, then one more forward as the steady state starts (Qwen3-235B pp8 v2, rank 0:
    15 and 8, the dry run's 7.86 GB; the last rank: 8 of its blocks' stage, 1 of the head's). None for other schedules."""
    p = cfg.parallelism
    if lay.pp == 1 or p.pp_schedule != "Interleaved1F1B":
        return None
    return list(_looped_held(lay.pp, p.pp_virtual_stages, micro, st))


@functools.lru_cache(maxsize=4096)
def _looped_held(pp: int, v: int, micro: int, st: int) -> tuple[int, ...]:
    per_round = micro // max(1, micro // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - st), micro * v)
    held = [0] * v
    for k in range(min(warmup + 1, micro * v)):
        held[(k // per_round) % v] += 1
    return tuple(held)


def chunk_stages(cfg: RunConfig, lay: Layout, st: int) -> list[int]:
    """The stage indices of rank `st`'s virtual stages: st, st + pp, ... in a looped schedule; st and 2 pp - 1 - st in a
    V schedule (DualPipeV, ZBVZeroBubble: the rank holds the V's two arms)."""
    n = lay.pp * cfg.parallelism.pp_virtual_stages
    if pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style == "v":
        return [st, n - 1 - st]
    return list(range(st, n, lay.pp))


def chunk_blocks(cfg: RunConfig, lay: Layout, st: int) -> list[tuple[int, int]]:
    """(dense, moe) blocks of each of rank `st`'s virtual stages (chunk_stages' order)."""
    per_stage = blocks_of_stages(cfg, lay)
    return [per_stage[s] for s in chunk_stages(cfg, lay, st)]


def blocks_of_stages(cfg: RunConfig, lay: Layout) -> tuple[tuple[int, int], ...]:
    """(dense, moe) blocks of every pipeline stage, in stage order."""
    m, p = cfg.model, cfg.parallelism
    dense = m.num_dense_layers if flops.is_moe(m) else m.num_layers
    return _blocks_per_stage(m.num_layers, lay.pp * p.pp_virtual_stages, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers, dense)


@functools.lru_cache(maxsize=4096)
def _blocks_per_stage(num_layers: int, stages: int, first_less: int, last_less: int, dense: int) -> tuple[tuple[int, int], ...]:
    """(dense, moe) blocks of every stage (mode=search asks for the same split thousands of times)."""
    dense_left, per_stage = dense, []
    for n in pipeline.stage_layers(num_layers, stages, first_less, last_less):
        d = min(n, dense_left)
        dense_left -= d
        per_stage.append((d, n - d))
    return tuple(per_stage)


def receive_buffers(cfg: RunConfig, lay: Layout, st: int, first: bool, last: bool) -> int:
    """Receive buffers per microbatch of rank `st`: torch's PipelineStage makes, per virtual stage, one for its input
    (all but the model's first stage) and one for its output's gradient (all but the last), kept across steps. A looped
    schedule's rank holds stages st, st + pp, ...; a V schedule's st and 2 pp - 1 - st, and the V's bottom rank passes
    the tensors between its two stages directly (torch's set_local_fwd_input / set_local_bwd_input), so only links to
    another rank count: rank 0 2 (the first stage's gradient, the last stage's input: DeepSeek-V3 pp16 rank 0's 14.1 GB
    of the dry run's 21.3), the bottom rank 2, the others 4."""
    if lay.pp == 1 or pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style == "single":
        return (not first) + (not last)
    n, mine = lay.pp * cfg.parallelism.pp_virtual_stages, chunk_stages(cfg, lay, st)
    return sum((s != 0 and s - 1 not in mine) + (s != n - 1 and s + 1 not in mine) for s in mine)


def local_links(cfg: RunConfig, lay: Layout, st: int) -> int:
    """1 on a V schedule's bottom rank (pp - 1), whose two stages are neighbours: torch passes their tensors directly
    (set_local_fwd_input, set_local_bwd_input) and keeps each microbatch's in the stage's receive slot until the next
    step replaces it (DeepSeek-V3 pp 16, rank 2047: 120 outputs of stage 15 and input gradients of stage 16); else 0."""
    if lay.pp == 1 or pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style != "v":
        return 0
    first, second = chunk_stages(cfg, lay, st)
    return int(second == first + 1)


def v_held(cfg: RunConfig, lay: Layout, micro: int, st: int) -> list[tuple[int, int]] | None:
    """V schedules (DualPipeV, ZBVZeroBubble): the microbatches rank `st`'s two stages (st, 2 pp - 1 - st) hold after each
    forward, in torch's order of the rank's actions (torch.distributed.pipelining.schedules, the schedule's
    _calculate_single_rank_operations); a full backward, or the weight half of a split one, frees its microbatch (FREES).
    The memory model weighs each pair by its stages' bytes and keeps the largest: on DeepSeek-V3's rank 0 the last
    stage's logits (3.2 GB a microbatch) are held for at most 1 microbatch while the first stage holds up to 32. None
    for other schedules."""
    p = cfg.parallelism
    if lay.pp == 1 or pipeline.SCHEDULES[p.pp_schedule].style != "v":
        return None
    return _v_held(p.pp_schedule, lay.pp, micro, st)


def v_peaks(cfg: RunConfig, lay: Layout, micro: int, st: int) -> tuple[tuple[int, int], ...] | None:
    """v_held's pairs that no other pair holds at least as many of in both stages (the memory model weighs the two
    stages' bytes, which are never negative, so its largest sum is at one of these): a few pairs for 2 x micro."""
    p = cfg.parallelism
    if lay.pp == 1 or pipeline.SCHEDULES[p.pp_schedule].style != "v":
        return None
    return _v_peaks(p.pp_schedule, lay.pp, micro, st)


@functools.lru_cache(maxsize=4096)
def _v_peaks(schedule: str, pp: int, micro: int, rank: int) -> tuple[tuple[int, int], ...]:
    pairs = set(_v_held(schedule, pp, micro, rank))
    return tuple(sorted(a for a in pairs if not any(b != a and b[0] >= a[0] and b[1] >= a[1] for b in pairs)))


@functools.lru_cache(maxsize=1024)
def _v_held(schedule: str, pp: int, m: int, rank: int) -> list[tuple[int, int]]:
    held, out = [0, 0], []
    for chunk, kind in v_actions(schedule, pp, m, rank):
        held[chunk] += 1 if kind == "F" else -1 if kind in FREES else 0
        if kind == "F":
            out.append(tuple(held))
    return out


FREES = ("B", "W")
"""The actions that free a microbatch's activations: a full backward, or the weight half (W) of a split one: its input
half (I) keeps what W needs (the checkpointed blocks' inputs, the stage's output)."""


@functools.lru_cache(maxsize=1024)
def v_actions(schedule: str, pp: int, m: int, rank: int) -> tuple[tuple[int, str], ...]:
    """(chunk, kind) of rank `rank`'s actions in torch's order: F forward, B full backward, I input-gradient half, W
    weight-gradient half. ZBVZeroBubble splits every backward; its port runs each W right after its I (torch defers
    some in the cool-down: their held microbatches and weight-gradient inputs are not counted)."""
    if schedule == "DualPipeV":
        return tuple(_dualpipev_actions(pp, m, rank))
    ops = ([(chunk, "F")] if forward else [(chunk, "I"), (chunk, "W")] for chunk, forward in _zbv_ops(pp, m, rank))
    return tuple(op for pair in ops for op in pair)


def _dualpipev_actions(pp: int, m: int, r: int) -> list[tuple[int, str]]:
    """ScheduleDualPipeV._calculate_single_rank_operations: an overlapped forward/backward runs its forward first; an I
    queues its W, which runs where torch pops the queue (steps 3, 7 and 8)."""
    ops, queue = [], []

    def add(chunk: int, kind: str, times: int = 1) -> None:
        for _ in range(times):
            ops.append((chunk, kind))
            queue.extend([chunk] if kind == "I" else [])

    def weight() -> None:
        if queue:
            ops.append((queue.pop(0), "W"))

    add(0, "F", 2 * (pp - r - 1))
    for _ in range(r + 1):
        add(0, "F"), add(1, "F")
    for _ in range(pp - r - 1):
        add(1, "I"), weight(), add(1, "F")
    for _ in range(m - 2 * pp + r + 1):
        add(0, "F"), add(1, "B"), add(1, "F"), add(0, "B")
    for _ in range(pp - r - 1):
        add(1, "B"), add(1, "F"), add(0, "B")
    split = False  # from the middle of step 6 on, every backward is input-only
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        add(1, "I" if split else "B")
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        add(0, "I" if split else "B")
    for _ in range(pp - r - 1):
        weight(), add(0, "I")
    for _ in range(r + 1):
        weight()
    return ops


def _zbv_ops(pp: int, m: int, r: int) -> list[tuple[int, bool]]:
    """(chunk, is forward) in ScheduleZBVZeroBubble's order (its padding to 2 pp - 1 microbatches dropped)."""
    n = max(2 * pp - 1, m)
    f0, f1, b0, b1 = (0, True), (1, True), (0, False), (1, False)
    ops = [f0] * (2 * (pp - r) - 1) + [f1, f0] * r + [f1, b1] * (pp - r)
    counts = {"f0": 2 * (pp - r) - 1 + r, "f1": pp}
    while counts["f1"] < counts["f0"] or counts["f0"] < n:
        if counts["f0"] < n:
            ops.append(f0)
            counts["f0"] += 1
        ops += [b0, f1, b1]
        counts["f1"] += 1
    ops += [b0, b1] * r + [b0] * (pp - r)
    kept, seen = [], {op: 0 for op in (f0, f1, b0, b1)}  # torch drops the actions of microbatches m and above
    for op in ops:
        if seen[op] < m:
            kept.append(op)
        seen[op] += 1
    return kept
