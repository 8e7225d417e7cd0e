"""Benchmark: how long mode=search takes for Llama 3 405B on 16,384 GPUs (target: < 5 s on this machine).

python bench/search_speed.py [--reps 5]
Runs `python -m runner mode=search` for the 405B search (and the 70B one on 1,024 GPUs) --reps times each,
alternating, end to end (process start to exit: imports, Hydra's composition, the search, the report and the
sweep files). Prints per search the median wall time, the median CPU time of the process (what the search
costs when the machine is shared: wall time also counts waiting for a core), the median of the search
alone as it reports itself, the candidate count, and the load average while it ran.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEARCHES = {
    "405B on 16,384 H100": [
        "recipe=llama3_70b_h100x1024",
        "model=llama3_405b",
        "cluster.num_nodes=2048",
        "training.seq_len=8192",
        "training.global_batch_size=2048",
    ],
    "70B on 1,024 H100": ["recipe=llama3_70b_h100x1024"],
}
TARGET_S = 5.0


def _once(argv: list[str], run_dir: Path) -> tuple[float, float, float, int]:
    """(wall s, CPU s of the child, the search's own seconds, candidates)."""
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "mode=search", *argv, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    m = re.search(r"([\d,]+) candidates, .* in ([\d.]+) s", proc.stdout)
    return wall, cpu, float(m.group(2)), int(m.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    got: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in SEARCHES}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.reps):
            for name, argv in SEARCHES.items():
                got[name].append(_once(argv, Path(tmp, f"{len(got[name])}-{i}-{name[:4]}")))
                load.append(os.getloadavg()[0])
    print(f"load average (1 min) while running: median {statistics.median(load):.1f} on {os.cpu_count()} cores")
    for name, runs in got.items():
        wall, cpu, own = (statistics.median(r[k] for r in runs) for k in range(3))
        print(
            f"{name}: {runs[0][3]:,} candidates; end to end median wall {wall:.2f} s, CPU {cpu:.2f} s; "
            f"the search itself {own:.2f} s; wall / target {wall / TARGET_S:.2f}, CPU / target {cpu / TARGET_S:.2f} "
            f"(target {TARGET_S:g} s; {a.reps} runs: {', '.join(f'{r[0]:.2f}' for r in runs)} s wall)"
        )


if __name__ == "__main__":
    main()
