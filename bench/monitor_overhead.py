"""Benchmark: what the straggler monitor, loss guard, flight recorder and rank records cost per step.

python bench/monitor_overhead.py [--reps 3] [--steps 12] [--seq-len 256]
1. Side by side: the default layout (dp_shard=2 x tp=2, 4 CPU ranks) with the monitors at their defaults
   and with them off (straggler, guard, flight recorder), alternating; prints median tokens/s and the ratio.
   Single reps vary by ~5 % on a shared 2-core machine, more than the budget, so 2. is the sharper figure.
2. Cost of the hooks themselves, timed in one process (gloo, world size 1): a phase context (two clock
   reads, a record mark), one straggler window (all_gather_single + judging), one rank-record heartbeat,
   scaled to the step: 9 hook calls per step at 2 microbatches plus one window every `interval` steps plus one
   heartbeat per second of step time.
"""

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
OFF = ["monitor.straggler.enable=false", "monitor.guard.enable=false", "distributed.flight_recorder.enable=false"]


def run(tmp: Path, name: str, a, extra: list[str]) -> dict:
    run_dir = tmp / name
    argv = [sys.executable, "-m", "runner", "parallelism=dp2_tp2", f"training.steps={a.steps}", f"training.seq_len={a.seq_len}"]
    argv += ["logging.progress=false", f"hydra.run.dir={run_dir}", *extra]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    return json.loads((run_dir / "summary.json").read_text())


def hooks(interval: int) -> dict[str, float]:
    """Seconds per hook call, measured in this process on a one-rank gloo group."""
    import torch.distributed as dist

    from runner.config.layout import Layout
    from runner.config.schema import RunConfig
    from runner.observe import forensics, monitor
    from runner.run.device import DevicePolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    cfg, lay = RunConfig(), Layout(1, 1, 1, 1, 1)
    with tempfile.TemporaryDirectory() as d:
        rec = forensics.RankRecorder(cfg, Path(d), 0, lay.coords(0))
        rec.groups = forensics._groups()
        mon = monitor.StepMonitor(cfg.monitor, DevicePolicy.of(cfg.cluster, cfg.distributed), lay.coords, 0, rec, Path(d))
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            with mon.phase("forward"):
                pass
        phase = (time.perf_counter() - t0) / n
        mon.s.interval = interval
        mon.window = [{p: 0.1 for p in monitor.TIMED}] * (interval - 1)
        mon.step, t0 = 2, time.perf_counter()
        reps = 200
        for _ in range(reps):
            mon.window = mon.window[: interval - 1]
            mon.end_step()
        window = (time.perf_counter() - t0) / reps
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            rec._beat()
        beat_wall, beat_cpu = (time.perf_counter() - t0) / reps, (time.thread_time() - c0) / reps
    dist.destroy_process_group()
    # the heartbeat runs on its own thread and its file rename waits outside the GIL: CPU time is what it takes from training
    return {"phase_s": phase, "window_s": window, "heartbeat_s": beat_cpu, "heartbeat_wall_s": beat_wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--interval", type=int, default=10, help="monitor.straggler.interval (default 10)")
    a = p.parse_args()
    on, off, step_s = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.reps):
            s_on = run(Path(d), f"on{i}", a, [])
            s_off = run(Path(d), f"off{i}", a, OFF)
            on.append(s_on["tokens_per_s_median"])
            off.append(s_off["tokens_per_s_median"])
            step_s.append(s_on["step_time_s_median"])
            print(f"rep {i}: monitors on {on[-1]:.1f} tokens/s, off {off[-1]:.1f} tokens/s", flush=True)
    r, q = statistics.median(on), statistics.median(off)
    print(f"side by side: median tokens/s on {r:.1f}, off {q:.1f}; ratio on/off = {r / q:.3f}")
    h = hooks(a.interval)
    step = statistics.median(step_s)
    per_step = 9 * h["phase_s"] + h["window_s"] / a.interval + h["heartbeat_s"] * step / 1.0
    print(
        f"hooks: phase {h['phase_s'] * 1e6:.1f} us, window {h['window_s'] * 1e3:.2f} ms, heartbeat {h['heartbeat_s'] * 1e3:.2f} ms CPU "
        f"({h['heartbeat_wall_s'] * 1e3:.2f} ms wall); "
        f"per step {per_step * 1e3:.3f} ms of a {step:.2f} s median step = {100 * per_step / step:.3f} % (budget 1 %)"
    )


if __name__ == "__main__":
    main()
