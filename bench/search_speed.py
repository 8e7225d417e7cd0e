"""Benchmark: how long mode=search takes for Llama 3 405B on 16,384 GPUs (target: <= 4 s on this machine).

python bench/search_speed.py [--reps 5] [--baseline REV] [--only 405B]
Runs `python -m runner mode=search` for the 405B search (and the 70B one on 1,024 GPUs) --reps times each,
alternating, end to end (process start to exit: imports, Hydra's composition, the search, the report and the
sweep files). Prints per search the median wall time, the median CPU time of the process (what the search
costs when the machine is shared: wall time also counts waiting for a core), the median of the search
alone as it reports itself, the candidate count, and the load average while it ran.

With --baseline REV the same searches run in a checkout of REV (a temporary git worktree), each run of this
checkout beside one of REV's so that both see the same machine load, and the ratios this/baseline are printed.
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
TARGET_S = 4.0


def _once(tree: Path, argv: list[str], run_dir: Path) -> tuple[float, float, float, int]:
    """(wall s, CPU s of the child, the search's own seconds, candidates)."""
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "mode=search", *argv, f"hydra.run.dir={run_dir}"],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    m = re.search(r"([\d,]+) candidates, .* in ([\d.]+) s", proc.stdout)
    return wall, cpu, float(m.group(2)), int(m.group(1).replace(",", ""))


def _medians(runs: list[tuple[float, float, float, int]]) -> tuple[float, float, float]:
    return tuple(statistics.median(r[k] for r in runs) for k in range(3))


def _time(trees: dict[str, Path], searches: dict[str, list[str]], reps: int, tmp: str) -> dict[tuple[str, str], list]:
    """Every search in every tree, reps times, one tree's run beside the other's."""
    got: dict[tuple[str, str], list] = {(t, s): [] for s in searches for t in trees}
    load = []
    for i in range(reps):
        for name, argv in searches.items():
            for tree, path in trees.items():
                got[tree, name].append(_once(path, argv, Path(tmp, f"{tree}-{name[:4]}-{i}")))
                load.append(os.getloadavg()[0])
    print(f"load average (1 min) while running: median {statistics.median(load):.1f} on {os.cpu_count()} cores")
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", help="a git revision to time side by side with this checkout")
    ap.add_argument("--only", help="time only the searches whose name contains this (e.g. 405B)")
    a = ap.parse_args()
    searches = {k: v for k, v in SEARCHES.items() if not a.only or a.only in k}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if a.baseline:
            trees["baseline"] = Path(tmp, "baseline")
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(trees["baseline"]), a.baseline], cwd=ROOT, check=True)
        try:
            got = _time(trees, searches, a.reps, tmp)
        finally:
            if a.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["baseline"])], cwd=ROOT, check=True)
    for (tree, name), runs in got.items():
        wall, cpu, own = _medians(runs)
        print(
            f"[{tree}] {name}: {runs[0][3]:,} candidates; end to end median wall {wall:.2f} s, CPU {cpu:.2f} s; "
            f"the search itself {own:.2f} s; wall / target {wall / TARGET_S:.2f}, CPU / target {cpu / TARGET_S:.2f} "
            f"(target {TARGET_S:g} s; {a.reps} runs: {', '.join(f'{r[0]:.2f}' for r in runs)} s wall)"
        )
    if a.baseline:
        for name in searches:
            (w, c, s), (bw, bc, bs) = _medians(got["this", name]), _medians(got["baseline", name])
            print(f"this/baseline ({a.baseline}), {name}: wall {w / bw:.2f}, CPU {c / bc:.2f}, the search itself {s / bs:.2f}")


if __name__ == "__main__":
    main()
