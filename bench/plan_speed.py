"""Benchmark: how long planning takes, torch-free (targets: < 1.5 s per layout, < 60 s for 100).

python bench/plan_speed.py [--reps 7] [--baseline REV]
Times `python -m runner recipe=llama3_70b_h100x1024 mode=plan` end to end (process start
to exit) --reps times and prints the median; then one Hydra multirun of 100 layouts
(tp 1,2,4,8 x pp 1,2,4,8,16 x cp 1,2,4,8,16) and prints its wall time, seconds per point
and how many points were valid or recorded as invalid.

With --baseline REV the same is timed for a checkout of REV (a temporary git worktree), the
single plans alternating between the two so that both see the same machine load, and the
ratios this/baseline are printed.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED = ["recipe=llama3_70b_h100x1024", "mode=plan"]
GRID = ["parallelism.tp=1,2,4,8", "parallelism.pp=1,2,4,8,16", "parallelism.cp=1,2,4,8,16"]


def _wall(tree: Path, argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "runner", *argv], cwd=tree, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(tree)}
    )
    return time.perf_counter() - t0


def _sweep(tree: Path, out: Path) -> tuple[float, int, int]:
    wall = _wall(tree, ["-m", *SEED, *GRID, f"hydra.sweep.dir={out}"])
    return wall, len(list(out.glob("*/plan.json"))), len(list(out.glob("*/invalid.json")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--baseline", help="a git revision to time side by side with this checkout")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if a.baseline:
            base = Path(tmp, "baseline")
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), a.baseline], cwd=ROOT, check=True)
            trees["baseline"] = base
        try:
            single: dict[str, list[float]] = {name: [] for name in trees}
            for i in range(a.reps):
                for name, tree in trees.items():
                    single[name].append(_wall(tree, [*SEED, f"hydra.run.dir={tmp}/{name}-single{i}"]))
            sweeps = {name: _sweep(tree, Path(tmp, f"{name}-sweep")) for name, tree in trees.items()}
        finally:
            if a.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["baseline"])], cwd=ROOT, check=True)
        for name in trees:
            times = single[name]
            wall, plans, invalid = sweeps[name]
            print(f"[{name}] one plan: median {statistics.median(times):.2f} s over {a.reps} runs ({', '.join(f'{s:.2f}' for s in times)})")
            print(f"[{name}] 100-layout multirun: {wall:.1f} s ({wall / 100:.2f} s per point; {plans} planned, {invalid} invalid)")
        if a.baseline:
            ratio = statistics.median(single["this"]) / statistics.median(single["baseline"])
            print(f"this/baseline ({a.baseline}): one plan {ratio:.2f}, multirun {sweeps['this'][0] / sweeps['baseline'][0]:.2f}")


if __name__ == "__main__":
    main()
