"""The preflight: every check of starting a validated config on this machine, now (torch-free).

One function for both entry points: `python -m runner` runs it before it freezes and launches a run,
and `python -m runner.launch` (the per-node command that `mode=launch_plan` prints and SLURM tasks
run) runs it on every node before torchrun starts. It absolutizes the data paths, then checks how
the run is started, this machine (driver, device kernels, memory for this node's ranks), the data
files and tokenizer, the checkpoint storage and what there is to resume (runner.config.validate.checkpoint).
All problems are raised together.
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.config import memory, slurm, validate
from runner.config.layout import Layout
from runner.config.problems import ConfigError, Problem
from runner.config.schema import ClusterConfig, DeviceType, RunConfig
from runner.config.validate import checkpoint as validate_ckpt
from runner.config.validate import eval as validate_eval


def run(cfg: RunConfig, lay: Layout, run_dir: Path, *, node: bool = False) -> None:
    """Raise ConfigError with every problem of starting `cfg` here. `node`: called by the per-node launcher,
    which is how a multi-node or SLURM run is meant to start, so the rules about how to start it are skipped."""
    validate_ckpt.absolute_paths(cfg)
    validate_eval.absolute_paths(cfg)
    out = [] if node else _how_started(cfg.cluster)
    out += _this_machine(cfg, lay, node)
    out += validate_eval.check_launch(cfg)
    try:
        validate_ckpt.check_launch(cfg, run_dir)
    except ConfigError as e:
        out += e.problems
    if out:
        raise ConfigError(out)


def _how_started(c: ClusterConfig) -> list[Problem]:
    """`python -m runner` starts the ranks of one node, or submits through SLURM with -m."""
    out: list[Problem] = []
    if slurm.in_job():
        nodes = int(os.environ.get("SLURM_NNODES", "1"))
        if nodes != c.num_nodes:
            out.append(
                Problem(
                    "cluster.num_nodes",
                    c.num_nodes,
                    f"this SLURM job has {nodes} nodes",
                    f"set cluster.num_nodes={nodes} or resize the job",
                )
            )
    elif c.launcher == "slurm":
        out.append(
            Problem(
                "cluster.launcher",
                "slurm",
                "a SLURM cluster is submitted, not started on this machine",
                f"add -m to submit through Hydra's submitit launcher (python -m runner -m cluster={c.name} ...), "
                "or mode=launch_plan to print the sbatch script and per-node command",
            )
        )
    elif c.num_nodes > 1:
        out.append(
            Problem(
                "cluster.num_nodes",
                c.num_nodes,
                "`python -m runner` starts the ranks of one node; a multi-node job starts the per-node launcher on every node",
                "use mode=launch_plan: it writes the frozen config and prints the command to run on each node",
            )
        )
    return out


def _this_machine(cfg: RunConfig, lay: Layout, node: bool) -> list[Problem]:
    """What this machine can start: its driver, the kernels its device has, its memory for the ranks of this node."""
    out: list[Problem] = []
    c = cfg.cluster
    no_driver = c.device == DeviceType.cuda and not os.path.exists("/proc/driver/nvidia/version")
    if no_driver and (node or c.launcher != "slurm"):  # `python -m runner -m` submits a SLURM run from a login node
        out.append(
            Problem(
                "cluster.device",
                "cuda",
                f"this machine has no NVIDIA driver, so cluster {c.name} cannot start here",
                "use cluster=local_cpu, or mode=validate to check the config only",
            )
        )
    if lay.pp > 1 and c.device == DeviceType.cuda:
        out.append(
            Problem(
                "parallelism.pp",
                lay.pp,
                "on CUDA the model uses FlexAttention, whose per-microbatch masks the pipeline step does not pass yet",
                "use pp=1 on GPU clusters for now; mode=validate checks PP layouts",
            )
        )
    if c.device == DeviceType.cpu:
        per_rank, ranks = memory.cpu_rank_gb(cfg, lay), lay.world_size // c.num_nodes
        have = validate.machine_memory_gb()
        if per_rank * ranks > have:
            out.append(
                Problem(
                    "parallelism",
                    lay.describe(),
                    f"{ranks} ranks x {per_rank:.2f} GB estimated = {per_rank * ranks:.1f} GB exceeds this machine's {have:.1f} GB",
                    "use fewer ranks or a smaller model/batch",
                )
            )
    return out
