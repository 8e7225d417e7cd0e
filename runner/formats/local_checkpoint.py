"""The node-local checkpoint tier on disk (torch-free): where a rank's shard goes, which local checkpoints the ranks can
assemble between them, and the rule that picks the local or the shared tier at a restart.

Each rank writes its own shard of the whole training state (a DCP checkpoint of this rank alone, with the COMPLETE.json
of runner.formats.checkpoint: sizes, CRC-32s, what it was saved from) to `<root>/step-<n>/rank-<r>` on its node, and the
rank it partners (the same local rank on the next node, a ring over nodes) keeps a copy in its own node's root. A local
checkpoint of step n is usable when every rank's shard is intact on some node, saved by this layout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.formats import checkpoint, runfiles
from runner.schema import LocalCheckpointConfig, RunConfig

RANK_PREFIX = "rank-"
NODE_NAME_ENV = "RUNNER_NODE_NAME"
"""Sets the node name of every rank an agent starts (nodes that share a hostname; runner.run.mesh)."""


def this_node() -> str:
    """This machine's node name as its ranks see it (runner.run.mesh.node_name without simulated nodes)."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def visible_nodes(cfg: RunConfig) -> list[str] | None:
    """Every node of the run whose local folder this machine sees: the simulated nodes of monitor.inject.node_names
    (all on this machine), or this node when the run has one; None for several nodes (each sees its own folder only)."""
    if cfg.monitor.inject.node_names:
        return sorted(set(cfg.monitor.inject.node_names))
    return [this_node()] if cfg.cluster.num_nodes == 1 else None


def node_folder(c: LocalCheckpointConfig, node: str) -> Path:
    """`local.folder` on the node `node` (`%N` replaced by its name)."""
    return Path(c.folder.replace("%N", node))


def root(c: LocalCheckpointConfig, node: str, shared: Path) -> Path:
    """This node's folder of one run's local checkpoints: `local.folder` (`%N` replaced by the node's name) /
    `run-<10 hex digits of the shared checkpoint folder's absolute path>`, so a restart of the run (elastic, requeued, by
    hand with the same checkpoint.folder) finds it and two runs on one node never share it."""
    key = hashlib.sha256(str(shared.resolve()).encode()).hexdigest()[:10]
    return node_folder(c, node) / f"run-{key}"


def shard_path(root: Path, step: int, rank: int) -> Path:
    return checkpoint.final_path(root, step) / f"{RANK_PREFIX}{rank}"


def partial_path(root: Path, step: int, rank: int) -> Path:
    return checkpoint.final_path(root, step) / f"{RANK_PREFIX}{rank}{runfiles.CHECKPOINT_PARTIAL}"


def _steps(root: Path) -> list[Path]:
    """`step-<n>` folders of this node's root, newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and checkpoint.step_name(p)), key=checkpoint.step_of, reverse=True)


def newest_step(root: Path) -> int | None:
    """The newest local step this node's root has a folder of (whole or not)."""
    steps = _steps(root)
    return checkpoint.step_of(steps[0]) if steps else None


def _ranks(step: Path) -> list[tuple[int, Path]]:
    """Published shard folders of a step folder (`.partial` ones are still being written or were cut off)."""
    out = []
    for p in step.iterdir() if step.is_dir() else ():
        tail = p.name[len(RANK_PREFIX) :]
        if p.is_dir() and p.name.startswith(RANK_PREFIX) and tail.isdigit():
            out.append((int(tail), p))
    return sorted(out)


def held(root: Path, origin: dict[str, Any]) -> tuple[dict[int, list[int]], list[str]]:
    """The intact shards in this node's root, {step: [ranks]}, and why each published one that is not usable was skipped
    (a changed or missing file: its CRC-32 or size; another layout: a local shard restores only into its own)."""
    found: dict[int, list[int]] = {}
    skipped = []
    for step in _steps(root):
        for rank, path in _ranks(step):
            why = checkpoint.verify(path, deep=True)
            if why is None:
                info = checkpoint.marker(path)
                if (info.get("world_size"), info.get("layout")) != (origin["world_size"], origin["layout"]):
                    why = f"saved by layout {info.get('layout')} ({info.get('world_size')} ranks), this run is {origin['layout']}"
            if why is None:
                found.setdefault(checkpoint.step_of(step), []).append(rank)
            else:
                skipped.append(f"local shard {path}: {why}")
    return found, skipped


@dataclass
class Choice:
    """What a restart restores: the local tier's `step` (None: the shared tier's), where each rank's shard is (rank ->
    the rank whose node holds it), and the console line that says which tier and why."""

    step: int | None
    holders: dict[int, int] = field(default_factory=dict)
    why: str = ""


def choose(held_by_rank: list[dict[int, list[int]]], shared_step: int | None, before: int | None = None) -> Choice:
    """The restore rule, the same on every rank (`held_by_rank`: every rank's `held`, gathered): the newest local step
    (below `before`, a rewind) whose shards are all intact on some node, if it is newer than the newest complete shared
    checkpoint `shared_step`; otherwise the shared tier. A rank's own copy is preferred, then the lowest rank holding it."""
    world = len(held_by_rank)
    steps = sorted({s for h in held_by_rank for s in h if before is None or s < before}, reverse=True)
    missing_lines = []
    for step in steps:
        holders = {}
        for rank in range(world):
            have = [r for r, h in enumerate(held_by_rank) if rank in h.get(step, [])]
            if have:
                holders[rank] = rank if rank in have else have[0]
        missing = [r for r in range(world) if r not in holders]
        if missing:
            missing_lines.append(f"local step {step} lacks rank(s) {missing} (no intact copy on any node)")
            continue
        if shared_step is not None and shared_step >= step:
            why = f"shared step {shared_step} is at least as new as the newest whole local step {step}"
            return Choice(None, {}, "; ".join([*missing_lines, why]))
        copies = sorted(r for r, h in holders.items() if h != r)
        moved = f"; rank(s) {copies} from their partner copies" if copies else ""
        newer = f"newer than shared step {shared_step}" if shared_step is not None else "no shared checkpoint"
        return Choice(step, holders, "; ".join([*missing_lines, f"local step {step} is whole and {newer}{moved}"]))
    if not steps:
        missing_lines.append("no local checkpoint of this layout on any node")
    return Choice(None, {}, "; ".join(missing_lines))


def partner(places: list[tuple[str, int]], rank: int) -> int | None:
    """The rank that keeps a copy of `rank`'s shards: the rank at the same position on the next node (nodes in order of
    their first rank, a ring; a position is the rank's place among its node's ranks, its local rank under a launcher
    that starts ranks node by node); None with one node (a local checkpoint then survives a process failure, not the
    loss of a node)."""
    ranks: dict[str, list[int]] = {}
    for r, (node, _) in enumerate(places):
        ranks.setdefault(node, []).append(r)
    nodes = list(ranks)
    if len(nodes) < 2:
        return None
    node = places[rank][0]
    nxt = ranks[nodes[(nodes.index(node) + 1) % len(nodes)]]
    pos = ranks[node].index(rank)
    return nxt[pos] if pos < len(nxt) else None


def source(places: list[tuple[str, int]], rank: int) -> int | None:
    """The rank whose shards `rank` keeps a copy of (the inverse of partner)."""
    return next((r for r in range(len(places)) if partner(places, r) == rank), None)


def prune(root: Path, keep: int, ranks: list[int]) -> list[Path]:
    """Delete the shards of `ranks` (a rank's own and the copy it keeps) in all but the newest `keep` steps of this node's
    root, and step folders left empty; returns the shard folders deleted."""
    gone = []
    for step in _steps(root)[keep:]:
        for rank, path in _ranks(step):
            if rank in ranks:
                shutil.rmtree(path)
                gone.append(path)
        try:
            step.rmdir()  # empty once every rank of this node has pruned it
        except OSError:
            pass
    return gone
