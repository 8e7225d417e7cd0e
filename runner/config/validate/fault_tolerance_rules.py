"""fault_tolerance=torchft rules (torch-free): `check` reads the config and layout, `launch` this machine.

Refused, each with the field and the fix: fewer than 2 replica groups; dp_shard=1 (no FSDP module for the cross-group
gradient all-reduce hook); a quorum that needs every group (none may be
lost); groups that cannot restart (cluster.max_restarts=0); PP (TorchTitan 0.3.0's torchft experiment and its tests
cover FSDP/HSDP only); a replica group that shares a node with another group's ranks, so one node's loss takes two
groups; the loss guard's and the integrity check's rewinds (a rewind inside one group alone puts the replicas
apart); and at launch: torchft not installed, a configured lighthouse that does not answer.
"""

from __future__ import annotations

import importlib.util
import socket
from urllib.parse import urlparse

from runner.config import fault_tolerance as ft
from runner.schema import GuardAction, Launcher, MismatchAction, Mode, RunConfig, layout
from runner.schema.layout import Layout
from runner.schema.problems import Problem

OFF = "or fault_tolerance=none"


def check(cfg: RunConfig, lay: Layout | None, out: list[Problem]) -> None:
    if not ft.enabled(cfg) or lay is None:
        return
    f = cfg.fault_tolerance
    if lay.dp_replicate < 2:
        why = "torchft keeps training on the other replica groups; with one group there is no peer to recover from"
        out.append(Problem("parallelism.dp_replicate", lay.dp_replicate, why, f"use parallelism=hsdp2x2 (dp_replicate=2) {OFF}"))
    elif f.min_replicas >= lay.dp_replicate or f.min_replicas < 1:
        why = f"a step needs min_replicas groups of the {lay.dp_replicate}: no replica group could be lost"
        out.append(Problem("fault_tolerance.min_replicas", f.min_replicas, why, f"use 1 <= min_replicas < {lay.dp_replicate}"))
    if lay.dp_shard < 2:
        why = "torchft averages gradients over the groups in FSDP's all-reduce hook (TorchTitan's way); dp_shard=1 builds no FSDP module"
        out.append(
            Problem("parallelism.dp_shard", lay.dp_shard, why, f"use dp_shard >= 2 inside each replica group (parallelism=hsdp2x2) {OFF}")
        )
    if lay.pp > 1:
        why = "TorchTitan 0.3.0's torchft experiment covers FSDP/HSDP only (no PP in its tests), and a stage cannot heal alone"
        out.append(Problem("parallelism.pp", lay.pp, why, f"use pp=1 with fault_tolerance=torchft {OFF}"))
    if cfg.cluster.max_restarts < 1:
        why = "a dead replica group restarts through its own torchrun job; with 0 restarts it never comes back"
        out.append(Problem("cluster.max_restarts", cfg.cluster.max_restarts, why, "use cluster.max_restarts=3"))
    _nodes(cfg, lay, out)
    _slurm(cfg, out)
    _fields(cfg, lay, out)
    if cfg.monitor.guard.enable and cfg.monitor.guard.action == GuardAction.rewind:
        why = "a rewind reloads one replica group's checkpoint while the others train on"
        out.append(Problem("monitor.guard.action", "rewind", why, f"use monitor.guard.action=skip {OFF}"))
    if cfg.monitor.integrity.interval and cfg.monitor.integrity.on_mismatch == MismatchAction.rewind:
        why = "a rewind reloads one replica group's checkpoint while the others train on"
        out.append(Problem("monitor.integrity.on_mismatch", "rewind", why, f"use monitor.integrity.on_mismatch=stop {OFF}"))


def _nodes(cfg: RunConfig, lay: Layout, out: list[Problem]) -> None:
    """Each replica group owns whole nodes, or several groups share a node whole: never part of a node each."""
    per_node = layout.devices_per_node(cfg.cluster, lay.world_size)
    group = ft.group_layout(lay).world_size
    if per_node < 1 or group % per_node == 0 or per_node % group == 0:
        return
    why = (
        f"a replica group of {group} ranks and nodes of {per_node} devices: one node would hold ranks of two groups, so its loss stops both"
    )
    fix = f"make world_size / dp_replicate ({group}) a multiple or a divisor of cluster.devices_per_node ({per_node})"
    out.append(Problem("parallelism.dp_replicate", lay.dp_replicate, why, fix))


POSITIVE = ("join_timeout_ms", "heartbeat_timeout_ms", "timeout_s", "quorum_timeout_s", "connect_timeout_s", "process_group_timeout_ms")


def _fields(cfg: RunConfig, lay: Layout, out: list[Problem]) -> None:
    f = cfg.fault_tolerance
    for name in POSITIVE:
        if getattr(f, name) <= 0:
            out.append(Problem(f"fault_tolerance.{name}", getattr(f, name), "must be > 0", "use the default from the schema"))
    if not 0 < f.lighthouse_port < 65536:
        out.append(Problem("fault_tolerance.lighthouse_port", f.lighthouse_port, "is no TCP port", "use 29510 (torchft's default)"))
    if not -1 <= f.replica_id < lay.dp_replicate:
        why = f"replica groups are 0..{lay.dp_replicate - 1}; the runner sets it in each group's frozen file"
        out.append(Problem("fault_tolerance.replica_id", f.replica_id, why, "leave it at -1"))
    if f.lighthouse and _address(f.lighthouse) is None:
        out.append(Problem("fault_tolerance.lighthouse", f.lighthouse, "is not an http://host:port address", "e.g. http://login1:29510"))


def _address(address: str) -> tuple[str, int] | None:
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        return (url.hostname, url.port) if url.hostname and url.port else None
    except ValueError:  # a port that is no number
        return None


def _slurm(cfg: RunConfig, out: list[Problem]) -> None:
    """On SLURM every replica group is its own job (runner.run.ft_launch.slurm_plan): the lighthouse must live outside them."""
    if cfg.cluster.launcher != Launcher.slurm:
        return
    if not cfg.fault_tolerance.lighthouse:
        why = "on SLURM each replica group is its own job, and a lighthouse started inside one would end with that group"
        fix = "start torchft_lighthouse on a host every node reaches and set fault_tolerance.lighthouse=http://<host>:29510"
        out.append(Problem("fault_tolerance.lighthouse", "", why, fix))
    if cfg.mode == Mode.train:
        why = "fault_tolerance=torchft on SLURM is one sbatch job per replica group, which mode=train does not submit"
        out.append(Problem("mode", "train", why, "print the jobs with mode=launch_plan and submit each with sbatch"))


def launch(cfg: RunConfig, out: list[Problem]) -> None:
    """This machine, now: torchft importable, and a configured lighthouse that accepts a connection."""
    if not ft.enabled(cfg):
        return
    if importlib.util.find_spec("torchft") is None:
        why = "the torchft package is not installed in this environment"
        out.append(Problem("fault_tolerance.name", "torchft", why, f"pip install torchft==0.2.0 (scripts/setup.sh installs it) {OFF}"))
    address = cfg.fault_tolerance.lighthouse
    if address:
        problem = unreachable(address)
        if problem:
            why = f"the torchft lighthouse does not answer: {problem}"
            out.append(
                Problem(
                    "fault_tolerance.lighthouse",
                    address,
                    why,
                    'start torchft_lighthouse there, or use lighthouse="" to let the runner start one',
                )
            )


def unreachable(address: str) -> str:
    """Why a TCP connection to the lighthouse's host:port fails ("" when it connects)."""
    where = _address(address)
    if where is None:
        return "not an http://host:port address"
    try:
        with socket.create_connection(where, timeout=2.0):
            return ""
    except OSError as e:
        return f"{where[0]}:{where[1]}: {e.strerror or e}"
