"""Start the ranks of one node with torch's elastic agent (the engine behind torchrun)."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

from runner.layout import Layout
from runner.schema import DeviceType, RunConfig


def run(cfg: RunConfig, lay: Layout, frozen: Path) -> None:
    """Run `python -m runner.worker <frozen>` on every local rank; raise if any rank fails.

    The elastic agent polls its ranks every `monitor_interval` seconds; when one fails (a collective that
    timed out after distributed.timeout_s raises) it stops the others (SIGTERM, then SIGKILL after 30 s,
    which also ends a SIGSTOPped rank), and hang_report.json is written from the ranks' records.
    Rank 0 keeps the console (progress bar); the other ranks' output goes to
    <run folder>/logs/<run id>/attempt_<n>/<rank>/std{out,err}.log.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runner import forensics, peak

    peak.write(cfg, lay.world_size, frozen.parent)  # before the ranks start: the machine is idle

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    n = lay.world_size
    if cfg.cluster.device == DeviceType.cpu:  # ranks share the cores; as torchrun does, keep OpenMP from oversubscribing
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    run_dir = frozen.parent
    logs = DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects={r: Std.NONE if r == 0 else Std.ALL for r in range(n)})
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=f"runner-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # torchrun --standalone
        max_restarts=0,
        monitor_interval=0.5,
        logs_specs=logs,
    )
    os.environ.update(forensics.rank_env(cfg, run_dir))  # the agent passes its environment to every rank
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "runner.worker", str(frozen))
    except ChildFailedError as e:  # the agent has stopped every rank: assemble the report from their records
        timed_out = "Timed out" in str(e) or any("Timed out" in (r.get("error") or "") for r in forensics.read_records(run_dir).values())
        cause = "collective timeout" if timed_out else "rank failure"
        report = forensics.write_report(cfg, run_dir, n, cause)
        if report is not None:
            print(f"{cause}: report in {report}", file=sys.stderr)
        raise
