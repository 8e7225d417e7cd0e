"""The start-up block rank 0 prints: layout, mesh groups of rank 0, links, precision, timeout, dumps, frozen file.

Torch-free: everything comes from the config and the layout (the worker has already checked that
TorchTitan's mesh agrees with the layout's coordinates).
"""

from __future__ import annotations

from pathlib import Path

from runner.estimate import plan
from runner.estimate.comm import link
from runner.schema import RunConfig
from runner.schema.layout import MESH_ORDER, Layout, devices_per_node, group_of, label
from runner.schema.wording import count


def report(
    cfg: RunConfig, lay: Layout, frozen: Path, fr_folder: Path, converted: list[str] | None, peak_tflops: float | None = None
) -> str:
    per_node = devices_per_node(cfg.cluster, lay.world_size)
    where = f"{count(lay.world_size, 'rank')} on {count(cfg.cluster.num_nodes, 'node')} of {per_node}"
    lines = [f"layout {label(lay, cfg.parallelism)}: {lay.describe()}, {where}"]
    lines.append(f"mesh {' x '.join(f'{a}={getattr(lay, a)}' for a in MESH_ORDER)} (rank 0's groups):")
    for axis in MESH_ORDER:
        size = getattr(lay, axis)
        where = link(lay, axis, per_node) if size > 1 else "-"
        lines.append(f"  {axis:<13} size {size:<4} ranks {group_of(lay, 0, axis)}  link {where}")
    if converted:
        conv = f"{len(converted)} converted modules: {', '.join(converted[:8])}{' ...' if len(converted) > 8 else ''}"
    else:
        conv = "no modules converted"
    pr = cfg.precision
    lines.append(f"precision {pr.name} (params {pr.param_dtype.value}, reductions {pr.reduce_dtype.value}); {conv}")
    fr = cfg.distributed.flight_recorder
    lines.append(f"collective timeout {cfg.distributed.timeout_s:g} s; rank records every {cfg.distributed.heartbeat_s:g} s in logs/ranks/")
    lines.append(f"flight recorder: {'buffer ' + str(fr.buffer_size) + ' collectives, dumps to ' + str(fr_folder) if fr.enable else 'off'}")
    lines.append(checkpoint_line(cfg, lay, peak_tflops))
    lines.append(integrity_line(cfg, lay))
    lines.append(f"frozen config: {frozen}")
    return "\n".join(lines)


def checkpoint_line(cfg: RunConfig, lay: Layout, peak_tflops: float | None) -> str:
    """The configured checkpoint intervals (shared tier, and the node-local one when on) beside the planner's Young/Daly
    suggestions (peak: measured, per rank)."""
    try:
        budget = plan.compute(cfg, lay, peak_tflops=peak_tflops)
    except ZeroDivisionError:  # a layout the planner cannot budget (no microbatch per stage): no step time, no suggestion
        budget = {"checkpoint_interval_steps": None, "local_checkpoint_interval_steps": None}
    steps = budget["checkpoint_interval_steps"]
    if steps is None:
        why = "set cluster.mtbf_hours and cluster.checkpoint_write_gbs for a suggestion"
    else:
        why = f"{budget['checkpoint_interval_s']:.0f} s: write {budget['checkpoint_write_s']:.3g} s, MTBF {cfg.cluster.mtbf_hours:g} h"
    c = cfg.checkpoint
    if not c.enable:
        return f"checkpoints: off; planner suggests every {count(steps, 'step')} ({why})" if steps else f"checkpoints: off ({why})"
    mode = "async" if c.async_save else "sync"
    suggested = f"planner suggests {steps} (Young/Daly, {why})" if steps else f"planner: no suggestion ({why})"
    line = f"checkpoints: every {count(c.interval, 'step')} ({mode}, keep {c.keep or 'all'}) into {c.folder}; {suggested}"
    if not c.local.folder:
        return line
    local = budget["local_checkpoint_interval_steps"]
    if local is None:
        hint = "planner: no suggestion (set cluster.mtbf_hours and cluster.local_write_gbs for one)"
    else:
        w = budget["local_checkpoint_write_s"]
        hint = f"planner suggests {local} (Young/Daly, {budget['local_checkpoint_interval_s']:.0f} s: write {w:.3g} s)"
    simulated = cfg.monitor.inject.node_names  # TEST-ONLY simulated nodes on one machine
    nodes = len(set(simulated)) if simulated else lay.world_size // devices_per_node(cfg.cluster, lay.world_size)
    copy = "a copy on the next node" if nodes > 1 else "one node: no partner copy, so it survives a process failure, not a node loss"
    return f"{line}\nlocal checkpoints: every {count(c.local.interval, 'step')} (keep {c.local.keep}, {copy}) into {c.local.folder}; {hint}"


def integrity_line(cfg: RunConfig, lay: Layout) -> str:
    """Which silent-data-corruption checks run (runner.observe.integrity); a layout without replicas has only the replay check."""
    g = cfg.monitor.integrity
    replay = f"replay check every {count(g.replay_interval, 'step')}" if g.replay_interval else "replay check off"
    if lay.dp_replicate < 2:
        return f"integrity: no replicas in this layout (dp_replicate=1: every parameter shard is held once), so no replica check; {replay}"
    if not g.interval:
        return f"integrity: replica check off; {replay}"
    groups = lay.world_size // lay.dp_replicate
    return (
        f"integrity: {groups} groups of {lay.dp_replicate} replicas compare parameter checksums every {count(g.interval, 'step')} "
        f"(on mismatch: {g.on_mismatch.value}); {replay}"
    )
