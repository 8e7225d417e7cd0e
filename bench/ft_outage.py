"""Lose a replica, keep training: the same SIGKILL under torchrun's elastic restart and under torchft.

    .venv/bin/python bench/ft_outage.py [--steps 40] [--kill-at 4]

Two runs of the debug model on hsdp2x2 (4 CPU ranks), each with one rank of replica group 1 killed with SIGKILL
from this process when it reaches step --kill-at:
- elastic: fault_tolerance=none, cluster.max_restarts=1, checkpoint every --interval steps: torchrun stops
  every rank and restarts the whole job from its newest checkpoint;
- torchft: fault_tolerance=torchft: group 0 trains on alone, group 1 restarts alone and recovers from group 0.
For each: the wall time to finish the run, the steps recomputed (trained twice), and the rank-seconds lost
(ranks x seconds that trained nothing the run kept). tests/test_fault_tolerance.py uses the helpers here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "parallelism=hsdp2x2",
    "training.seq_len=64",
    "logging.progress=false",
    "cluster.worker_start=fork",
    "distributed.heartbeat_s=0.2",
]
FT = [
    "fault_tolerance=torchft",
    "fault_tolerance.timeout_s=10",
    "fault_tolerance.quorum_timeout_s=30",
    "fault_tolerance.connect_timeout_s=10",
    "fault_tolerance.join_timeout_ms=3000",
    "fault_tolerance.heartbeat_timeout_ms=2000",
    "fault_tolerance.process_group_timeout_ms=5000",
]


def start(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    """`python -m runner` in run_dir (its console in run_dir's sibling `<name>.out`)."""
    out = run_dir.parent / f"{run_dir.name}.out"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT)


def record(folder: Path, rank: int) -> dict | None:
    """A rank's heartbeat record (runner.observe.forensics): pid, step, phase."""
    path = folder / "logs" / "ranks" / f"rank_{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(what: str, pred: Callable[[], object], proc: subprocess.Popen, timeout_s: float):
    """Poll pred() until it is truthy; fail when the run ended first or timeout_s passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit code {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {timeout_s} s")


def kill_rank_at(folder: Path, rank: int, step: int, proc: subprocess.Popen, timeout_s: float = 600) -> tuple[int, float]:
    """SIGKILL `rank` of the job in `folder` once its record says it trains `step`; (pid, time.time() of the kill)."""
    rec = wait_for(f"rank {rank} at step {step}", lambda: (r := record(folder, rank)) and r["step"] >= step and r, proc, timeout_s)
    os.kill(rec["pid"], signal.SIGKILL)
    return rec["pid"], time.time()


def committed(folder: Path) -> list[dict]:
    """The rows of steps that counted (every row with fault tolerance off)."""
    return [r for r in rows(folder) if r.get("ft_committed", True)]


def measure(run_dir: Path, folder: Path, overrides: list[str], kill_at: int, steps: int) -> dict:
    """One run with rank 1 of `folder`'s job killed at `kill_at`: wall time, steps trained twice, and when the killed
    job's rank 0 (a new process) first trained a step past the kill (its heartbeat record, polled here)."""
    t0 = time.time()
    proc = start(run_dir, [*overrides, f"training.steps={steps}"])
    before = wait_for("rank 0's record", lambda: record(folder, 0), proc, 600)["pid"]
    _, killed = kill_rank_at(folder, 1, kill_at, proc)
    back = None
    while proc.poll() is None:
        rec = record(folder, 0)
        if back is None and rec and rec["pid"] != before and rec["step"] > kill_at and rec["phase"] not in ("start-up", "data"):
            back = time.time()
        time.sleep(0.05)
    trained = [r["step"] for r in committed(folder)]
    return {
        "exit": proc.returncode,
        "wall_s": time.time() - t0,
        "lost_s": (back or time.time()) - killed,
        "steps_recomputed": len(trained) - len(set(trained)),
        "steps_trained": len(set(trained)),
    }


def rank_seconds_lost(res: dict, world: int, elastic: bool) -> float:
    """Ranks x seconds from the kill until the restarted ranks train a step the run keeps: every rank with elastic
    restarts (the survivors are stopped too), the dead group's ranks with torchft (the others train on)."""
    return res["lost_s"] * (world if elastic else world // 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=4)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint interval of the elastic run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ft_outage"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    ckpt = ["checkpoint=local", f"checkpoint.interval={a.interval}", "checkpoint.async_save=false"]
    el_dir, ft_dir = a.out / f"elastic_{stamp}", a.out / f"torchft_{stamp}"
    el = measure(el_dir, el_dir, [*COMMON, *ckpt, "cluster.max_restarts=1"], a.kill_at, a.steps)
    ft = measure(ft_dir, ft_dir / "replica_1", [*COMMON, *FT, *ckpt], a.kill_at, a.steps)
    for name, res, elastic in (("elastic", el, True), ("torchft", ft, False)):
        print(
            f"{name:8s} exit {res['exit']}  wall {res['wall_s']:.1f} s  steps {res['steps_trained']}  "
            f"recomputed {res['steps_recomputed']}  "
            f"rank-seconds lost {rank_seconds_lost(res, 4, elastic):.1f}"
        )


if __name__ == "__main__":
    main()
