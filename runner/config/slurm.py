"""SLURM through Hydra's submitit launcher: the sbatch script it would submit, the job's
nodes, and a pre-submission check.

Torch-free. `conf/cluster/slurm_h100.yaml` maps cluster fields onto `hydra.launcher`
(hydra-submitit-launcher's SlurmQueueConf); `python -m runner -m cluster=slurm_h100 ...`
then submits the sweep's points through the plugin as one array job (submitit's map_array), a task
per point, and every node of a task runs the task function, which starts the per-node launcher
(runner/launch.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
FIRST_NODE = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
SCHEDULER_ERROR_EXIT = 3
"""Exit status of `python -m runner -m ...` when SLURM refused the submission (2 is a bad config)."""


def sbatch_extra(exclusive: bool, container_image: str | None) -> dict[str, Any]:
    """sbatch flags that SlurmQueueConf lacks, for its `additional_parameters`. `--requeue` always: a preempted job
    checkpoints and hands over to submitit's requeue (runner.run.preempt), which sites with `JobRequeue=0` refuse
    for jobs that did not ask for it."""
    out: dict[str, Any] = {"requeue": True}
    if exclusive:
        out["exclusive"] = True
    if container_image:
        out["container_image"] = container_image  # pyxis/enroot
    return out


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("sbatch_extra", sbatch_extra, replace=True)


def submission(job_cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    """(hydra.launcher resolved against the job config, as the plugin receives it; the job's run folder).

    Under `-m` these are this point's own. Without it they are those of job 0 of the same command
    submitted with `-m` (the sweep folder of now), so a preview never points at a folder no job uses."""
    root = OmegaConf.create({"hydra": OmegaConf.to_container(HydraConfig.get(), resolve=False)})
    root.merge_with({k: v for k, v in OmegaConf.to_container(job_cfg, resolve=False).items() if k != "hydra"})
    if OmegaConf.is_missing(root.hydra.job, "num"):  # not a multirun: the first job of the submission
        root.hydra.job.num = 0
    job_dir = (Path(str(root.hydra.sweep.dir)) / str(root.hydra.sweep.subdir)).absolute()
    return OmegaConf.to_container(root.hydra.launcher, resolve=True), job_dir


def sbatch_script(launcher: dict[str, Any], num_jobs: int = 1) -> str:
    """The sbatch file submitit writes for these launcher parameters (submitit's own
    generator and name mapping, as hydra-submitit-launcher and AutoExecutor apply them).
    Several jobs are one array job, as submitit's map_array submits a sweep's batch."""
    from submitit.slurm import slurm

    # private_api: submitit_equivalence_dict, submitit_make_sbatch_string, submitit_submit_module
    generic = slurm.SlurmExecutor._equivalence_dict()
    params = {}
    for key, value in launcher.items():
        if key in ("_target_", "submitit_folder", "max_num_timeout") or value is None:
            continue
        params[generic.get(key, key)] = value
    if "mem" in params:
        params["mem"] = f"{params['mem']}GB"
    if num_jobs > 1:
        params["map_count"] = num_jobs
    folder = str(Path(launcher["submitit_folder"]).expanduser().absolute())  # as submitit's executor does
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(folder)])  # SlurmExecutor's
    return slurm._make_sbatch_string(command=command, folder=folder, **params)


def array_preview(launcher: dict[str, Any], jobs: list[list[str]], first_job: int) -> str:
    """What Hydra's submitit launcher submits for one batch of a sweep: the sbatch script of the one (array) job, and
    the sweep point each array task runs, by the overrides that set it apart."""
    common = set.intersection(*map(set, jobs))
    what = "one job" if len(jobs) == 1 else f"one array job of {len(jobs)} tasks, one per sweep point"
    lines = [f"sbatch script (what hydra-submitit-launcher submits for `python -m runner -m ...`: {what}; nothing is submitted):\n"]
    lines.append(sbatch_script(launcher, len(jobs)))
    if len(jobs) > 1:
        lines.append("\narray tasks ($SLURM_ARRAY_TASK_ID: the sweep point it runs):")
        for i, job in enumerate(jobs):
            lines.append(f"  {i}: job {first_job + i}: {' '.join(o for o in job if o not in common) or '(same overrides)'}")
    return "\n".join(lines)


def in_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def restart_count() -> int:
    """How many times SLURM has requeued this job (SLURM_RESTART_COUNT; 0 on its first run)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def node_name() -> str | None:
    """This node's SLURM name: nodes may share a hostname (the localhost cluster), their SLURM names differ."""
    return os.environ.get("SLURMD_NODENAME")


def job_nodes() -> tuple[int, int, str, str]:
    """(this node's index, number of nodes, first node's hostname, job id) of the running job."""
    import submitit

    env = submitit.JobEnvironment()
    return env.node, env.num_nodes, env.hostnames[0], str(env.job_id)


def wait_for(path: Path, timeout_s: float = 300.0) -> None:
    """Nodes other than the first wait for the first node to write the frozen config."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s; is the run folder on a shared file system?")
        time.sleep(1.0)


def submission_problem() -> str | None:
    """Before Hydra's submitit launcher submits: is SLURM here at all? Without sbatch/srun the
    plugin would fail with submitit's traceback; say what to do instead (the sweeper asks)."""
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if not missing:
        return None
    return (
        f"hydra.launcher = submitit_slurm: {' and '.join(missing)} not found on this machine, so nothing can be submitted. "
        "Fix: run from a SLURM login node, or add mode=launch_plan to print the sbatch script and per-node command "
        "without submitting."
    )


def scheduler_error(e: BaseException) -> str | None:
    """The message for a submission the scheduler refused: submitit raises FailedJobError from sbatch's
    CalledProcessError, whose command, exit status and stderr say what happened; None for any other error."""
    cause = e.__cause__
    if type(e).__name__ != "FailedJobError" or not isinstance(cause, subprocess.CalledProcessError):
        return None
    command = shlex.join(str(a) for a in cause.cmd)
    said = (cause.stderr or cause.output or "").strip() or "(no message)"
    return (
        f"scheduler error: `{command}` exited with status {cause.returncode}: {said}\n"
        "Nothing was submitted. Fix: check that the SLURM controller answers (`sinfo`, `scontrol ping`) and that "
        "SLURM_CONF names this cluster's slurm.conf, or add mode=launch_plan to print the sbatch script without submitting."
    )
