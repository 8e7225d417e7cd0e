"""Launch-time rules (torch-free): how the run is started, and this machine (driver, device kernels, memory for
this node's ranks). The preflight (runner.config.validate.preflight) walks them with the data, held-out and
checkpoint rules of the other modules, before any rank starts."""

from __future__ import annotations

import os

from runner.config import slurm
from runner.estimate import host_memory
from runner.schema import ClusterConfig, DeviceType, RunConfig
from runner.schema.layout import Layout
from runner.schema.problems import Problem


def how_started(c: ClusterConfig, out: list[Problem]) -> None:
    """`python -m runner` starts the ranks of one node, or submits through SLURM with -m."""
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


def this_machine(cfg: RunConfig, lay: Layout, node: bool, out: list[Problem]) -> None:
    """What this machine can start: its driver, the kernels its device has, its memory for the ranks of this node."""
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
    if cfg.eval.cpu_flex_attention:
        out.append(
            Problem(
                "eval.cpu_flex_attention",
                True,
                "is test-only: runner.run.layout_parity's forward-only check of FlexAttention on CPU, whose backward a "
                "training step would need",
                "leave it false (on GPUs the model uses FlexAttention anyway)",
            )
        )
    if c.device == DeviceType.cpu:
        per_rank, ranks = host_memory.cpu_rank_gb(cfg, lay), lay.world_size // c.num_nodes
        have = host_memory.machine_memory_gb()
        if per_rank * ranks > have:
            out.append(
                Problem(
                    "parallelism",
                    lay.describe(),
                    f"{ranks} ranks x {per_rank:.2f} GB estimated = {per_rank * ranks:.1f} GB exceeds this machine's {have:.1f} GB",
                    "use fewer ranks or a smaller model/batch",
                )
            )
