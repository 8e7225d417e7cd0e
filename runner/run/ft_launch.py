"""fault_tolerance=torchft on one machine: a torchft lighthouse and one torchrun job per replica group.

    python -m runner fault_tolerance=torchft parallelism=hsdp2x2

writes `<run folder>/replica_<r>/frozen.yaml` for each of the dp_replicate groups (its replica_id, the shared
checkpoint folder), starts torchft's `torchft_lighthouse` (unless fault_tolerance.lighthouse names a running one),
then `python -m runner.launch` for every group, each a torchrun job of world_size / dp_replicate ranks with its
own rendezvous and its own restarts (cluster.max_restarts). It watches them by PID: the run ends when every group
has finished; a group that gave up, or a lighthouse that stopped, stops the others. Every process it started is
stopped by its PID at the end (runner.run.procs.stop_pid).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from runner.config import fault_tolerance as ft
from runner.config import freeze
from runner.formats import checkpoint, runfiles
from runner.outputs import goodput
from runner.schema import RunConfig
from runner.schema.layout import Layout

POLL_S = 0.2


class LighthouseStopped(RuntimeError):
    """The torchft lighthouse ended while replica groups were training."""


def replica_config(cfg: RunConfig, run_dir: Path, replica_id: int) -> RunConfig:
    """Replica group `replica_id`'s config: its id, and the run's checkpoint folder (one for all groups: the group at
    participating rank 0 of the quorum writes it, TorchTitan's torchft checkpoint rule)."""
    ckpt = dataclasses.replace(cfg.checkpoint, folder=str(checkpoint.folder(cfg.checkpoint, run_dir).resolve()))
    f = dataclasses.replace(cfg.fault_tolerance, replica_id=replica_id)
    return dataclasses.replace(cfg, fault_tolerance=f, checkpoint=ckpt)


def write_replicas(cfg: RunConfig, lay: Layout, run_dir: Path) -> list[Path]:
    """One frozen file per replica group, in its own folder (its rank records, logs and metrics stay apart)."""
    paths = []
    for r in range(lay.dp_replicate):
        sub = run_dir / ft.replica_dir_name(r)
        sub.mkdir(parents=True, exist_ok=True)
        paths.append(freeze.write(replica_config(cfg, run_dir, r), lay, sub))
    return paths


def start_lighthouse(cfg: RunConfig, run_dir: Path) -> subprocess.Popen:
    """torchft's lighthouse binary, logging to <run folder>/logs/lighthouse.log; returns once its port answers."""
    from runner.config.validate import fault_tolerance_rules as ft_rules

    cmd = ft.lighthouse_command(cfg)
    cmd[0] = shutil.which(cmd[0]) or str(Path(sys.executable).parent / cmd[0])
    log = run_dir / runfiles.LIGHTHOUSE_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    address = ft.local_address(cfg)
    deadline = time.monotonic() + 30
    while ft_rules.unreachable(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pid(proc)
            raise LighthouseStopped(f"the torchft lighthouse ({' '.join(cmd)}) did not start; see {log}")
        time.sleep(POLL_S)
    return proc


def started(cfg: RunConfig, lighthouse: subprocess.Popen | None) -> str:
    """' (pid N, listening on 127.0.0.1:29510: loopback ...)' for the lighthouse the runner started; '' for a given one."""
    if lighthouse is None:
        return " (fault_tolerance.lighthouse, not started here)"
    bind, why = ft.lighthouse_bind(cfg)
    return f" (pid {lighthouse.pid}, listening on {bind}: {why})"


def start_group(cfg: RunConfig, lay: Layout, frozen: Path, lighthouse: str, replica_id: int) -> subprocess.Popen:
    """`python -m runner.launch` for one replica group: its own torchrun rendezvous on this machine. On Ctrl-C it exits
    130 without a line of its own: this process says where the run stopped (interrupted)."""
    from runner.run import node_launch

    flags = node_launch.torchrun_flags(
        cfg, ft.group_layout(lay), frozen.parent, rdzv_endpoint="127.0.0.1:0", rdzv_id=f"runner-ft{replica_id}-{uuid.uuid4().hex[:6]}"
    )
    env = os.environ | ft.env(cfg, lighthouse) | {node_launch.PARENT_REPORTS_INTERRUPT: "1"}
    return subprocess.Popen([sys.executable, "-m", "runner.launch", *flags, str(frozen)], env=env)


def interrupted(cfg: RunConfig, run_dir: Path, groups: list[subprocess.Popen]) -> Exception:
    """Ctrl-C: the groups, which had it too, stop their ranks (each within distributed.shutdown_timeout_s, then the
    stop_pid of run's end); then the run's one line: the last step any group finished and the command that resumes
    the whole run (runner.run.node_launch.interrupted)."""
    from runner.run import node_launch

    deadline = time.monotonic() + cfg.distributed.shutdown_timeout_s + 10
    try:
        while any(g.poll() is None for g in groups) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # Ctrl-C again: wait no longer
        pass
    timelines = [run_dir / ft.replica_dir_name(r) for r in range(len(groups))]
    return node_launch.Interrupted(node_launch.interrupted(cfg, run_dir, timelines))


def stop_pid(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process we started (by its PID), SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def run(cfg: RunConfig, lay: Layout, frozen: Path) -> None:
    """The lighthouse and every replica group on this machine; raise when the run did not finish."""
    run_dir = frozen.parent
    frozen_files = write_replicas(cfg, lay, run_dir)
    shutil.rmtree(run_dir / runfiles.FT_READY, ignore_errors=True)  # a resumed run's groups meet again (runner.run.ft.all_heartbeating)
    lighthouse = start_lighthouse(cfg, run_dir) if not cfg.fault_tolerance.lighthouse else None
    address = ft.local_address(cfg)
    groups = [start_group(cfg, lay, f, address, r) for r, f in enumerate(frozen_files)]
    pids = ", ".join(f"group {r} pid {g.pid}" for r, g in enumerate(groups))
    print(f"fault tolerance: torchft lighthouse {address}{started(cfg, lighthouse)}; {pids}", flush=True)
    try:
        watch(cfg, run_dir, groups, lighthouse, address)
        first = run_dir / ft.replica_dir_name(0) / runfiles.SUMMARY
        if first.is_file():  # the run's summary (and a sweep's objective) is replica group 0's
            shutil.copyfile(first, run_dir / runfiles.SUMMARY)
        print(run_goodput(run_dir, len(frozen_files)), flush=True)
    except KeyboardInterrupt:  # Ctrl-C: the terminal sent it to every group too; each stops its ranks and exits 130
        raise interrupted(cfg, run_dir, groups) from None
    finally:
        for g in groups:
            stop_pid(g)
        if lighthouse is not None:
            stop_pid(lighthouse)


def run_goodput(run_dir: Path, groups: int) -> str:
    """The run's goodput.json from its replica groups' timelines (a group's outage is lost capacity); its line."""
    report = goodput.combine([goodput.account(goodput.read(run_dir / ft.replica_dir_name(r))) for r in range(groups)])
    runfiles.write_json(run_dir / runfiles.GOODPUT, report)
    return goodput.line(goodput.flat(report), run_dir / runfiles.GOODPUT, f" of the {groups} replica groups (group-seconds)")


def watch(cfg: RunConfig, run_dir: Path, groups: list[subprocess.Popen], lighthouse: subprocess.Popen | None, address: str) -> None:
    """Until every group has ended: a group that failed, or the lighthouse that stopped, ends the run."""
    while any(g.poll() is None for g in groups):
        failed = [r for r, g in enumerate(groups) if g.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"replica group {failed[0]} gave up after cluster.max_restarts={cfg.cluster.max_restarts} restarts")
        if lighthouse is not None and lighthouse.poll() is not None:
            raise LighthouseStopped(lighthouse_message(cfg, run_dir, address, lighthouse))
        time.sleep(POLL_S)
    failed = [r for r, g in enumerate(groups) if g.returncode != 0]
    if failed:
        raise RuntimeError(f"replica group {failed[0]} ended with exit code {groups[failed[0]].returncode}")


def lighthouse_message(cfg: RunConfig, run_dir: Path, address: str, lighthouse: subprocess.Popen) -> str:
    """What stopped, and what is kept: the newest complete checkpoint and how to resume from it."""
    folder = checkpoint.folder(cfg.checkpoint, run_dir)
    last = checkpoint.choose(folder)[0] if cfg.checkpoint.enable else None
    kept = f"the last checkpoint is {last}; resume with checkpoint.resume=true" if last else "no checkpoint was written"
    return (
        f"the torchft lighthouse {address} (pid {lighthouse.pid}) stopped with exit code {lighthouse.returncode}: "
        f"the replica groups cannot form a quorum without it, so every group is stopped; {kept}"
    )


def plan(cfg: RunConfig, lay: Layout, run_dir: Path) -> str:
    """mode=launch_plan under fault_tolerance=torchft on several nodes: one job per replica group (on SLURM one sbatch
    job each: SLURM ends a whole job when one of its nodes fails, so groups sharing a job would not survive each
    other), every group's nodes running the per-node launcher with a rendezvous of their own, and a lighthouse
    outside the groups' jobs (fault_tolerance.lighthouse)."""
    from runner.run import node_launch

    c, group = cfg.cluster, ft.group_layout(lay)
    nodes = max(1, c.num_nodes // lay.dp_replicate)
    slurm = c.launcher == "slurm"
    env = " ".join(f"{k}={v}" for k, v in ft.env(cfg, cfg.fault_tolerance.lighthouse or "http://<lighthouse host>:29510").items())
    bind, why = ft.lighthouse_bind(cfg)
    lines = [
        f"torchft lighthouse, on a host every node reaches, outside the groups' jobs: {' '.join(ft.lighthouse_command(cfg))}"
        f" (listening on {bind}: {why})",
        f"{lay.dp_replicate} jobs, one per replica group, each {nodes} node(s) x {group.world_size // nodes} rank(s):",
    ]
    job_cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(c, num_nodes=nodes))
    for r, frozen in enumerate(write_replicas(cfg, lay, run_dir)):
        head = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)" if slurm else f"$GROUP{r}_HEAD_ADDR"
        rdzv_id = "$SLURM_JOB_ID" if slurm else f"runner-{run_dir.name}-replica{r}"
        cmd = node_launch.node_command(job_cfg, group, frozen, rdzv_endpoint=f"{head}:{c.rdzv_port}", rdzv_id=rdzv_id)
        where = (
            f"sbatch --nodes={nodes} --ntasks-per-node=1 --job-name={cfg.parallelism.name}-replica{r}, its task:"
            if slurm
            else (f"on each of its {nodes} node(s):")
        )
        lines += [f"\n  # replica group {r}: {where}", f"  {'srun ' if slurm else ''}env {env} {cmd}"]
    return "\n".join(lines)
