"""The runner's per-node launcher: torchrun (torch's elastic agent) around `runner.run.per_rank`.

    python -m runner.launch [torchrun flags] <run folder>/frozen.yaml

does the node's set-up (the CPU peak measurement when the cluster has no peak, OpenMP
threads per rank) and then runs torchrun in-process with those flags and
`-m runner.worker <frozen.yaml>`. One node (`python -m runner`) uses a rendezvous on
127.0.0.1 (torchrun --standalone); several nodes use the standard multi-node recipe:
every node starts this launcher with the same --rdzv-id and a c10d rendezvous on the
first node, and the agents assign ranks contiguously per node. `node_command` prints
exactly what each node runs (`mode=launch_plan`, SLURM tasks).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import sys
import uuid
from pathlib import Path

from runner.config import fault_tolerance as ft
from runner.config import validate
from runner.formats import checkpoint, local_checkpoint, runfiles
from runner.formats.user_files import UnreadableFile
from runner.outputs import goodput
from runner.outputs.timeline import Timeline
from runner.run import known_warnings, procs
from runner.schema import RunConfig, WorkerStart
from runner.schema.layout import Layout
from runner.schema.problems import ConfigError

MONITOR_INTERVAL_S = 0.5


class Interrupted(Exception):
    """Ctrl-C (SIGINT) reached the launcher (the elastic agent stops the ranks): the run was interrupted, nothing failed.
    Its message is `interrupted`'s line."""


PARENT_REPORTS_INTERRUPT = "RUNNER_PARENT_REPORTS_INTERRUPT"
"""Set in the environment of a launcher whose parent says where the run stopped (runner.run.ft_launch's replica
groups): on Ctrl-C it exits 130 without its own line, which would name its replica group's frozen file, not the run's."""


def torchrun_flags(cfg: RunConfig, lay: Layout, run_dir: Path, *, rdzv_endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun flags for one node of this run. Local rank 0 of each node keeps the console
    (global rank 0 draws the progress bar); the other ranks write
    <run folder>/logs/<rdzv id>/attempt_<n>/<rank>/std{out,err}.log."""
    per_node = lay.world_size // cfg.cluster.num_nodes
    flags = [
        f"--nnodes={cfg.cluster.num_nodes}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--max-restarts={cfg.cluster.max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        f"--shutdown-timeout={cfg.distributed.shutdown_timeout_s}",
        f"--log-dir={run_dir / runfiles.LOGS}",
    ]
    if per_node > 1:
        flags.append("--redirects=" + ",".join(f"{r}:3" for r in range(1, per_node)))
    return flags


def node_command(cfg: RunConfig, lay: Layout, frozen: Path, *, rdzv_endpoint: str, rdzv_id: str) -> str:
    """The shell command every node of a multi-node run executes."""
    flags = torchrun_flags(cfg, lay, frozen.parent, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    # endpoint and id may be shell expressions evaluated on the node (SLURM variables)
    quoted = [f if "$" in f else shlex.quote(f) for f in flags]
    return " ".join(["python", "-m", "runner.launch", *quoted, shlex.quote(str(frozen))])


def _node_setup(cfg: RunConfig, lay: Layout, frozen: Path) -> None:
    from runner.run import peak

    procs.honour_shutdown_timeout()
    procs.note_agent_restarts(lambda attempt: _note_failure(Timeline(frozen.parent), attempt))
    if not (frozen.parent / runfiles.PEAK).exists():
        peak.write(cfg, lay.world_size, frozen.parent)  # before the ranks start: the machine is idle
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # torch 2.13 keeps the c10d rendezvous store across restarts but no longer prefixes the ranks' keys per attempt,
    # so restarted ranks read the dead ranks' gloo addresses (connectFullMesh: connection refused); opt out of sharing
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from runner.run.device import DevicePolicy

    for key, value in DevicePolicy.of(cfg.cluster, cfg.distributed).agent_env(lay.world_size // cfg.cluster.num_nodes).items():
        os.environ.setdefault(key, value)


def _note_failure(timeline: Timeline, attempt: int) -> None:
    """The agent restarts the ranks of `attempt`: when the one that went quiet first was last alive, and when the
    agent noticed (runner.outputs.goodput takes the earliest of these and the ranks' own errors)."""
    from runner.observe import forensics

    quiet = forensics.last_alive(timeline.path.parent, attempt)
    if quiet is not None:
        timeline.write("failure", attempt=attempt, time=quiet[1], by=f"rank {quiet[0]}: no error (its last record)")
    timeline.failure("agent: restarting the ranks", attempt=attempt)


def start(flags: list[str], frozen: Path, cfg: RunConfig, *, checked: bool = False) -> None:
    """Run torchrun with `flags` on this node; raise ChildFailedError if a rank fails. `cfg` is the run's config as
    `frozen` holds it (its callers have read or written that file). Unless `checked`
    (`python -m runner` ran it), the preflight runs first and a problem ends the launch with exit code 2.

    The elastic agent polls its ranks every `monitor_interval` seconds; when one fails (a collective that
    timed out after distributed.timeout_s raises) it stops the others (SIGTERM, then SIGKILL after 30 s,
    which also ends a SIGSTOPped rank), and hang_report.json (a hang) or failure_report.json (a rank that
    raised) is written from the ranks' records.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    from runner.config import fault_tolerance as ft
    from runner.observe import forensics, rank_recorder
    from runner.schema import layout

    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    run_dir = frozen.parent
    if ft.enabled(cfg):  # one replica group's job (runner.run.ft_launch): its ranks are the group's
        lay = ft.group_layout(lay)
    if not checked:
        try:
            validate.preflight(cfg, run_dir, lay, node=True)
        except ConfigError as e:
            print(e, file=sys.stderr)
            procs.exit_now(2)
    try:
        _node_setup(cfg, lay, frozen)
        known_warnings.apply(known_warnings.on_console())  # the launcher's console: before the ranks import TorchTitan here
        os.environ.update(rank_recorder.rank_env(cfg, run_dir))  # the agent passes its environment to every rank
        with procs.agent_signal_handlers():
            if cfg.cluster.worker_start == WorkerStart.fork:
                from runner.run import per_rank, titan

                titan.preload(cfg)
                procs.fork_ranks(flags, per_rank.forked_main, str(frozen))
            else:
                torchrun(parse_args([*flags, "-m", "runner.worker", str(frozen)]))
    except SignalException as e:
        if e.sigval != signal.SIGINT:  # SIGTERM, SIGHUP: the job is being ended, a failure of the run
            raise
        raise Interrupted(interrupted(cfg, run_dir)) from None
    except KeyboardInterrupt:  # before the agent started the ranks, or after they ended
        raise Interrupted(interrupted(cfg, run_dir)) from None
    except ChildFailedError as e:  # the agent has stopped every rank: assemble the report from their records
        written = forensics.write_report(cfg, run_dir, lay.world_size, str(e), forensics.torn_down(e.failures))
        if written is not None:
            print(f"{written[0]}: report in {written[1]}", file=sys.stderr)
        raise


def interrupted(cfg: RunConfig, run_dir: Path, timelines: list[Path] | None = None) -> str:
    """What Ctrl-C's exit (130, as `python -m runner.data prepare`) says: the last step the run finished (in the
    timelines of `timelines`, the run folder's by default) and the command that resumes it. A shared save the
    interrupt cut off (`step-<n>.partial`) is removed on one node; a local tier's is ignored by every restore."""
    steps = []
    for folder in timelines or [run_dir]:
        try:
            steps += [e["step"] for e in goodput.read(folder) if e.get("event") == "step"]
        except ValueError:  # a line cut off as rank 0 stopped
            pass
    at = f"step {max(steps)}" if steps else "start-up (no step finished)"
    replay = f"python -m runner --config-dir {run_dir} --config-name {runfiles.FROZEN.removesuffix('.yaml')}"
    c = cfg.checkpoint
    if not c.enable:
        return f"interrupted at {at}; checkpoints are off, so a rerun starts at step 1: {replay}"
    where = checkpoint.folder(c, run_dir).resolve()
    alone = cfg.cluster.num_nodes == 1 and not ft.enabled(cfg)  # else other nodes or replica groups may be saving there
    cut = sorted(where.glob(f"{runfiles.CHECKPOINT_PREFIX}*{runfiles.CHECKPOINT_PARTIAL}")) if alone and where.is_dir() else []
    for p in cut:  # the next start would remove them too (runner.run.checkpointer); a resume ignores them
        shutil.rmtree(p, ignore_errors=True)
    removed = f" (removed {', '.join(p.name for p in cut)}, a save it cut off)" if cut else ""
    newest = _newest_saved(cfg, where)
    if newest is None:
        return f"interrupted at {at}{removed}; no checkpoint to resume from in {where} yet, so a rerun starts at step 1: {replay}"
    pinned = " checkpoint.resume_from=" if c.resume_from else ""  # resume the newest, not the checkpoint this run resumed
    return (
        f"interrupted at {at}{removed}; resume from step {newest} with: {replay} checkpoint.resume=true checkpoint.folder={where}{pinned}"
    )


def _newest_saved(cfg: RunConfig, where: Path) -> int | None:
    """The newest step saved to the shared folder `where` (by sizes), or to the local tier where its folders are visible."""
    steps = [step for step, _ in checkpoint.scan(where).complete[:1]]
    lc = cfg.checkpoint.local
    for node in (local_checkpoint.visible_nodes(cfg) or []) if lc.folder else []:
        steps.append(local_checkpoint.newest_step(local_checkpoint.root(lc, node, where)))
    return max((s for s in steps if s is not None), default=None)


def run(cfg: RunConfig, lay: Layout, frozen: Path, *, checked: bool = False) -> None:
    """One node: every rank on this machine, rendezvous on 127.0.0.1 (with fault_tolerance=torchft runner.run.ft_launch
    starts one job per replica group instead)."""
    flags = torchrun_flags(cfg, lay, frozen.parent, rdzv_endpoint="127.0.0.1:0", rdzv_id=f"runner-{uuid.uuid4().hex[:8]}")
    start(flags, frozen, cfg, checked=checked)


def cli() -> None:
    """`python -m runner.launch` (runner/launch.py)."""
    from runner.config import freeze

    if len(sys.argv) < 2 or not sys.argv[-1].endswith(".yaml"):
        sys.exit("usage: python -m runner.launch [torchrun flags] <run folder>/frozen.yaml")
    frozen = Path(sys.argv[-1])
    try:
        cfg = freeze.load(frozen)
    except (UnreadableFile, ConfigError) as e:  # a frozen file cut short, not YAML, of the wrong shape: one message, exit 2
        print(e, file=sys.stderr)
        procs.exit_now(2)
    try:
        start(sys.argv[1:-1], frozen, cfg)
    except Interrupted as e:
        if not os.environ.get(PARENT_REPORTS_INTERRUPT):
            print(e, file=sys.stderr)
        procs.exit_now(130)
    procs.exit_now(0)
