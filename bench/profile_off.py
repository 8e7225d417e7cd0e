"""Benchmark: with profile.* off, the step time is today's, within the bench's own run-to-run spread.

python bench/profile_off.py [--base <git commit>] [--reps 3] [--steps 6]

Checks out --base (default: the commit before the profiler came, 83f6ed5) into a temporary git worktree, then
trains the default run (`python -m runner`, dp2_tp2 on 4 CPU ranks) alternately with that code and with this
checkout's, --reps times each, and prints each side's median step times (summary.json's, warm-up left out), the
spread of each side (max - min over its runs, relative to its median) and the difference of the two medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = "83f6ed5"


def run_once(code: Path, steps: int, out: Path) -> float:
    argv = [sys.executable, "-m", "runner", f"training.steps={steps}", "logging.progress=false", f"hydra.run.dir={out}"]
    subprocess.run(argv, cwd=code, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(code)})
    return json.loads((out / "summary.json").read_text())["step_time_s_median"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help="the commit to compare with")
    ap.add_argument("--reps", type=int, default=3, help="runs per side, alternated")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    a = ap.parse_args()
    started = time.perf_counter()
    times: dict[str, list[float]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), a.base], cwd=ROOT, check=True, capture_output=True)
        try:
            for r in range(a.reps):
                for side in ("base", "this") if r % 2 == 0 else ("this", "base"):
                    code = base if side == "base" else ROOT
                    times[side].append(run_once(code, a.steps, Path(tmp) / f"{side}{r}"))
                    print(f"rep {r} {side}: median step {times[side][-1]:.3f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (max(v) - min(v)) / med[k] for k, v in times.items()}
    diff = med["this"] / med["base"] - 1
    for side, label in (("base", f"base {a.base}"), ("this", "this checkout, profile off")):
        runs = ", ".join(f"{t:.3f}" for t in times[side])
        print(f"{label}: median {med[side]:.3f} s, spread {100 * spread[side]:.1f} % ({runs})")
    verdict = "within" if abs(diff) <= max(spread.values()) else "OUTSIDE"
    print(f"difference {100 * diff:+.1f} %: {verdict} the bench's run-to-run spread ({100 * max(spread.values()):.1f} %)")
    load = os.getloadavg()
    print(f"bench wall time {time.perf_counter() - started:.0f} s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
