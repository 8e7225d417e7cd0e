"""What happens to a point of a run or a sweep once it is validated: it is trained (on this machine or as a
node of a SLURM job), and a point that is invalid or whose ranks fail is recorded (invalid.json, failed.json)
so that the sweep goes on; one W&B group per sweep. Torch-free until the ranks are launched."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from runner.config import fault_tolerance, freeze, slurm, validate
from runner.config.search import objective as search_objective
from runner.formats import runfiles
from runner.outputs.timeline import Timeline, process_start
from runner.schema import RunConfig
from runner.schema.layout import Layout


@dataclass
class State:
    """What outlives one Hydra task of the process (Hydra calls the task once per point)."""

    entered: bool = False
    """Hydra handed over a composed config (before that, an exit 1 is Hydra rejecting the command line)."""
    failed: list[str] = field(default_factory=list)
    """Overrides of the sweep points whose ranks failed."""
    task_started: float = 0.0
    """When the Hydra task began: the process's start for the first task, the task's call for later sweep points
    (wall clock; the launch of the point's goodput, runner.outputs.goodput)."""
    fresh: bool = True
    """The task's run folder held only what Hydra puts there when the task began: a refusal removes it whole, with
    whatever the runner wrote before refusing (frozen.yaml of a dry run whose rehearsal cannot start)."""

    def begin_task(self, run_dir: Path) -> None:
        self.task_started = time.time() if self.entered else process_start()
        self.entered = True
        self.fresh = not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} <= set(runfiles.HYDRA_LOGS)


STATE = State()


def multirun() -> bool:
    return HydraConfig.get().mode == RunMode.MULTIRUN


def discard(run_dir: Path) -> None:
    """Remove the run folder Hydra just made (not one that held anything else when the task began: a run's, which a
    refusal keeps), and the folders above it that it leaves empty up to the working folder (outputs/<date>/ and
    outputs/ of Hydra's default run folder), so a check or a rejected config leaves nothing behind. A run folder
    outside the working folder takes its parent along only if that is left empty."""
    if not run_dir.is_dir() or not STATE.fresh:
        return
    shutil.rmtree(run_dir)
    cwd = Path(HydraConfig.get().runtime.cwd)
    stop = cwd if run_dir.is_relative_to(cwd) else run_dir.parent.parent
    for parent in run_dir.parents:
        if parent == stop or any(parent.iterdir()):
            break
        parent.rmdir()


def fail(msg: str, run_dir: Path) -> None:
    print(msg, file=sys.stderr)
    discard(run_dir)
    sys.exit(2)


def invalid_point(e: Exception, run_dir: Path) -> float:
    """In a multirun an invalid point is a result, not the end of the sweep: record why, and return the
    objective of a point that lost (an optimizing sweeper goes on with its next trial)."""
    problems = [str(p) for p in e.problems] if isinstance(e, validate.ConfigError) else [str(e)]
    overrides = list(HydraConfig.get().overrides.task)
    print(f"invalid sweep point {' '.join(overrides)}:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    (run_dir / runfiles.INVALID).write_text(json.dumps({"overrides": overrides, "problems": problems}, indent=2) + "\n")
    return search_objective.WORST


def train(cfg: RunConfig, lay: Layout, run_dir: Path) -> float | None:
    """Freeze the validated config and train it: on this machine, or as a node of a SLURM job (which also
    resumes a requeued job in its own folder). A failed run is a result in a sweep: failed.json, and the
    sweep goes on. Returns the run's measured objective on the first node."""
    if slurm.in_job():
        node, _, first_host, job_id = slurm.job_nodes()
    else:
        node, first_host, job_id = 0, None, None
    requeued = slurm.restart_count() > 0  # SLURM requeued this job: resume in its own run folder (runner.run.preempt)
    if node == 0 and (run_dir / runfiles.FROZEN).exists() and not requeued:
        fail(f"Run folder {run_dir} already holds a run. Fix: set hydra.run.dir to a new folder.", run_dir)
    if multirun() and cfg.logging.wandb.group is None:
        # one W&B group per sweep, passed to the ranks through wandb's own variable rather than frozen,
        # so that a replay of frozen.yaml gets a group of its own instead of joining this sweep's
        os.environ["WANDB_RUN_GROUP"] = wandb_group(Path(HydraConfig.get().sweep.dir))
    frozen = run_dir / runfiles.FROZEN
    if node == 0 and not requeued:
        freeze.pin(cfg, run_dir)
        freeze.write(cfg, lay, run_dir)
    else:
        slurm.wait_for(frozen)  # the first node writes it; all nodes share the run folder
    if node == 0:
        Timeline(run_dir).launch(STATE.task_started)
    from runner.run import console

    with console.teed(run_dir / runfiles.RUNNER_LOG) if node == 0 else contextlib.nullcontext():  # the run's console
        return _launch(cfg, lay, run_dir, frozen, node, first_host, job_id)


def _launch(cfg: RunConfig, lay: Layout, run_dir: Path, frozen: Path, node: int, first_host, job_id) -> float | None:
    """Start the ranks (a torchft job, this machine, or this SLURM node); a failed run is recorded (failed.json)."""
    from runner.run import node_launch

    try:
        if job_id is None and fault_tolerance.enabled(cfg):  # a lighthouse and one job per replica group
            from runner.run import ft_launch

            ft_launch.run(cfg, lay, frozen)
        elif job_id is None:
            node_launch.run(cfg, lay, frozen, checked=True)
        else:
            _slurm_node(cfg, lay, run_dir, frozen, first_host, job_id)
    except node_launch.Interrupted as e:  # Ctrl-C: the agent stopped the ranks; nothing failed
        print(e, file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a rank failed: the agent printed which one and where its log is
        record = _failed_point(e, run_dir)
        where = f"rank logs in {record['logs']}; recorded in {run_dir / runfiles.FAILED}"
        print(f"training failed: {record['error']}; {where}", file=sys.stderr)
        if not multirun() or job_id is not None:  # a SLURM job reports its own failure
            sys.exit(1)
        STATE.failed.append(" ".join(record["overrides"]))  # the sweep goes on; cli() exits 1 at its end
        return search_objective.WORST
    return _run_objective(cfg, run_dir) if node == 0 else None


def _run_objective(cfg: RunConfig, run_dir: Path) -> float:
    """The measured objective of a finished run, from its summary.json."""
    path = run_dir / runfiles.SUMMARY
    if not path.is_file():  # another node of a SLURM job wrote it, or the run logged no step
        return search_objective.WORST
    try:
        return search_objective.of_run(cfg, json.loads(path.read_text()))
    except validate.ConfigError as e:  # the run itself is kept: only the objective is missing
        print(str(e), file=sys.stderr)
        if not multirun():
            sys.exit(2)
        return search_objective.WORST


def _slurm_node(cfg: RunConfig, lay, run_dir: Path, frozen: Path, first_host: str, job_id: str) -> None:
    """A node of a SLURM job: torchrun with a c10d rendezvous on the job's first node. SLURM's warning
    signal goes to submitit's requeue only once the ranks have checkpointed (runner.run.preempt)."""
    from runner.run import mesh, node_launch, preempt

    if slurm.node_name():
        os.environ.setdefault(mesh.NODE_NAME_ENV, slurm.node_name())  # nodes may share a hostname
    takeover = preempt.AgentTakeover(run_dir)
    endpoint = f"{cfg.cluster.rdzv_host or first_host}:{cfg.cluster.rdzv_port}"
    node_launch.start(node_launch.torchrun_flags(cfg, lay, run_dir, rdzv_endpoint=endpoint, rdzv_id=job_id), frozen, cfg, checked=True)
    takeover.hand_over()


def wandb_group(sweep_dir: Path) -> str:
    """The sweep folder's full path names the sweep unambiguously (the last two parts repeat across
    roots); W&B allows 128 characters, so a longer path keeps its end and a hash of the whole."""
    full = str(sweep_dir.resolve())
    if len(full) <= 128:
        return full
    return f"...{full[-110:]}-{hashlib.sha1(full.encode()).hexdigest()[:10]}"


def _failed_point(e: Exception, run_dir: Path) -> dict:
    """failed.json: a run whose ranks failed is a result too (runner.compare lists it)."""
    from runner.observe import forensics

    failures = getattr(e, "failures", {})  # torch's ChildFailedError: rank -> ProcessFailure
    records = forensics.read_records(run_dir)  # each rank's own exception line, when it could write one
    ranks = {
        str(r): {"exit_code": f.exitcode, "error": (records.get(r) or {}).get("error") or _first_line(f.message)}
        for r, f in sorted(failures.items())
    }
    first = next(iter(ranks.values()), {"exit_code": 1, "error": f"{type(e).__name__}: {e}"})
    record = {
        "overrides": list(HydraConfig.get().overrides.task),
        "exit_code": first["exit_code"],
        "error": first["error"],
        "failed_ranks": ranks,
        "logs": str(run_dir / runfiles.LOGS),
        "report": next((str(run_dir / n) for n in (runfiles.FAILURE_REPORT, runfiles.HANG_REPORT) if (run_dir / n).is_file()), None),
    }
    (run_dir / runfiles.FAILED).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _first_line(message: str | dict) -> str:
    """The exception line of a rank's error (torch's error file, a dict when the rank was forked, holds the whole traceback)."""
    if isinstance(message, dict):
        message = message.get("message", message)
    lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"
