"""Benchmark: how long planning takes, torch-free (targets: < 1.5 s per layout, < 60 s for 100).

python bench/plan_speed.py [--reps 5]
Times `python -m runner recipe=llama3_70b_h100x1024 mode=plan` end to end (process start
to exit) --reps times and prints the median; then one Hydra multirun of 100 layouts
(tp 1,2,4,8 x pp 1,2,4,8,16 x cp 1,2,4,8,16) and prints its wall time, seconds per point
and how many points were valid or recorded as invalid.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED = ["recipe=llama3_70b_h100x1024", "mode=plan"]


def _wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "runner", *argv], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        single = [_wall([*SEED, f"hydra.run.dir={tmp}/single{i}"]) for i in range(a.reps)]
        print(f"one plan: median {statistics.median(single):.2f} s over {a.reps} runs ({', '.join(f'{s:.2f}' for s in single)})")
        grid = ["parallelism.tp=1,2,4,8", "parallelism.pp=1,2,4,8,16", "parallelism.cp=1,2,4,8,16"]
        wall = _wall(["-m", *SEED, *grid, f"hydra.sweep.dir={tmp}/sweep"])
        plans, invalid = len(list(Path(tmp, "sweep").glob("*/plan.json"))), len(list(Path(tmp, "sweep").glob("*/invalid.json")))
        print(f"100-layout multirun: {wall:.1f} s ({wall / 100:.2f} s per point; {plans} planned, {invalid} invalid)")


if __name__ == "__main__":
    main()
