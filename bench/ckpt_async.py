"""Benchmark: what a checkpoint costs the step loop, asynchronous (DCP async_save) vs synchronous (dcp.save).

python bench/ckpt_async.py [--reps 2] [--steps 8] [--seq-len 256] [--layout dp2_tp2]

Runs the same job side by side, alternating, with no checkpoints, with a synchronous checkpoint every
step and with an asynchronous one every step. A step's cost is its loop time plus the time the save
held the loop (`step_time_s + checkpoint_s` in metrics.jsonl): an async save's background write shows up
in the following step's time, since it shares the cores. Prints the medians (first step left out),
the ratios to the run without checkpoints, and what one save held the loop, sync vs async.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "none": ["checkpoint=none"],
    "sync": ["checkpoint=local", "checkpoint.interval=1", "checkpoint.async_save=false"],
    "async": ["checkpoint=local", "checkpoint.interval=1", "checkpoint.async_save=true"],
}


def run(tmp: Path, name: str, a) -> list[dict]:
    run_dir = tmp / name
    argv = [sys.executable, "-m", "runner", f"parallelism={a.layout}", f"training.steps={a.steps}", f"training.seq_len={a.seq_len}"]
    argv += ["logging.progress=false", "checkpoint.keep=2", f"hydra.run.dir={run_dir}", *MODES[name.split("-")[0]]]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layout", default="dp2_tp2")
    a = ap.parse_args()
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.reps):
            for mode in MODES:
                rows[mode] += run(Path(d), f"{mode}-{rep}", a)
                print(f"rep {rep} {mode}: done", file=sys.stderr, flush=True)
    cost = {m: statistics.median(r["step_time_s"] + r.get("checkpoint_s", 0.0) for r in rs) for m, rs in rows.items()}
    held = {m: statistics.median(r["checkpoint_s"] for r in rows[m]) for m in ("sync", "async")}
    print(f"{a.layout}, seq {a.seq_len}, {a.steps} steps x {a.reps} reps per mode, a checkpoint every step (medians, step 1 left out)")
    for m in MODES:
        extra = f", save held the loop {held[m]:.3f} s" if m in held else ""
        print(f"  {m:<5}  step + save {cost[m]:.3f} s   ratio to none {cost[m] / cost['none']:.3f}{extra}")
    print(f"  async / sync step + save: {cost['async'] / cost['sync']:.3f}; held async / sync: {held['async'] / held['sync']:.3f}")
    over = {m: cost[m] - cost["none"] for m in ("sync", "async")}
    print(f"  extra seconds per step: sync {over['sync']:.3f}, async {over['async']:.3f}")


if __name__ == "__main__":
    main()
