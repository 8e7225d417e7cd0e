"""Benchmark: what a checkpoint costs the step loop, asynchronous (DCP async_save) vs synchronous (dcp.save),
with and without the per-file CRC-32 of COMPLETE.json (checkpoint.checksum).

python bench/ckpt_async.py [--reps 2] [--steps 8] [--seq-len 256] [--layout dp2_tp2] [--modes none,sync,...]

Runs the same job side by side, alternating, with no checkpoints and with a checkpoint every step in each
mode (sync/async, `_nocrc`: checksums off). A step's cost is its loop time plus the time the save held the
loop (`step_time_s + checkpoint_s` in metrics.jsonl): an async save's background write (and rank 0's
checksums) shows up in the following step's time, since it shares the cores. Prints the medians (first
step left out), the ratios to the run without checkpoints, what one save held the loop, the ratio with /
without checksums, and the time to checksum one checkpoint folder alone.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from runner.formats import checkpoint  # noqa: E402

MODES = {
    "none": ["checkpoint=none"],
    "sync": ["checkpoint=local", "checkpoint.interval=1", "checkpoint.async_save=false"],
    "async": ["checkpoint=local", "checkpoint.interval=1", "checkpoint.async_save=true"],
    "sync_nocrc": ["checkpoint=local", "checkpoint.interval=1", "checkpoint.async_save=false", "checkpoint.checksum=false"],
    "async_nocrc": ["checkpoint=local", "checkpoint.interval=1", "checkpoint.async_save=true", "checkpoint.checksum=false"],
}


def run(tmp: Path, name: str, a) -> list[dict]:
    run_dir = tmp / name
    argv = [sys.executable, "-m", "runner", f"parallelism={a.layout}", f"training.steps={a.steps}", f"training.seq_len={a.seq_len}"]
    argv += ["logging.progress=false", "checkpoint.keep=2", f"hydra.run.dir={run_dir}", *MODES[name.rsplit("-", 1)[0]]]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def checksum_s(folder: Path, reps: int = 5) -> tuple[float, float]:
    """Median seconds to CRC-32 every file of one checkpoint folder (what rank 0 adds per save), and its size in MB."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        checkpoint.file_records(folder)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(p.stat().st_size for p in folder.iterdir()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layout", default="dp2_tp2")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)} (none is always run)")
    a = ap.parse_args()
    modes = ["none", *(m for m in a.modes.split(",") if m != "none")]
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.reps):
            for mode in modes:
                rows[mode] += run(Path(d), f"{mode}-{rep}", a)
                print(f"rep {rep} {mode}: done", file=sys.stderr, flush=True)
        kept = sorted((Path(d) / f"{modes[-1]}-0" / "checkpoints").glob("step-*"), key=checkpoint.step_of) if modes[-1] != "none" else []
        crc = checksum_s(kept[-1]) if kept else None
    cost = {m: statistics.median(r["step_time_s"] + r.get("checkpoint_s", 0.0) for r in rs) for m, rs in rows.items()}
    held = {m: statistics.median(r["checkpoint_s"] for r in rows[m]) for m in modes if m != "none"}
    print(f"{a.layout}, seq {a.seq_len}, {a.steps} steps x {a.reps} reps per mode, a checkpoint every step (medians, step 1 left out)")
    for m in modes:
        extra = f", save held the loop {held[m]:.3f} s" if m in held else ""
        print(f"  {m:<11}  step + save {cost[m]:.3f} s   ratio to none {cost[m] / cost['none']:.3f}{extra}")
    if {"sync", "async"} <= set(modes):
        print(f"  async / sync step + save: {cost['async'] / cost['sync']:.3f}; held async / sync: {held['async'] / held['sync']:.3f}")
    for m in ("sync", "async"):
        if {m, f"{m}_nocrc"} <= set(modes):
            ratio = cost[m] / cost[f"{m}_nocrc"]
            print(f"  {m} with / without checksums: step + save {ratio:.3f}, held {held[m] / held[f'{m}_nocrc']:.3f}")
    if crc:
        print(f"  CRC-32 of one checkpoint folder alone: {crc[0]:.3f} s for {crc[1]:.1f} MB ({crc[1] / 1e3 / crc[0]:.2f} GB/s)")
    over = {m: cost[m] - cost["none"] for m in held}
    print("  extra seconds per step: " + ", ".join(f"{m} {v:.3f}" for m, v in over.items()))


if __name__ == "__main__":
    main()
